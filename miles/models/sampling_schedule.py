"""The student's sampling schedule, recorded in an exported pipeline's scheduler config.

The trainer's ``--save-hf`` export (any model family) writes the engine's schedule into
``<dir>/scheduler/scheduler_config.json``, so that the exported pipeline samples with it by default. Besides the
scheduler's own ``shift`` the keys are private (``_miles_*``): diffusers keeps keys that start with ``_`` through
``from_pretrained`` / ``save_pretrained`` without warning, whereas plain unknown keys make every load log that they
"are not expected and will be ignored". miles' own readers (``DigitsPipeline``, the evaluation) read these keys.

Stock diffusers (``stock_scheduler=True``, the ``sd3`` family's export) reads none of them, so the export also
replaces the scheduler itself with a stock one whose ``step`` is the student's rule and whose
``set_timesteps(num_inference_steps=S)`` builds the student's σ grid (:func:`stock_scheduler_config`):

* rule ``dmd2`` → ``FlowMatchLCMScheduler``: its ``step`` predicts ``x0 = x − σ·v`` and re-noises it,
  ``(1 − σ_next)·x0 + σ_next·ε`` with fresh ε (at the last step σ_next = 0, so it returns x0);
* rule ``euler`` → ``FlowMatchEulerDiscreteScheduler``: ``x + (σ_next − σ)·v``.

The grid. Both schedulers' ``set_timesteps(S)`` (diffusers 0.42; the code is shared) take ``u = linspace(σ_max,
σ_min, S)`` of their 1000-point training grid, map it by ``f_m(u) = m·u / (1 + (m − 1)·u)`` (a static config:
m = ``shift``, and σ_min = f_shift(1/1000); ``use_dynamic_shifting``: m = e^mu, and σ_min = 1/1000) and, with
``shift_terminal``, scale ``1 − σ`` so that the last σ is that value. miles' grid is ``σ = f_k(linspace(1, 1/S,
S))``. With a static ``shift`` = k the ends do not match (σ_min is not 1/S), so the plain config samples another
grid: k = 3, S = 4 gives σ = 1, 0.86, 0.60, 0.009 instead of 1, 0.9, 0.75, 0.5. The dynamic map with a constant mu
and a terminal value reaches the student's grid exactly::

    use_dynamic_shifting = True, base_shift = max_shift = ln m   (the pipeline's mu is then ln m at any resolution)
    shift_terminal = f_k(1/S)                                      (the student's last σ)
    m = R / (R − 1),  R = d·S·k / (k − 1),  d = (1 − σ_min) / (S − 1)     (m = 1 when k = 1)

Derivation: with ``u_i = 1 − i·d`` and ``s_i = 1 − i/S``, ``1 − f_m(u_i) = i·d / (m − (m − 1)·i·d)`` and
``1 − f_k(s_i) = (i/S) / (k − (k − 1)·i/S)``; the scaled ``c·(1 − f_m(u_i))`` equals ``1 − f_k(s_i)`` for every i
when ``c·d·S·k = m`` and ``c·(k − 1) = m − 1``. The σ it builds equal miles' float64 grid rounded to float32
(bit for bit at the shifts 0.5–7 and 1–50 steps tried); diffusers rounds the timesteps ``σ·1000`` in float32, so
they can differ from miles' by one float32 ulp (6e-5 at 1000). S = 1 needs none of it (the static config gives σ = [1]). Explicit ``--diffusion-timesteps`` fit
no config: the export writes the static scheduler at ``shift`` 1 and the call passes ``sigmas=[t / 1000, ...]``
(:func:`stock_sampling_kwargs`).

Pipelines that pass the σ themselves. ``QwenImagePipeline``, ``FluxPipeline`` and ``Flux2KleinPipeline`` call
``set_timesteps(sigmas=linspace(1, 1/S, S), mu=...)``: the unshifted spacing is already miles', so a static config
with ``shift`` = k builds miles' grid (the ``mu`` they pass is ignored without ``use_dynamic_shifting``), and the
dynamic config above would shift the wrong points (k = 3, S = 4: σ = 1, 0.881, 0.722, 0.5).
:func:`sigmas_call_scheduler_config` writes that config; a family whose pipeline calls the scheduler so returns
it from ``ModelFamily.stock_scheduler_config`` (docs/families.md, "Exporting a student to the stock pipelines").

Re-noise. ``StableDiffusion3Pipeline.__call__`` does not pass its ``generator`` to ``scheduler.step``, so
``FlowMatchLCMScheduler`` draws the re-noise from torch's global RNG on the pipeline's device; the ``generator``
only draws the initial latents. Seed ``torch.manual_seed`` before the call to repeat a sample. miles draws both
per sample from ``stable_hash`` seeds, so the same seed gives other (equally distributed) samples in miles and in
diffusers.
"""

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.models.base import read_json
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
# scheduler_config.json keys of the student's schedule (private: "_" keeps diffusers quiet and preserves them)
SCHEDULE_KEYS = {
    "num_steps": "_miles_num_inference_steps",
    # the student's k: a stock config may need another "shift" to build its grid (Wan's m, the module docstring)
    "shift": "_miles_flow_shift",
    "step_rule": "_miles_step_rule",
    "timesteps": "_miles_timesteps",
    "guidance_scale": "_miles_guidance_scale",
    "distilled_guidance_scale": "_miles_distilled_guidance_scale",
}
# the diffusers scheduler class whose step() is each miles step rule
STOCK_SCHEDULERS = {"dmd2": "FlowMatchLCMScheduler", "euler": "FlowMatchEulerDiscreteScheduler"}


