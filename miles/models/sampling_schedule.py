"""The student's sampling schedule, recorded in an exported pipeline's scheduler config.

The trainer's ``--save-hf`` export (any model family) writes the engine's schedule into
``<dir>/scheduler/scheduler_config.json``, so that the exported pipeline samples with it by default. Besides the
scheduler's own ``shift`` the keys are private (``_miles_*``): diffusers keeps keys that start with ``_`` through
``from_pretrained`` / ``save_pretrained`` without warning, whereas plain unknown keys make every load log that they
"are not expected and will be ignored".
"""

import json
import logging
import os
from pathlib import Path

from miles.models.base import read_json
from miles.utils.sampling import STEP_RULES, FlowNoiseSchedule

__all__ = [
    "SCHEDULE_KEYS",
    "TEACHER_NUM_STEPS",
    "TEACHER_STEP_RULE",
    "read_sampling_schedule",
    "write_sampling_schedule",
]

logger = logging.getLogger(__name__)

TEACHER_NUM_STEPS = 28
TEACHER_STEP_RULE = "euler"
# scheduler_config.json keys of the student's schedule (private: "_" keeps diffusers quiet and preserves them)
SCHEDULE_KEYS = {
    "num_steps": "_miles_num_inference_steps",
    "step_rule": "_miles_step_rule",
    "timesteps": "_miles_timesteps",
    "guidance_scale": "_miles_guidance_scale",
    "distilled_guidance_scale": "_miles_distilled_guidance_scale",
}


def _scheduler_config_path(pipeline_dir: str | os.PathLike) -> Path:
    return Path(pipeline_dir) / "scheduler" / "scheduler_config.json"


def read_sampling_schedule(config: dict) -> dict:
    """The default sampling schedule of a scheduler config (the parsed ``scheduler_config.json`` or
    ``scheduler.config``).

    Returns:
        ``{"num_inference_steps": int, "step_rule": "euler" | "dmd2", "shift": float,
        "timesteps": list[float] | None, "num_train_timesteps": int, "guidance_scale": float,
        "distilled_guidance_scale": float | None, "is_student": bool}``. A config without the ``_miles_*`` keys (a
        teacher) gives ``TEACHER_NUM_STEPS`` Euler steps at its ``shift``, guidance 1.
    """
    timesteps = config.get(SCHEDULE_KEYS["timesteps"])
    distilled = config.get(SCHEDULE_KEYS["distilled_guidance_scale"])
    return {
        "num_inference_steps": int(config.get(SCHEDULE_KEYS["num_steps"], TEACHER_NUM_STEPS)),
        "step_rule": str(config.get(SCHEDULE_KEYS["step_rule"], TEACHER_STEP_RULE)),
        "shift": float(config.get("shift", 1.0)),
        "timesteps": None if timesteps is None else [float(t) for t in timesteps],
        "num_train_timesteps": int(config.get("num_train_timesteps", 1000)),
        "guidance_scale": float(config.get(SCHEDULE_KEYS["guidance_scale"], 1.0)),
        "distilled_guidance_scale": None if distilled is None else float(distilled),
        "is_student": SCHEDULE_KEYS["num_steps"] in config,
    }


def write_sampling_schedule(
    pipeline_dir: str | os.PathLike,
    *,
    num_steps: int,
    shift: float,
    step_rule: str,
    timesteps: list[float] | None = None,
    guidance_scale: float = 1.0,
    distilled_guidance_scale: float | None = None,
) -> dict:
    """Record the student's step schedule in ``<pipeline_dir>/scheduler/scheduler_config.json``.

    Writes ``shift`` (the scheduler's own key) and the ``_miles_*`` keys of ``SCHEDULE_KEYS``; every other key is
    left as it is. The trainer's export calls it with ``--diffusion-num-steps``, ``--diffusion-flow-shift``,
    ``--diffusion-step-rule``, ``--diffusion-timesteps``, ``--diffusion-guidance-scale`` and (DMD2)
    ``--dmd2-teacher-guidance-scale``.

    Args:
        pipeline_dir: a digits (or SD3) pipeline directory with a ``scheduler/`` folder.
        num_steps: the student's step count S ≥ 1.
        shift: flow shift k of the σ grid (``σ = k·s / (1 + (k−1)·s)``), > 0.
        step_rule: ``"dmd2"`` (re-noise the x0 prediction) or ``"euler"`` (ODE step).
        timesteps: explicit descending timesteps in (0, num_train_timesteps], length ``num_steps``; they override
            ``shift`` when sampling (see :class:`~miles.utils.flow_schedule.FlowNoiseSchedule`).
        guidance_scale: the CFG scale the student samples with (1 for a DMD2 student: CFG is distilled in).
        distilled_guidance_scale: the teacher's CFG scale the student was distilled from (reported beside the
            teacher's figures at that scale); None when unknown.

    Returns:
        the schedule as :func:`read_sampling_schedule` reads it back.

    Raises:
        FileNotFoundError: when the scheduler config is missing.
        ValueError: on an unknown step rule, a schedule ``FlowNoiseSchedule`` rejects, or timesteps whose count is
            not ``num_steps``.
    """
    path = _scheduler_config_path(pipeline_dir)
    config = read_json(path, "scheduler config")
    if step_rule not in STEP_RULES:
        raise ValueError(f"step rule {step_rule!r} is unknown; choose one of {list(STEP_RULES)}")
    schedule = FlowNoiseSchedule(num_steps, shift, int(config.get("num_train_timesteps", 1000)), timesteps=timesteps)
    if schedule.num_steps != num_steps:
        raise ValueError(f"got {schedule.num_steps} explicit timesteps for num_steps={num_steps}; pass one per step")
    config["shift"] = float(shift)
    config[SCHEDULE_KEYS["num_steps"]] = int(num_steps)
    config[SCHEDULE_KEYS["step_rule"]] = step_rule
    config[SCHEDULE_KEYS["timesteps"]] = None if timesteps is None else [float(t) for t in timesteps]
    config[SCHEDULE_KEYS["guidance_scale"]] = float(guidance_scale)
    config[SCHEDULE_KEYS["distilled_guidance_scale"]] = (
        None if distilled_guidance_scale is None else float(distilled_guidance_scale)
    )
    # Replace rather than rewrite: an exported pipeline hard-links its source's files, which must stay unchanged.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    logger.info("wrote sampling schedule to %s: %s, rule %s", path, schedule, step_rule)
    return read_sampling_schedule(config)
