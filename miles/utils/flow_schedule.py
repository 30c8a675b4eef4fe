"""The one place that builds the shifted σ grid of a flow-matching model.

Conventions (diffusers ``FlowMatchEulerDiscreteScheduler``, torchtitan's Flux trainer): σ ∈ [0, 1] with 1 = pure
noise, ``x_σ = (1 − σ)·x0 + σ·ε``, the model's ``timestep`` input is ``σ · num_train_timesteps`` (in [0, 1000]).
"""

import torch

__all__ = ["shift_sigmas", "FlowNoiseSchedule"]


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Apply the flow shift ``σ' = k·σ / (1 + (k − 1)·σ)`` (SD3 paper, eq. 23; diffusers' ``shift``).

    Args:
        sigmas: tensor of σ in [0, 1], any shape; computed in its own dtype (pass float64).
        shift: the flow shift k > 0; k = 1 leaves σ unchanged, k > 1 spends more steps at high noise.
    """
    if shift <= 0:
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
