"""The stock diffusers scheduler configs that make a family's stock pipeline sample a miles student's grid.

The ``--save-hf`` export of a family with ``stock_scheduler`` replaces the scheduler with a stock one whose ``step``
is the student's rule and whose ``set_timesteps`` builds the student's σ grid as the family's pipeline calls it
(:func:`miles.models.sampling_schedule.write_sampling_schedule` writes it):

* rule ``dmd2`` → ``FlowMatchLCMScheduler``: its ``step`` predicts ``x0 = x − σ·v`` and re-noises it,
  ``(1 − σ_next)·x0 + σ_next·ε`` with fresh ε (at the last step σ_next = 0, so it returns x0);
* rule ``euler`` → ``FlowMatchEulerDiscreteScheduler``: ``x + (σ_next − σ)·v``.

Three ways a stock pipeline calls ``set_timesteps``, one config for each:

* ``set_timesteps(S, mu=...)`` (``StableDiffusion3Pipeline``): :func:`stock_scheduler_config`. Both schedulers'
  ``set_timesteps(S)`` (diffusers 0.42; the code is shared) take ``u = linspace(σ_max, σ_min, S)`` of their
  1000-point training grid, map it by ``f_m(u) = m·u / (1 + (m − 1)·u)`` (a static config: m = ``shift``, and
  σ_min = f_shift(1/1000); ``use_dynamic_shifting``: m = e^mu, and σ_min = 1/1000) and, with ``shift_terminal``,
  scale ``1 − σ`` so that the last σ is that value. miles' grid is ``σ = f_k(linspace(1, 1/S, S))``. With a static
  ``shift`` = k the ends do not match (σ_min is not 1/S), so the plain config samples another grid: k = 3, S = 4
  gives σ = 1, 0.86, 0.60, 0.009 instead of 1, 0.9, 0.75, 0.5. The dynamic map with a constant mu and a terminal
  value reaches the student's grid exactly::

      use_dynamic_shifting = True, base_shift = max_shift = ln m   (the pipeline's mu is then ln m at any resolution)
      shift_terminal = f_k(1/S)                                      (the student's last σ)
      m = R / (R − 1),  R = d·S·k / (k − 1),  d = (1 − σ_min) / (S − 1)     (m = 1 when k = 1)

  Derivation: with ``u_i = 1 − i·d`` and ``s_i = 1 − i/S``, ``1 − f_m(u_i) = i·d / (m − (m − 1)·i·d)`` and
  ``1 − f_k(s_i) = (i/S) / (k − (k − 1)·i/S)``; the scaled ``c·(1 − f_m(u_i))`` equals ``1 − f_k(s_i)`` for every i
  when ``c·d·S·k = m`` and ``c·(k − 1) = m − 1``. The σ it builds equal miles' float64 grid rounded to float32
  (bit for bit at the shifts 0.5–7 and 1–50 steps tried); diffusers rounds the timesteps ``σ·1000`` in float32, so
  they can differ from miles' by one float32 ulp (6e-5 at 1000). S = 1 needs none of it (the static config gives
  σ = [1]). Explicit ``--diffusion-timesteps`` fit no config: the export writes the static scheduler at ``shift`` 1
  and the call passes ``sigmas=[t / 1000, ...]``.
* ``set_timesteps(sigmas=linspace(1, 1/S, S), mu=...)`` (``QwenImagePipeline``, ``FluxPipeline``,
  ``Flux2KleinPipeline``): the unshifted spacing is already miles', so a static config with ``shift`` = k builds
  miles' grid (the ``mu`` they pass is ignored without ``use_dynamic_shifting``), and the dynamic config above would
  shift the wrong points (k = 3, S = 4: σ = 1, 0.881, 0.722, 0.5): :func:`sigmas_call_scheduler_config`.
* ``set_timesteps(S)`` with neither (``WanPipeline``): :func:`terminal_scheduler_config`.

A family returns its pipeline's config from ``ModelFamily.stock_scheduler_config`` (docs/families.md, "Exporting a
student to the stock pipelines"). A leaf of :mod:`miles.models`: it imports no family and no registry.
"""

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from miles.utils.sampling import FlowNoiseSchedule

