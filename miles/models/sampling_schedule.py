"""The student's sampling schedule, recorded in an exported pipeline's scheduler config.

The trainer's ``--save-hf`` export (any model family) writes the engine's schedule into
``<dir>/scheduler/scheduler_config.json``, so that the exported pipeline samples with it by default. Besides the
scheduler's own ``shift`` the keys are private (``_miles_*``): diffusers keeps keys that start with ``_`` through
``from_pretrained`` / ``save_pretrained`` without warning, whereas plain unknown keys make every load log that they
"are not expected and will be ignored". miles' own readers (``DigitsPipeline``, the evaluation) read these keys.

Stock diffusers (``stock_scheduler=True``) reads none of them, so the export also replaces the scheduler itself with
the stock one of the student's step rule whose ``set_timesteps`` builds the student's σ grid as the family's pipeline
calls it: the family's ``stock_scheduler_config``, one of the configs of :mod:`miles.models.stock_schedulers` (where
the grids are derived). :func:`stock_sampling_kwargs` gives the stock call's keywords.

Re-noise. ``StableDiffusion3Pipeline.__call__`` does not pass its ``generator`` to ``scheduler.step``, so
``FlowMatchLCMScheduler`` draws the re-noise from torch's global RNG on the pipeline's device; the ``generator``
only draws the initial latents. Seed ``torch.manual_seed`` before the call to repeat a sample. miles draws both
per sample from ``stable_hash`` seeds, so the same seed gives other (equally distributed) samples in miles and in
diffusers.
"""

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.models.pipeline_files import read_json, read_model_index
from miles.models.stock_schedulers import (
    SCHEDULE_KEYS,
    STOCK_SCHEDULERS,
    sigmas_call_scheduler_config,
    stock_scheduler_config,
    terminal_scheduler_config,
)
from miles.utils.sampling import STEP_RULES, FlowNoiseSchedule

__all__ = [
    "SCHEDULE_KEYS",
    "STOCK_SCHEDULERS",
    "TEACHER_NUM_STEPS",
    "TEACHER_STEP_RULE",
    "read_sampling_schedule",
    "sigmas_call_scheduler_config",
    "stock_sampling_kwargs",
    "stock_scheduler_config",
    "terminal_scheduler_config",
    "write_sampling_schedule",
]

logger = logging.getLogger(__name__)

TEACHER_NUM_STEPS = 28
TEACHER_STEP_RULE = "euler"


def _scheduler_config_path(pipeline_dir: str | os.PathLike) -> Path:
    return Path(pipeline_dir) / "scheduler" / "scheduler_config.json"


