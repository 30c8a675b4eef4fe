"""The embedded few-step sampler: it generates the student's rollouts inside the RolloutManager actor.

Math (docs/architecture.md; diffusers ``FlowMatchEulerDiscreteScheduler``; tianweiy/DMD2 backward simulation):

* σ schedule: ``FlowNoiseSchedule`` (``--diffusion-num-steps``, ``--diffusion-flow-shift`` or
  ``--diffusion-timesteps``), σ_0 = 1 > ... > σ_{S−1} > σ_S = 0; the model's timestep is ``t_k = σ_k · 1000``.
* Velocity with optional CFG: ``v = v_uncond + w·(v_cond − v_uncond)``; ``w = 1`` runs no unconditional forward.
* x0 prediction: ``x̂0_k = x_k − σ_k·v_k`` (float32).
* Step rules: ``"dmd2"`` (default) re-noises the x0 prediction with **fresh** noise,
  ``x_{k+1} = (1 − σ_{k+1})·x̂0_k + σ_{k+1}·ε_k``; ``"euler"`` takes the ODE step ``x_{k+1} = x_k + (σ_{k+1} − σ_k)·v_k``.
  Both end in ``x_S = x̂0_{S−1}``.

Seeds: sample b's initial noise comes from ``stable_hash("init_noise", seed, rollout_id, sample_index)``, the DMD2
re-noise at step k from ``stable_hash("renoise", seed, rollout_id, sample_index, k)``; noise is drawn on the CPU so it
does not depend on the device. A batch gives bit-identical results when it is run again with the same prompts,
indices and settings, whichever steps the samples stop at: every sample of the batch is carried to the last step
any of them needs, so the batch composition of each forward never changes.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.models.base import ModelFamily, PromptEncoder
from miles.utils.flow_schedule import FlowNoiseSchedule
from miles.utils.misc import make_generator
from miles.utils.types import DenoisingEnv, DiTTrajectory, Sample

__all__ = [
    "STEP_RULES",
    "DenoiseResult",
    "DiffusionEngine",
    "default_device",
    "denoise",
    "initial_noise",
    "needs_negative",
    "renoise_noise",
    "sample_images",
    "sample_latents",
]

logger = logging.getLogger(__name__)

STEP_RULES = ("dmd2", "euler")


def default_device() -> torch.device:
    """CUDA when this process sees a GPU, else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def initial_noise(shape: tuple[int, ...], seed: int, rollout_id: int | str, sample_indices: list[int]) -> torch.Tensor:
    """Standard normal float32 ``(B, *shape)``; row b from ``stable_hash("init_noise", seed, rollout_id, index_b)``."""
    return torch.stack(
        [
            torch.randn(shape, generator=make_generator("init_noise", seed, rollout_id, index))
            for index in sample_indices
        ]
    )


def renoise_noise(
    shape: tuple[int, ...], seed: int, rollout_id: int | str, sample_indices: list[int], step: int
) -> torch.Tensor:
    """The DMD2 rule's fresh noise after step ``step``: float32 ``(B, *shape)`` from
    ``stable_hash("renoise", seed, rollout_id, index_b, step)``."""
    return torch.stack(
        [
            torch.randn(shape, generator=make_generator("renoise", seed, rollout_id, index, step))
            for index in sample_indices
        ]
    )


@dataclass
class DenoiseResult:
    """Output of ``denoise`` for a batch of B samples.

    Attributes:
        latents: ``latents[k]`` is ``x_k``, float32 ``(B, C, H, W)`` on CPU, for each run step k (empty if not recorded).
        x0_preds: ``x0_preds[k]`` is ``x̂0_k``, same layout.
        final: ``x_S`` float32 ``(B, C, H, W)`` on CPU when the batch ran all S steps, else None.
    """

    latents: list[torch.Tensor]
    x0_preds: list[torch.Tensor]
    final: torch.Tensor | None