def _scheduler_config_path(pipeline_dir: str | os.PathLike) -> Path:
    return Path(pipeline_dir) / "scheduler" / "scheduler_config.json"


def _replace_json(path: Path, data: dict) -> None:
    # Replace rather than rewrite: an exported pipeline hard-links its source's files, which must stay unchanged.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _scheduler_class(name: str):
    import diffusers

    return getattr(diffusers, name)


def stock_scheduler_config(
    *,
    num_steps: int,
    shift: float,
    step_rule: str,
    num_train_timesteps: int = 1000,
    timesteps: list[float] | None = None,
) -> dict[str, Any]:
    """The diffusers scheduler config that samples the student's schedule with stock ``StableDiffusion3Pipeline``.

    The class is ``STOCK_SCHEDULERS[step_rule]``; the grid settings are derived in this module's docstring. The
    config is what ``save_pretrained`` writes (``_class_name``, ``_diffusers_version`` and every init argument),
    without the ``_miles_*`` keys. Logs a warning if the installed diffusers builds another grid from it.

    Args:
        num_steps: the student's step count S ≥ 1 (ignored when ``timesteps`` is given).
        shift: the flow shift k > 0 of the grid ``σ = shift_k(linspace(1, 1/S, S))``; ``shift`` of the config,
            except with explicit timesteps (then ``shift`` is 1: the σ passed to the call are already shifted).
        step_rule: ``"dmd2"`` or ``"euler"``.
        num_train_timesteps: the model's timestep scale (1000).
        timesteps: explicit descending timesteps in (0, num_train_timesteps]; sampled through ``sigmas=``.

    Raises:
        ValueError: on an unknown step rule or a grid :class:`~miles.utils.sampling.FlowNoiseSchedule` rejects.
    """
    if step_rule not in STOCK_SCHEDULERS:
        raise ValueError(f"step rule {step_rule!r} is unknown; choose one of {list(STOCK_SCHEDULERS)}")
    FlowNoiseSchedule(num_steps, shift, num_train_timesteps, timesteps=timesteps)  # validates
    cls = _scheduler_class(STOCK_SCHEDULERS[step_rule])
    kwargs: dict[str, Any] = {"num_train_timesteps": num_train_timesteps, "shift": float(shift)}
    if timesteps is not None:
        kwargs["shift"] = 1.0
    elif num_steps > 1:
        # diffusers' own σ_min of the unshifted 1000-point grid (1/1000 rounded to float32), as set_timesteps reads it
        sigma_min = cls(num_train_timesteps=num_train_timesteps, use_dynamic_shifting=True).sigma_min
        d = (1.0 - sigma_min) / (num_steps - 1)
        if shift == 1.0:
            m = 1.0
        else:
            r = d * num_steps * shift / (shift - 1.0)
            m = r / (r - 1.0)
        terminal = float(FlowNoiseSchedule(num_steps, shift, num_train_timesteps).sigmas[-2])  # the last σ
        kwargs.update(
            use_dynamic_shifting=True,
            time_shift_type="exponential",
            base_shift=math.log(m),
            max_shift=math.log(m),
            shift_terminal=terminal,
        )
    config = json.loads(cls(**kwargs).to_json_string())
    if timesteps is None:
        mu = config["base_shift"] if config.get("use_dynamic_shifting") else None
        _warn_unless_grid(config, FlowNoiseSchedule(num_steps, shift, num_train_timesteps), mu=mu)
    return config


