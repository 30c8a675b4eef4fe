"""The sampling math of a flow-matching DiT, in one place: σ grids, CFG, x0 predictions, step rules, the denoise loop.

The rollout engine, the exported pipelines, the evaluation and the DMD2 scoring all sample through these functions,
so there is one definition of each formula.

Latents have any rank: a batch is ``(B, *latent_shape)`` with ``latent_shape`` = ``(C, H, W)`` for images or
``(C, F, H, W)`` for video; every formula here acts elementwise or per leading batch row, and the shapes below are
written for images.

Conventions (diffusers ``FlowMatchEulerDiscreteScheduler``, torchtitan's Flux trainer): σ ∈ [0, 1] with 1 = pure
noise, ``x_σ = (1 − σ)·x0 + σ·ε``; the denoiser predicts the velocity ``v = ε − x0`` at ``timestep = σ ·
num_train_timesteps`` (in [0, 1000]), so ``x0 = x_σ − σ·v``. Everything is computed in float32 or wider.

Step rules (tianweiy/DMD2's backward simulation; diffusers ``FlowMatchLCMScheduler.step`` performs the first):

* ``"dmd2"``: predict x0 and re-noise it with **fresh** noise, ``x_{k+1} = (1 − σ_{k+1})·x̂0_k + σ_{k+1}·ε_k``;
* ``"euler"``: the flow ODE step ``x_{k+1} = x_k + (σ_{k+1} − σ_k)·v_k``.

Both end in ``x_S = x̂0_{S−1}`` (the Euler step to σ = 0 is the x0 prediction).

Seeds: sample ``index`` starts from ``stable_hash("init_noise", seed, rollout_id, index)``; the DMD2 re-noise after
step k comes from ``stable_hash("renoise", seed, rollout_id, index, k)``. Noise is drawn on the CPU so that it does
not depend on the device, and per sample so that it does not depend on the batch.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from miles.utils.misc import make_generator

__all__ = [
    "STEP_RULES",
    "FlowNoiseSchedule",
    "DenoiseResult",
    "NoiseDraw",
    "apply_cfg",
    "denoise",
    "draw_noise_levels",
    "forward_process",
    "guided_velocity",
    "initial_noise",
    "renoise_noise",
    "sample_latents",
    "shift_sigmas",
    "x0_from_velocity",
]

STEP_RULES = ("dmd2", "euler")


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Apply the flow shift ``σ' = k·σ / (1 + (k − 1)·σ)`` (SD3 paper, eq. 23; diffusers' ``shift``).

    Args:
        sigmas: tensor of σ in [0, 1], any shape; computed in its own dtype (pass float64).
        shift: the flow shift k > 0; k = 1 leaves σ unchanged, k > 1 spends more steps at high noise.

    Raises:
        ValueError: if ``shift`` is not > 0.
    """
    if not shift > 0:
        raise ValueError(f"flow shift must be > 0, got {shift}")
    return shift * sigmas / (1 + (shift - 1) * sigmas)


class FlowNoiseSchedule:
    """A descending σ grid of ``num_steps`` points plus a terminal 0 that is never sampled.

    ``s = linspace(1, 1/N, N)`` (float64), ``σ = shift(s)``, ``timesteps = σ · num_train_timesteps``.
    Example: shift 3, N = 4 gives σ = 1, 0.9, 0.75, 0.5 and the terminal 0.

    The engine's sampling schedule (``--diffusion-num-steps``, ``--diffusion-flow-shift``) and the trainer's grid
    (``num_train_timesteps`` points at ``--fsdp-flow-shift``) are two instances of this class.

    Args:
        num_steps: N ≥ 1, the number of sampled points.
        shift: flow shift k.
        num_train_timesteps: the model's timestep scale (1000 for SD3 and digits).
        timesteps: optional explicit descending timesteps in (0, num_train_timesteps]; when given, σ = t / scale
            and ``num_steps`` / ``shift`` are ignored (the shift is assumed to be baked in already).

    Attributes:
        sigmas: float64 tensor of shape ``(N + 1,)``, descending, ending in 0.
        timesteps: float64 tensor of shape ``(N,)``, ``sigmas[:-1] · num_train_timesteps``.

    Raises:
        ValueError: on ``num_steps < 1`` or explicit timesteps that are empty, unsorted or out of range.
    """

    def __init__(
        self,
        num_steps: int,
        shift: float,
        num_train_timesteps: int = 1000,
        timesteps: list[float] | None = None,
    ) -> None:
        self.num_train_timesteps = num_train_timesteps
        if timesteps is not None:
            t = torch.as_tensor(timesteps, dtype=torch.float64)
            if t.ndim != 1 or len(t) == 0:
                raise ValueError(f"explicit timesteps must be a non-empty list, got {timesteps}")
            if (t <= 0).any() or (t > num_train_timesteps).any() or (t[1:] >= t[:-1]).any():
                raise ValueError(
                    f"explicit timesteps must be strictly descending in (0, {num_train_timesteps}], got {timesteps}"
                )
            sigmas = t / num_train_timesteps
        else:
            if num_steps < 1:
                raise ValueError(f"a flow schedule needs at least one step, got num_steps={num_steps}")
            sigmas = shift_sigmas(torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64), shift)
        self.sigmas = torch.cat([sigmas, sigmas.new_zeros(1)])
        self.timesteps = sigmas * num_train_timesteps
        self.num_steps = len(sigmas)

    def __repr__(self) -> str:
        shown = ", ".join(f"{s:.4g}" for s in self.sigmas[:8].tolist())
        more = ", ..." if len(self.sigmas) > 8 else ""
        return f"FlowNoiseSchedule(num_steps={self.num_steps}, sigmas=[{shown}{more}])"