__all__ = [
    "SCHEDULE_KEYS",
    "STOCK_SCHEDULERS",
    "StudentSchedule",
    "sigmas_call_scheduler_config",
    "stock_scheduler_config",
    "terminal_scheduler_config",
]

logger = logging.getLogger(__name__)

# scheduler_config.json keys of the student's schedule, written beside a stock config by the export
# (miles.models.sampling_schedule); private: "_" keeps diffusers quiet and preserves them
SCHEDULE_KEYS = {
    "num_steps": "_miles_num_inference_steps",
    # the student's k: a stock config may need another "shift" to build its grid (Wan's m, below)
    "shift": "_miles_flow_shift",
    "step_rule": "_miles_step_rule",
    "timesteps": "_miles_timesteps",
    "guidance_scale": "_miles_guidance_scale",
    "distilled_guidance_scale": "_miles_distilled_guidance_scale",
}

# the diffusers scheduler class whose step() is each miles step rule
STOCK_SCHEDULERS = {"dmd2": "FlowMatchLCMScheduler", "euler": "FlowMatchEulerDiscreteScheduler"}


@dataclass(frozen=True)
class StudentSchedule:
    """The student's sampling schedule, the keywords every config function here takes.

    Attributes:
        num_steps: the student's step count S ≥ 1 (ignored when ``timesteps`` is given).
        shift: the flow shift k > 0 of the grid ``σ = shift_k(linspace(1, 1/S, S))``.
        step_rule: ``"dmd2"`` or ``"euler"``.
        num_train_timesteps: the model's timestep scale (1000).
        timesteps: explicit descending timesteps in (0, num_train_timesteps]; sampled through ``sigmas=``.
    """

    num_steps: int
    shift: float
    step_rule: str
    num_train_timesteps: int = 1000
    timesteps: list[float] | None = None

    def grid(self) -> tuple[FlowNoiseSchedule, type]:
        """The student's grid and the stock scheduler class of its step rule.

        Raises:
            ValueError: on an unknown step rule or a grid :class:`~miles.utils.sampling.FlowNoiseSchedule` rejects.
        """
        import diffusers

        if self.step_rule not in STOCK_SCHEDULERS:
            raise ValueError(f"step rule {self.step_rule!r} is unknown; choose one of {list(STOCK_SCHEDULERS)}")
        grid = FlowNoiseSchedule(self.num_steps, self.shift, self.num_train_timesteps, timesteps=self.timesteps)
        return grid, getattr(diffusers, STOCK_SCHEDULERS[self.step_rule])