@torch.no_grad()
def denoise(
    family: ModelFamily,
    denoiser: nn.Module,
    noise: torch.Tensor,
    cond: dict[str, torch.Tensor],
    schedule: FlowNoiseSchedule,
    *,
    neg_cond: dict[str, torch.Tensor] | None = None,
    guidance_scale: float = 1.0,
    step_rule: str = "dmd2",
    last_step: int | None = None,
    fresh_noise: Callable[[int], torch.Tensor] | None = None,
    record: bool = True,
) -> DenoiseResult:
    """Run steps ``0..last_step`` of the flow sampler on a batch.

    Args:
        family: supplies ``predict_velocity``.
        denoiser: the velocity model (eval mode); the latents follow it to its device.
        noise: float32 ``(B, C, H, W)``, the initial ``x_0`` (pure noise at σ_0).
        cond: batched positive cond kwargs.
        schedule: σ grid with S steps and the terminal 0.
        neg_cond: batched negative cond kwargs, required when ``guidance_scale != 1``.
        guidance_scale: CFG scale w.
        step_rule: ``"dmd2"`` or ``"euler"``.
        last_step: last step to run (default S − 1, the full trajectory).
        fresh_noise: ``fresh_noise(k) -> (B, C, H, W)`` draws the DMD2 rule's noise after step k.
        record: keep ``x_k`` and ``x̂0_k`` of every step (off for evaluation).

    Raises:
        ValueError: on an unknown step rule, a missing negative cond under CFG, a missing ``fresh_noise`` for the
            DMD2 rule or ``last_step`` outside ``[0, S)``.
    """
    num_steps = schedule.num_steps
    last_step = num_steps - 1 if last_step is None else last_step
    if step_rule not in STEP_RULES:
        raise ValueError(f"--diffusion-step-rule {step_rule!r} is unknown; choose one of {list(STEP_RULES)}")
    if guidance_scale != 1.0 and not neg_cond:
        raise ValueError(f"guidance scale {guidance_scale} needs the negative prompt's cond, but none was encoded")
    if step_rule == "dmd2" and fresh_noise is None and last_step > 0:
        raise ValueError("the dmd2 step rule needs fresh_noise(step) to re-noise between steps")
    if not 0 <= last_step < num_steps:
        raise ValueError(f"last_step {last_step} is outside the schedule's steps [0, {num_steps})")

    device = next(denoiser.parameters()).device
    x = noise.to(device, torch.float32)
    batch = x.shape[0]
    result = DenoiseResult(latents=[], x0_preds=[], final=None)
    for k in range(last_step + 1):
        sigma, sigma_next = float(schedule.sigmas[k]), float(schedule.sigmas[k + 1])
        timestep = torch.full((batch,), float(schedule.timesteps[k]), dtype=torch.float32, device=device)
        v = family.predict_velocity(denoiser, x, timestep, cond)
        if guidance_scale != 1.0:
            v_uncond = family.predict_velocity(denoiser, x, timestep, neg_cond)
            v = v_uncond + guidance_scale * (v - v_uncond)
        x0 = x - sigma * v
        if record:
            result.latents.append(x.cpu())
            result.x0_preds.append(x0.cpu())
        if k == last_step:
            if k == num_steps - 1:
                result.final = (x0 if step_rule == "dmd2" else x + (sigma_next - sigma) * v).cpu()
            break
        if step_rule == "dmd2":
            x = (1.0 - sigma_next) * x0 + sigma_next * fresh_noise(k).to(device, torch.float32)
        else:
            x = x + (sigma_next - sigma) * v
    return result


def _latent_shape(family: ModelFamily, denoiser: nn.Module) -> tuple[int, int, int]:
    config = getattr(denoiser, "config", None)
    if config is not None and "in_channels" in config and "sample_size" in config:
        return (int(config["in_channels"]), int(config["sample_size"]), int(config["sample_size"]))
    return family.latent_shape(family.pipeline_path)