def forward_process(x0: torch.Tensor, sigma: torch.Tensor | float, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching forward process ``x_σ = (1 − σ)·x0 + σ·ε`` (diffusers ``FlowMatchEulerDiscreteScheduler.
    scale_noise``; torchtitan's Flux trainer).

    Args:
        x0: clean latents ``(B, ...)`` of any rank, float32.
        sigma: one σ per row, a float tensor ``(B,)`` (any float dtype; applied in float32 on ``x0``'s device), or
            one Python float for the whole batch (the sampler's re-noise).
        noise: ``ε`` of ``x0``'s shape; moved to its device and dtype.

    Returns:
        ``x_σ`` of ``x0``'s shape and dtype.
    """
    if isinstance(sigma, torch.Tensor):
        sigma = sigma.to(device=x0.device, dtype=torch.float32).view(-1, *([1] * (x0.ndim - 1)))
    return (1 - sigma) * x0 + sigma * noise.to(device=x0.device, dtype=x0.dtype)


class NoiseDraw(NamedTuple):
    """One batch's noise levels on a σ grid and its noise (:func:`draw_noise_levels`).

    Attributes:
        grid_index: int64 ``(B,)``, positions on the grid.
        sigma: float64 ``(B,)`` in [0, 1]; timestep: float32 ``(B,)``, ``σ · num_train_timesteps``.
        noise: float32 ``ε`` of the requested shape.
    """

    grid_index: torch.Tensor
    sigma: torch.Tensor
    timestep: torch.Tensor
    noise: torch.Tensor


def draw_noise_levels(
    generator: torch.Generator,
    grid: FlowNoiseSchedule,
    shape: tuple[int, ...],
    allowed: torch.Tensor | None = None,
) -> NoiseDraw:
    """Draw ``shape[0]`` grid positions (uniform over the grid, or over ``allowed``'s positions), then the noise of
    ``shape``, in that order and on the CPU, from ``generator``: the SFT noise, the DMD2 scoring σ and the
    diffusion-GAN noise all draw this way, so a seed gives the same σ and ε wherever it is used.

    Args:
        generator: a CPU generator (``make_generator(purpose, seed, rollout, micro-batch, DP rank)``).
        grid: the trainer's σ grid.
        shape: ``(B, ...)``, the noise's shape.
        allowed: int64 grid positions to draw from, or None for the whole grid.
    """
    count = shape[0]
    if allowed is None:
        grid_index = torch.randint(0, grid.num_steps, (count,), generator=generator)
    else:
        grid_index = allowed[torch.randint(0, len(allowed), (count,), generator=generator)]
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    return NoiseDraw(grid_index, grid.sigmas[grid_index], grid.timesteps[grid_index].float(), noise)


def apply_cfg(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance in its standard form ``uncond + w·(cond − uncond)`` (Ho & Salimans 2022).

    Args:
        cond, uncond: predictions of the same shape (velocities here), any float dtype.
        guidance_scale: w; 1 returns ``cond``'s value.
    """
    return uncond + guidance_scale * (cond - uncond)


def x0_from_velocity(latents: torch.Tensor, sigma: torch.Tensor | float, velocity: torch.Tensor) -> torch.Tensor:
    """The flow-matching x0 prediction ``x0 = x_σ − σ·v`` in float32.

    Args:
        latents: ``x_σ`` of shape ``(B, C, H, W)``.
        sigma: σ in [0, 1], a float or a tensor broadcastable to ``latents`` (e.g. ``(B, 1, 1, 1)`` for images).
        velocity: ``v`` of the same shape as ``latents``.
    """
    if isinstance(sigma, torch.Tensor):
        sigma = sigma.to(device=latents.device, dtype=torch.float32)
    return latents.float() - sigma * velocity.float()


def guided_velocity(
    predict: Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor],
    latents: torch.Tensor,
    timestep: torch.Tensor,
    cond: dict[str, torch.Tensor],
    neg_cond: dict[str, torch.Tensor] | None,
    guidance_scale: float,
    combine: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = apply_cfg,
) -> torch.Tensor:
    """The velocity with true CFG: one forward without guidance, one batched ``[uncond; cond]`` forward with it.

    The :class:`miles.models.capabilities.TrueCFG` guidance form; the samplers call ``family.guided_velocity``,
    which is this function for a true-CFG family.

    Args:
        predict: ``predict(latents, timestep, cond) -> v`` float32 ``(B, C, H, W)``, e.g. a family's
            ``predict_velocity`` bound to a denoiser.
        latents: ``(B, C, H, W)``; timestep: float32 ``(B,)`` in [0, 1000].
        cond, neg_cond: batched cond kwargs of the prompts and of the negative prompt (same keys and batch).
        guidance_scale: w; at 1 ``neg_cond`` is not used.
        combine: ``combine(v_cond, v_uncond, w) -> v`` float32, the guided velocity of the two branches; default
            :func:`apply_cfg` (a family may add its stock sampler's rescale, e.g. Qwen-Image's per-token norm).

    Returns:
        float32 ``(B, C, H, W)``: ``combine(v_cond, v_uncond, w)``.

    Raises:
        ValueError: if ``w != 1`` and ``neg_cond`` is missing or has other keys than ``cond``.
    """
    if guidance_scale == 1.0:
        return predict(latents, timestep, cond).float()
    if not neg_cond or set(neg_cond) != set(cond):
        raise ValueError(
            f"guidance scale {guidance_scale:g} needs the negative prompt's cond with the prompt's keys "
            f"{sorted(cond)}, got {sorted(neg_cond or {})}; encode --negative-prompt with the same text encoder"
        )
    # One forward over [uncond; cond] halves the weight reads (and, under FSDP, the all-gathers) of two forwards.
    both = {key: torch.cat([neg_cond[key].to(cond[key].device), cond[key]]) for key in cond}
    velocity = predict(torch.cat([latents, latents]), torch.cat([timestep, timestep]), both).float()
    v_uncond, v_cond = velocity.chunk(2)
    return combine(v_cond, v_uncond, guidance_scale)


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
    """Output of :func:`denoise` for a batch of B samples.

    Attributes:
        latents: ``latents[k]`` is ``x_k``, float32 ``(B, *latent_shape)`` on CPU, for each run step k (empty if
            not recorded).
        x0_preds: ``x0_preds[k]`` is ``x̂0_k``, same layout.
        final: ``x_S`` float32 ``(B, *latent_shape)`` on CPU when the batch ran all S steps, else None.
    """

    latents: list[torch.Tensor]
    x0_preds: list[torch.Tensor]
    final: torch.Tensor | None


@torch.no_grad()
def denoise(
    family: Any,
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
        family: the model family; supplies ``predict_velocity(denoiser, latents, timestep, cond)`` and its guidance
            form's ``guided_velocity(predict, latents, timestep, cond, neg_cond, guidance_scale)``.
        denoiser: the velocity model (plain or FSDP-wrapped); the latents follow its parameters' device.
        noise: float32 ``(B, *latent_shape)``, the initial ``x_0`` (pure noise at σ_0).
        cond: batched positive cond kwargs.
        schedule: σ grid with S steps and the terminal 0.
        neg_cond: batched negative cond kwargs, required by a true-CFG family when ``guidance_scale != 1``.
        guidance_scale: the guidance scale w, applied in the family's guidance form.
        step_rule: ``"dmd2"`` or ``"euler"``.
        last_step: last step to run (default S − 1, the full trajectory).
        fresh_noise: ``fresh_noise(k) -> (B, *latent_shape)`` draws the DMD2 rule's noise after step k.
        record: keep ``x_k`` and ``x̂0_k`` of every step (off for evaluation).

    Raises:
        ValueError: on an unknown step rule, a missing ``fresh_noise`` for the DMD2 rule, ``last_step`` outside
            ``[0, S)``, or (from the first forward) a missing negative cond under true CFG.
    """
    num_steps = schedule.num_steps
    last_step = num_steps - 1 if last_step is None else last_step
    if step_rule not in STEP_RULES:
        raise ValueError(f"--diffusion-step-rule {step_rule!r} is unknown; choose one of {list(STEP_RULES)}")
    if step_rule == "dmd2" and fresh_noise is None and last_step > 0:
        raise ValueError("the dmd2 step rule needs fresh_noise(step) to re-noise between steps")
    if not 0 <= last_step < num_steps:
        raise ValueError(f"last_step {last_step} is outside the schedule's steps [0, {num_steps})")

    device = next(denoiser.parameters()).device
    x = noise.to(device, torch.float32)
    batch = x.shape[0]

    def predict(latents, timestep, batch_cond):
        return family.predict_velocity(denoiser, latents, timestep, batch_cond)

    result = DenoiseResult(latents=[], x0_preds=[], final=None)
    for k in range(last_step + 1):
        sigma, sigma_next = float(schedule.sigmas[k]), float(schedule.sigmas[k + 1])
        timestep = torch.full((batch,), float(schedule.timesteps[k]), dtype=torch.float32, device=device)
        v = family.guided_velocity(predict, x, timestep, cond, neg_cond, guidance_scale)
        x0 = x0_from_velocity(x, sigma, v)
        if record:
            result.latents.append(x.cpu())
            result.x0_preds.append(x0.cpu())
        if k == last_step:
            if k == num_steps - 1:
                result.final = (x0 if step_rule == "dmd2" else x + (sigma_next - sigma) * v).cpu()
            break
        if step_rule == "dmd2":
            x = forward_process(x0, sigma_next, fresh_noise(k))
        else:
            x = x + (sigma_next - sigma) * v
    return result


@torch.no_grad()
def sample_latents(
    family: Any,
    denoiser: nn.Module,
    encode: Callable[[int, int], dict[str, torch.Tensor]],
    sample_indices: list[int],
    *,
    latent_shape: tuple[int, ...],
    schedule: FlowNoiseSchedule,
    guidance_scale: float,
    step_rule: str,
    seed: int,
    negative: dict[str, torch.Tensor] | None = None,
    batch_size: int = 64,
    rollout_id: int | str = "eval",
) -> torch.Tensor:
    """Sample full trajectories of B samples (evaluation, exported pipelines, teacher previews).

    Teacher preview: 28 Euler steps with ``guidance_scale=7``; a DMD2 student: its few-step schedule, rule
    ``"dmd2"``, guidance 1. Sample b uses the seeds of ``(seed, rollout_id, sample_indices[b])``, so the rollout
    engine with the same values draws the same noise whatever the batch (the images agree to float rounding, and
    bit for bit at an equal ``batch_size``).

    Args:
        family: runs the denoiser (``predict_velocity``).
        encode: ``encode(start, end) -> {name: (end − start, ...)}``, the batched cond of samples ``start..end − 1``.
        sample_indices: B seed indices.
        latent_shape: one sample's ``(C, H, W)`` (video: ``(C, F, H, W)``).
        schedule: the σ grid to sample on.
        negative: the negative prompt's cond, one row without a batch dim; required when ``guidance_scale != 1``.
        batch_size: samples per denoiser forward (chunks of the B samples, in order).

    Returns:
        float32 latents ``(B, *latent_shape)`` on CPU.

    Raises:
        ValueError: as :func:`denoise` (e.g. CFG without ``negative``).
    """
    outputs = []
    for start in range(0, len(sample_indices), batch_size):
        indices = sample_indices[start : start + batch_size]
        neg = None
        if guidance_scale != 1.0 and negative is not None:
            neg = {key: value.expand(len(indices), *value.shape) for key, value in negative.items()}
        result = denoise(
            family,
            denoiser,
            initial_noise(latent_shape, seed, rollout_id, indices),
            encode(start, start + len(indices)),
            schedule,
            neg_cond=neg,
            guidance_scale=guidance_scale,
            step_rule=step_rule,
            fresh_noise=lambda k, idx=indices: renoise_noise(latent_shape, seed, rollout_id, idx, k),
            record=False,
        )
        outputs.append(result.final)
    return torch.cat(outputs)