def _full_config(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` as the full config ``save_pretrained`` would write for ``cls``."""
    return json.loads(cls(**kwargs).to_json_string())


def stock_scheduler_config(**schedule: Any) -> dict[str, Any]:
    """The diffusers scheduler config that samples the student's schedule with stock ``StableDiffusion3Pipeline``.

    The class is ``STOCK_SCHEDULERS[step_rule]``; the grid settings are derived in this module's docstring. The
    config is what ``save_pretrained`` writes (``_class_name``, ``_diffusers_version`` and every init argument),
    without the ``_miles_*`` keys: ``shift`` is the student's k, except with explicit timesteps (then 1: the σ passed
    to the call are already shifted). Logs a warning if the installed diffusers builds another grid from it.

    Args:
        schedule: the keywords of :class:`StudentSchedule`.

    Raises:
        ValueError: on an unknown step rule or a grid :class:`~miles.utils.sampling.FlowNoiseSchedule` rejects.
        TypeError: on a keyword :class:`StudentSchedule` does not have.
    """
    student = StudentSchedule(**schedule)
    grid, cls = student.grid()
    num_steps, shift = student.num_steps, student.shift
    kwargs: dict[str, Any] = {"num_train_timesteps": student.num_train_timesteps, "shift": float(shift)}
    if student.timesteps is not None:
        kwargs["shift"] = 1.0
    elif num_steps > 1:
        # diffusers' own σ_min of the unshifted 1000-point grid (1/1000 rounded to float32), as set_timesteps reads it
        sigma_min = cls(num_train_timesteps=student.num_train_timesteps, use_dynamic_shifting=True).sigma_min
        d = (1.0 - sigma_min) / (num_steps - 1)
        if shift == 1.0:
            m = 1.0
        else:
            r = d * num_steps * shift / (shift - 1.0)
            m = r / (r - 1.0)
        kwargs.update(
            use_dynamic_shifting=True,
            time_shift_type="exponential",
            base_shift=math.log(m),
            max_shift=math.log(m),
            shift_terminal=float(grid.sigmas[-2]),  # the last σ
        )
    config = _full_config(cls, kwargs)
    if student.timesteps is None:
        _warn_unless_grid(config, grid, mu=config["base_shift"] if config.get("use_dynamic_shifting") else None)
    return config


def sigmas_call_scheduler_config(**schedule: Any) -> dict[str, Any]:
    """The stock scheduler config for a pipeline that passes ``sigmas = linspace(1, 1/S, S)`` (and a ``mu``) to
    ``set_timesteps`` itself: ``QwenImagePipeline``, ``FluxPipeline``, ``Flux2KleinPipeline`` (docs/families.md,
    "Exporting a student to the stock pipelines").

    A static ``shift`` = k maps that spacing to miles' ``f_k(linspace(1, 1/S, S))`` exactly (the pipeline's ``mu``
    is ignored without ``use_dynamic_shifting``); explicit timesteps use ``shift`` 1, the call passing
    ``sigmas=[t / 1000, ...]`` (:func:`miles.models.sampling_schedule.stock_sampling_kwargs`). The keywords and the
    errors as :func:`stock_scheduler_config`. Logs a warning if the installed diffusers builds another grid.
    """
    import numpy as np

    student = StudentSchedule(**schedule)
    grid, cls = student.grid()
    explicit = student.timesteps is not None
    static = 1.0 if explicit else float(student.shift)
    config = _full_config(cls, {"num_train_timesteps": student.num_train_timesteps, "shift": static})
    steps = student.num_steps
    sigmas = grid.sigmas[:-1].tolist() if explicit else np.linspace(1.0, 1 / steps, steps)
    _warn_unless_grid(config, grid, sigmas=sigmas, mu=0.5)
    return config


def terminal_scheduler_config(**schedule: Any) -> dict[str, Any] | None:
    """The stock scheduler config for a pipeline that calls ``set_timesteps(S)`` with neither ``sigmas`` nor ``mu``
    (``WanPipeline``), or None for explicit timesteps, which such a call cannot take.

    A static scheduler spaces ``u = linspace(1, f_m(δ), S)`` (δ = 1 / ``num_train_timesteps``, its σ_min is the
    shifted end of its training grid), maps it by ``f_m`` and, with ``shift_terminal``, stretches ``1 − σ`` so the
    last σ is that value. With ``shift_terminal = f_k(1/S)`` it builds miles' ``f_k(linspace(1, 1/S, S))`` when m
    is the smaller root of ``δ·m² + (1 − δ)(1 − R)·m + R(1 − δ) = 0``, ``R = S·k / ((S − 1)(k − 1))`` (m = 1 for
    k = 1 or S = 1; derivation in docs/families.md, Wan). Logs a warning if the installed diffusers builds another
    grid. The keywords and the errors as :func:`stock_scheduler_config`.
    """
    student = StudentSchedule(**schedule)
    grid, cls = student.grid()
    if student.timesteps is not None:
        return None
    num_steps, shift = student.num_steps, student.shift
    kwargs: dict[str, Any] = {"num_train_timesteps": student.num_train_timesteps, "shift": 1.0}
    if num_steps > 1:
        delta = 1.0 / student.num_train_timesteps
        if shift != 1.0:
            r = num_steps * shift / ((num_steps - 1) * (shift - 1.0))
            b = (1.0 - delta) * (1.0 - r)
            c = r * (1.0 - delta)
            kwargs["shift"] = (-b - math.sqrt(b * b - 4.0 * delta * c)) / (2.0 * delta)
        kwargs["shift_terminal"] = float(grid.sigmas[-2])  # the student's last σ
    config = _full_config(cls, kwargs)
    _warn_unless_grid(config, grid)
    return config


def _warn_unless_grid(config: dict, schedule: FlowNoiseSchedule, **call) -> None:
    """Log a warning unless ``set_timesteps(S, **call)`` of ``config``'s scheduler builds ``schedule``'s σ (float32,
    to 1 ulp)."""
    import diffusers
    import torch

    scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
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