@torch.no_grad()
def sample_latents(
    family: ModelFamily,
    denoiser: nn.Module,
    encoder: PromptEncoder,
    prompts: list[str],
    *,
    num_steps: int,
    shift: float,
    guidance_scale: float,
    step_rule: str,
    seed: int,
    sample_indices: list[int] | None = None,
    negative_prompt: str = "",
    batch_size: int = 64,
    rollout_id: int | str = "eval",
    timesteps: list[float] | None = None,
    num_train_timesteps: int = 1000,
) -> torch.Tensor:
    """Sample full trajectories without Ray (evaluation, teacher previews).

    Teacher preview: ``num_steps=28, step_rule="euler", guidance_scale=7``; student: ``num_steps=4,
    step_rule="dmd2", guidance_scale=1``. Sample b uses the engine's seeds with ``(seed, rollout_id,
    sample_indices[b])``, so ``DiffusionEngine.generate`` with the same values and batch returns the same samples.

    Args:
        prompts: B prompts.
        sample_indices: B seed indices (default ``0..B−1``).
        batch_size: samples per denoiser forward (chunks of the B samples, in order).

    Returns:
        float32 latents ``(B, C, H, W)`` on CPU.
    """
    if sample_indices is None:
        sample_indices = list(range(len(prompts)))
    if len(sample_indices) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(sample_indices)} sample indices")
    schedule = FlowNoiseSchedule(num_steps, shift, num_train_timesteps, timesteps=timesteps)
    shape = _latent_shape(family, denoiser)
    neg_all = family.encode_prompts(encoder, [negative_prompt]) if guidance_scale != 1.0 else None
    outputs = []
    for start in range(0, len(prompts), batch_size):
        chunk_prompts = prompts[start : start + batch_size]
        chunk_indices = sample_indices[start : start + batch_size]
        cond = family.encode_prompts(encoder, chunk_prompts)
        neg = None
        if neg_all is not None:
            neg = {key: value.expand(len(chunk_prompts), *value.shape[1:]) for key, value in neg_all.items()}
        result = denoise(
            family,
            denoiser,
            initial_noise(shape, seed, rollout_id, chunk_indices),
            cond,
            schedule,
            neg_cond=neg,
            guidance_scale=guidance_scale,
            step_rule=step_rule,
            fresh_noise=lambda k, idx=chunk_indices: renoise_noise(shape, seed, rollout_id, idx, k),
            record=False,
        )
        outputs.append(result.final)
    return torch.cat(outputs)


def sample_images(family: ModelFamily, denoiser: nn.Module, encoder: PromptEncoder, prompts: list[str], **kwargs):
    """``sample_latents`` decoded by the family: uint8 images ``(B, H, W, C)``. Keyword arguments as there."""
    return family.latents_to_images(sample_latents(family, denoiser, encoder, prompts, **kwargs))


def needs_negative(args: Any, guidance_scale: float | None = None) -> bool:
    """Whether any consumer needs the negative prompt's cond.

    True when the student rollout runs CFG (``guidance_scale``, default ``--diffusion-guidance-scale``, is not 1) or
    when ``--loss-type dmd2`` scores with teacher CFG (``--dmd2-teacher-guidance-scale > 1``), even though the
    student's own rollout is unguided (seed [DMD2 4/7] left this open), and when ``--sft-uncond-prob > 0``.
    """
    if guidance_scale is None:
        guidance_scale = getattr(args, "diffusion_guidance_scale", 1.0)
    teacher_scale = 1.0
    if getattr(args, "loss_type", None) == "dmd2":
        teacher_scale = getattr(args, "dmd2_teacher_guidance_scale", 1.0)
    # SFT conditioning dropout trains the unconditional velocity on the negative prompt's cond.
    sft_dropout = getattr(args, "sft_uncond_prob", 0.0) > 0
    return guidance_scale != 1.0 or teacher_scale > 1.0 or sft_dropout


def _row(cond: dict[str, torch.Tensor], b: int) -> dict[str, torch.Tensor]:
    # clone: a view would pickle its whole batch storage into every sample's shard
    return {key: value[b].clone() for key, value in cond.items()}