def sigmas_call_scheduler_config(
    *,
    num_steps: int,
    shift: float,
    step_rule: str,
    num_train_timesteps: int = 1000,
    timesteps: list[float] | None = None,
) -> dict[str, Any]:
    """The stock scheduler config for a pipeline that passes ``sigmas = linspace(1, 1/S, S)`` (and a ``mu``) to
    ``set_timesteps`` itself: ``QwenImagePipeline``, ``FluxPipeline``, ``Flux2KleinPipeline`` (docs/families.md,
    "Exporting a student to the stock pipelines").

    A static ``shift`` = k maps that spacing to miles' ``f_k(linspace(1, 1/S, S))`` exactly (the pipeline's ``mu``
    is ignored without ``use_dynamic_shifting``); explicit timesteps use ``shift`` 1, the call passing
    ``sigmas=[t / 1000, ...]`` (:func:`stock_sampling_kwargs`). Arguments and errors as
    :func:`stock_scheduler_config`. Logs a warning if the installed diffusers builds another grid.
    """
    if step_rule not in STOCK_SCHEDULERS:
        raise ValueError(f"step rule {step_rule!r} is unknown; choose one of {list(STOCK_SCHEDULERS)}")
    schedule = FlowNoiseSchedule(num_steps, shift, num_train_timesteps, timesteps=timesteps)
    cls = _scheduler_class(STOCK_SCHEDULERS[step_rule])
    config = _check_config(
        cls, {"num_train_timesteps": num_train_timesteps, "shift": 1.0 if timesteps is not None else float(shift)}
    )
    import numpy as np

    sigmas = schedule.sigmas[:-1].tolist() if timesteps is not None else np.linspace(1.0, 1 / num_steps, num_steps)
    _warn_unless_grid(config, schedule, sigmas=sigmas, mu=0.5)
    return config


def terminal_scheduler_config(
    *,
    num_steps: int,
    shift: float,
    step_rule: str,
    num_train_timesteps: int = 1000,
    timesteps: list[float] | None = None,
) -> dict[str, Any] | None:
    """The stock scheduler config for a pipeline that calls ``set_timesteps(S)`` with neither ``sigmas`` nor ``mu``
    (``WanPipeline``), or None for explicit timesteps, which such a call cannot take.

    A static scheduler spaces ``u = linspace(1, f_m(δ), S)`` (δ = 1 / ``num_train_timesteps``, its σ_min is the
    shifted end of its training grid), maps it by ``f_m`` and, with ``shift_terminal``, stretches ``1 − σ`` so the
    last σ is that value. With ``shift_terminal = f_k(1/S)`` it builds miles' ``f_k(linspace(1, 1/S, S))`` when m
    is the smaller root of ``δ·m² + (1 − δ)(1 − R)·m + R(1 − δ) = 0``, ``R = S·k / ((S − 1)(k − 1))`` (m = 1 for
    k = 1 or S = 1; derivation in docs/families.md, Wan). Logs a warning if the installed diffusers builds another
    grid. Arguments and errors as :func:`stock_scheduler_config`.
    """
    if step_rule not in STOCK_SCHEDULERS:
        raise ValueError(f"step rule {step_rule!r} is unknown; choose one of {list(STOCK_SCHEDULERS)}")
    schedule = FlowNoiseSchedule(num_steps, shift, num_train_timesteps, timesteps=timesteps)
    if timesteps is not None:
        return None
    cls = _scheduler_class(STOCK_SCHEDULERS[step_rule])
    kwargs: dict[str, Any] = {"num_train_timesteps": num_train_timesteps, "shift": 1.0}
    if num_steps > 1:
        delta = 1.0 / num_train_timesteps
        if shift != 1.0:
            r = num_steps * shift / ((num_steps - 1) * (shift - 1.0))
            b = (1.0 - delta) * (1.0 - r)
            c = r * (1.0 - delta)
            kwargs["shift"] = (-b - math.sqrt(b * b - 4.0 * delta * c)) / (2.0 * delta)
        kwargs["shift_terminal"] = float(schedule.sigmas[-2])  # the student's last σ
    config = _check_config(cls, kwargs)
    _warn_unless_grid(config, schedule)
    return config


def _warn_unless_grid(config: dict, schedule: FlowNoiseSchedule, **call) -> None:
    """Log a warning unless ``set_timesteps(S, **call)`` of ``config``'s scheduler builds ``schedule``'s σ (float32,
    to 1 ulp)."""
    import torch

    scheduler = _scheduler_class(config["_class_name"]).from_config(config)
    if "sigmas" in call:
        scheduler.set_timesteps(**call)
    else:
        scheduler.set_timesteps(schedule.num_steps, **call)
    sigmas = schedule.sigmas.float()
    if scheduler.sigmas.shape != sigmas.shape or not torch.allclose(scheduler.sigmas, sigmas, rtol=0, atol=1e-7):
        logger.warning(
            "the installed diffusers builds the grid %s from %s instead of %s; sample the export with miles",
            scheduler.sigmas.tolist(),
            config["_class_name"],
            schedule,
        )


def _check_config(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` as the full config ``save_pretrained`` would write for ``cls``."""
    return json.loads(cls(**kwargs).to_json_string())


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
        model_index = read_json(index_path, "pipeline model_index.json")
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