def _replace_json(path: Path, data: dict) -> None:
    # Replace rather than rewrite: an exported pipeline hard-links its source's files, which must stay unchanged.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


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
        "shift": float(config.get(SCHEDULE_KEYS["shift"], config.get("shift", 1.0))),
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
    stock_scheduler: bool = False,
    stock_config: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
) -> dict:
    """Record the student's step schedule in ``<pipeline_dir>/scheduler/scheduler_config.json``.

    Writes ``shift`` (the scheduler's own key) and the ``_miles_*`` keys of ``SCHEDULE_KEYS``; every other key is
    left as it is. The trainer's export calls it with ``--diffusion-num-steps``, ``--diffusion-flow-shift``,
    ``--diffusion-step-rule``, ``--diffusion-timesteps``, ``--diffusion-guidance-scale``, (DMD2)
    ``--dmd2-teacher-guidance-scale`` and the family's ``stock_scheduler``.

    With ``stock_scheduler`` the scheduler itself is replaced: the config becomes ``stock_config``'s (the family's
    :meth:`~miles.models.base.ModelFamily.stock_scheduler_config`; default :func:`stock_scheduler_config`, made for
    ``StableDiffusion3Pipeline``) plus the ``_miles_*`` keys, and ``model_index.json``'s ``scheduler`` entry names
    its class, so that stock diffusers samples the student's rule on the student's grid (call kwargs:
    :func:`stock_sampling_kwargs`); a pipeline config with an ``is_distilled`` flag (``Flux2KleinPipeline``) gets
    it set when the student samples without CFG, so the stock call never runs CFG on it. When ``stock_config``
    returns None (no stock config samples this schedule) the scheduler is kept and a warning logged.

    Args:
        pipeline_dir: a digits (or SD3) pipeline directory with a ``scheduler/`` folder.
        num_steps: the student's step count S ≥ 1.
        shift: flow shift k of the σ grid (``σ = k·s / (1 + (k−1)·s)``), > 0.
        step_rule: ``"dmd2"`` (re-noise the x0 prediction) or ``"euler"`` (ODE step).
        timesteps: explicit descending timesteps in (0, num_train_timesteps], length ``num_steps``; they override
            ``shift`` when sampling (see :class:`~miles.utils.sampling.FlowNoiseSchedule`).
        guidance_scale: the CFG scale the student samples with (1 for a DMD2 student: CFG is distilled in).
        distilled_guidance_scale: the teacher's CFG scale the student was distilled from (reported beside the
            teacher's figures at that scale); None when unknown.
        stock_scheduler: also write the stock diffusers scheduler of the schedule (see above).
        stock_config: ``stock_config(schedule) -> config | None`` with ``schedule`` = ``{"num_steps", "shift",
            "step_rule", "timesteps", "num_train_timesteps"}``; None: :func:`stock_scheduler_config`.

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
    num_train_timesteps = int(config.get("num_train_timesteps", 1000))
    schedule = FlowNoiseSchedule(num_steps, shift, num_train_timesteps, timesteps=timesteps)
    if schedule.num_steps != num_steps:
        raise ValueError(f"got {schedule.num_steps} explicit timesteps for num_steps={num_steps}; pass one per step")
    config["shift"] = float(shift)
    stock = None
    if stock_scheduler:
        arguments = {
            "num_steps": num_steps,
            "shift": shift,
            "step_rule": step_rule,
            "num_train_timesteps": num_train_timesteps,
            "timesteps": timesteps,
        }
        stock = stock_scheduler_config(**arguments) if stock_config is None else stock_config(arguments)
        if stock is None:
            logger.warning(
                "no stock diffusers scheduler of this family samples %s: %s keeps its scheduler and records the "
                "schedule in _miles_* keys only; sample the export with miles",
                schedule,
                path,
            )
    if stock is not None:
        # Start from the stock class's own config: the old class's keys (Euler's stochastic_sampling) would make
        # every load warn. Private keys (ours and others') are kept.
        private = {key: value for key, value in config.items() if key.startswith("_") and key not in stock}
        config = {**stock, **private}
    config[SCHEDULE_KEYS["shift"]] = float(shift)
    config[SCHEDULE_KEYS["num_steps"]] = int(num_steps)
    config[SCHEDULE_KEYS["step_rule"]] = step_rule
    config[SCHEDULE_KEYS["timesteps"]] = None if timesteps is None else [float(t) for t in timesteps]
    config[SCHEDULE_KEYS["guidance_scale"]] = float(guidance_scale)
    config[SCHEDULE_KEYS["distilled_guidance_scale"]] = (
        None if distilled_guidance_scale is None else float(distilled_guidance_scale)
    )
    _replace_json(path, config)
    if stock is not None:
        index_path = Path(pipeline_dir) / "model_index.json"
        model_index = read_model_index(pipeline_dir)
        updated = {**model_index, "scheduler": ["diffusers", config["_class_name"]]}
        if "is_distilled" in model_index and guidance_scale == 1.0:
            updated["is_distilled"] = True
        if updated != model_index:
            _replace_json(index_path, updated)
    logger.debug("wrote sampling schedule to %s: %s, rule %s", path, schedule, step_rule)
    return read_sampling_schedule(config)


def stock_sampling_kwargs(pipeline_dir: str | os.PathLike, family: Any = None) -> dict[str, Any]:
    """Keyword arguments of the stock pipeline's ``__call__`` that sample an exported student's own schedule.

    ``{"num_inference_steps": S, "guidance_scale": w}`` for a student on a shifted grid (the export's scheduler
    config builds the grid from S), ``{"sigmas": [t / 1000, ...], "guidance_scale": w}`` for explicit
    ``--diffusion-timesteps``; w is the student's own guidance (1 for DMD2). The family adds the size the student
    was trained at (``height``, ``width``, and ``num_frames`` for video) and renames the keywords where its pipeline
    calls them otherwise (``ModelFamily.stock_sampling_kwargs``; Qwen-Image's CFG is ``true_cfg_scale``). Use as
    ``pipe(prompt, **stock_sampling_kwargs(export))``: the stock pipeline's own default size (1024², 81 × 480 × 832)
    is not the export's.

    Args:
        family: the export's model family; None looks it up by ``model_index.json`` (an unregistered pipeline
            class keeps the generic names).

    Raises:
        FileNotFoundError: when the scheduler config is missing.
        ValueError: when the directory is not a student export, or its scheduler is not the stock scheduler of its
            step rule (an export written before the stock schedulers, or of the digits family): sample it with
            miles, or re-export it.
    """
    path = _scheduler_config_path(pipeline_dir)
    config = read_json(path, "scheduler config")
    schedule = read_sampling_schedule(config)
    if not schedule["is_student"]:
        raise ValueError(f"{path} holds no student schedule ({SCHEDULE_KEYS['num_steps']}); is this a teacher?")
    expected = STOCK_SCHEDULERS.get(schedule["step_rule"])
    if config.get("_class_name") != expected:
        raise ValueError(
            f"{path} is a {config.get('_class_name')} config, but the student's {schedule['step_rule']!r} rule "
            f"samples with {expected}; this export does not carry its stock scheduler, sample it with miles"
        )
    kwargs: dict[str, Any] = {"guidance_scale": schedule["guidance_scale"]}
    if schedule["timesteps"] is not None:
        kwargs["sigmas"] = [t / schedule["num_train_timesteps"] for t in schedule["timesteps"]]
    else:
        kwargs["num_inference_steps"] = schedule["num_inference_steps"]
    if family is None:
        from miles.models.registry import get_model_family

        try:
            family = get_model_family(pipeline_dir)
        except ValueError:
            return kwargs
    return family.stock_sampling_kwargs(pipeline_dir, kwargs)