class DiffusionEngine:
    """The student's sampler: encodes prompts, draws seeded noise, runs the few-step schedule, stops at given steps.

    Args:
        args: run args; reads ``rollout_seed``, ``diffusion_num_steps``, ``diffusion_flow_shift``,
            ``diffusion_timesteps``, ``diffusion_guidance_scale``, ``diffusion_step_rule``, ``negative_prompt``,
            ``loss_type`` and ``dmd2_teacher_guidance_scale``.
        family: the pipeline's model family.
        pipeline_path: the student pipeline directory (``--hf-checkpoint``).
        encoder: an already loaded text encoder to share (default: load the family's).
        device: where the denoiser runs (default: CUDA if visible, else CPU).
        dtype: denoiser weight dtype.
    """

    def __init__(
        self,
        args: Any,
        family: ModelFamily,
        pipeline_path: str | Path,
        *,
        encoder: PromptEncoder | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.args = args
        self.family = family
        self.device = torch.device(device) if device is not None else default_device()
        self.denoiser = family.load_denoiser(pipeline_path, dtype=dtype).to(self.device)
        self.encoder = encoder if encoder is not None else family.load_text_encoder(pipeline_path)
        scheduler = family.load_scheduler_config(pipeline_path)
        self.num_train_timesteps = scheduler["num_train_timesteps"]
        self.schedule = FlowNoiseSchedule(
            args.diffusion_num_steps,
            args.diffusion_flow_shift,
            self.num_train_timesteps,
            timesteps=getattr(args, "diffusion_timesteps", None),
        )
        self.latent_shape = _latent_shape(family, self.denoiser)
        self.step_rule = getattr(args, "diffusion_step_rule", "dmd2")
        if self.step_rule not in STEP_RULES:
            raise ValueError(f"--diffusion-step-rule {self.step_rule!r} is unknown; choose one of {list(STEP_RULES)}")
        logger.info("diffusion engine: %s on %s, %s, rule %s", family.name, self.device, self.schedule, self.step_rule)

    @property
    def num_steps(self) -> int:
        return self.schedule.num_steps

    def needs_negative(self, guidance_scale: float | None = None) -> bool:
        """``needs_negative(self.args, guidance_scale)``."""
        return needs_negative(self.args, guidance_scale)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        sample_indices: list[int],
        rollout_id: int,
        *,
        stop_steps: list[int | None] | None = None,
        guidance_scale: float | None = None,
        need_negative: bool | None = None,
        metadata: list[dict] | None = None,
    ) -> list[Sample]:
        """Generate one rollout batch.

        Args:
            prompts: B prompts (repeat a prompt for several samples of it).
            sample_indices: B indices within the rollout; they key the noise seeds.
            rollout_id: the rollout; part of the noise seeds.
            stop_steps: per sample, the step i at which to stop (``[i]`` returned with x_i, x̂0_i, no final) or None
                for the full trajectory (all steps and the final sample). Default: all None.
            guidance_scale: CFG scale (default ``--diffusion-guidance-scale``).
            need_negative: encode the negative prompt even without CFG (default ``needs_negative``).
            metadata: per-sample data-source fields copied to ``Sample.metadata``.

        Returns:
            B ``Sample``s in input order, each with ``env`` (cond of its prompt; ``neg_cond`` filled when needed)
            and ``trajectory``.

        Raises:
            ValueError: on length mismatches or a stop step outside ``[0, S)``.
        """
        batch = len(prompts)
        if len(sample_indices) != batch or (stop_steps is not None and len(stop_steps) != batch):
            raise ValueError(
                f"generate got {batch} prompts, {len(sample_indices)} sample indices and "
                f"{None if stop_steps is None else len(stop_steps)} stop steps; they must match"
            )
        stop_steps = [None] * batch if stop_steps is None else list(stop_steps)
        for index, step in zip(sample_indices, stop_steps):
            if step is not None and not 0 <= step < self.num_steps:
                raise ValueError(
                    f"sample {index}: stop step {step} is outside [0, {self.num_steps}); check "
                    "--diffusion-step-strategy-path and --diffusion-num-steps"
                )
        guidance_scale = (
            getattr(self.args, "diffusion_guidance_scale", 1.0) if guidance_scale is None else guidance_scale
        )
        if need_negative is None:
            need_negative = self.needs_negative(guidance_scale)
        need_negative = need_negative or guidance_scale != 1.0

        cond = self.family.encode_prompts(self.encoder, prompts)
        neg_row, neg = {}, None
        if need_negative:
            neg_one = self.family.encode_prompts(self.encoder, [getattr(self.args, "negative_prompt", "")])
            neg_row = _row(neg_one, 0)
            neg = {key: value.expand(batch, *value.shape[1:]) for key, value in neg_one.items()}

        seed = self.args.rollout_seed
        last_step = max(self.num_steps - 1 if step is None else step for step in stop_steps)
        result = denoise(
            self.family,
            self.denoiser,
            initial_noise(self.latent_shape, seed, rollout_id, sample_indices),
            cond,
            self.schedule,
            neg_cond=neg,
            guidance_scale=guidance_scale,
            step_rule=self.step_rule,
            last_step=last_step,
            fresh_noise=lambda k: renoise_noise(self.latent_shape, seed, rollout_id, sample_indices, k),
        )
        latents = torch.stack(result.latents, dim=1)  # (B, last_step + 1, C, H, W)
        x0_preds = torch.stack(result.x0_preds, dim=1)
        samples = []
        for b, (prompt, index, step) in enumerate(zip(prompts, sample_indices, stop_steps)):
            steps = list(range(self.num_steps)) if step is None else [step]
            trajectory = DiTTrajectory(
                sigmas=self.schedule.sigmas.clone(),
                timesteps=self.schedule.timesteps.clone(),
                step_indices=steps,
                latents=latents[b, steps].clone(),
                x0_preds=x0_preds[b, steps].clone(),
                final=result.final[b].clone() if step is None else None,
            )
            samples.append(
                Sample(
                    index=index,
                    prompt=prompt,
                    metadata=dict(metadata[b]) if metadata is not None else {},
                    # neg_row is shared by all samples: pickle stores one copy per shard
                    env=DenoisingEnv(pos_cond=_row(cond, b), neg_cond=neg_row, guidance_scale=guidance_scale),
                    trajectory=trajectory,
                )
            )
        return samples

    def sample(
        self,
        prompts: list[str],
        sample_indices: list[int],
        *,
        num_steps: int | None = None,
        guidance_scale: float | None = None,
        rollout_id: int | str = "eval",
        batch_size: int = 64,
    ) -> torch.Tensor:
        """Full trajectories with the engine's weights and settings; float32 latents ``(B, C, H, W)``.

        ``num_steps`` overrides ``--diffusion-num-steps`` (then ``--diffusion-timesteps`` is ignored).
        """
        args = self.args
        return sample_latents(
            self.family,
            self.denoiser,
            self.encoder,
            prompts,
            num_steps=num_steps or self.num_steps,
            shift=args.diffusion_flow_shift,
            guidance_scale=(
                getattr(args, "diffusion_guidance_scale", 1.0) if guidance_scale is None else guidance_scale
            ),
            step_rule=self.step_rule,
            seed=args.rollout_seed,
            sample_indices=sample_indices,
            negative_prompt=getattr(args, "negative_prompt", ""),
            batch_size=batch_size,
            rollout_id=rollout_id,
            timesteps=None if num_steps else getattr(args, "diffusion_timesteps", None),
            num_train_timesteps=self.num_train_timesteps,
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full (unsharded) student state dict of CPU tensors into the denoiser.

        Raises:
            RuntimeError: when keys are missing or unexpected (the trainer and engine hold different models).
        """
        dtype = next(self.denoiser.parameters()).dtype
        state_dict = {key: value.to(self.device, dtype) for key, value in state_dict.items()}
        missing, unexpected = self.denoiser.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise RuntimeError(
                f"update_weights: the student state dict does not match the engine's denoiser "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}); were --hf-checkpoint and the trainer's model "
                "built from the same pipeline?"
            )
