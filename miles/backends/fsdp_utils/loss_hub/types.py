"""What the trainer hands its hooks (``TrainContext``) and what a prepare hook returns (``PreparedBatch``)."""

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from miles.models.base import DENOISER

__all__ = ["Metrics", "PreparedBatch", "TrainContext"]

# The figures a hook logs: {name: [one value per micro-batch (or per call)]}, averaged and logged per step.
Metrics = dict[str, list[float | torch.Tensor]]


@dataclass
class PreparedBatch:
    """One micro-batch ready for the denoiser's forward.

    The trainer computes ``new_pred = ctx.predict_velocity(ctx.models[component], latents, timestep, cond)`` and
    hands it to the loss hook together with this batch.

    Attributes:
        latents: ``(B, C, H, W)`` denoiser input ``x_σ``, float32 (any latent rank: ``(B, C, F, H, W)`` for video).
        timestep: float32 ``(B,)`` in [0, 1000] (``σ · 1000``).
        cond: batched cond kwargs, ``{"encoder_hidden_states": (B, L, D), "pooled_projections": (B, P)}``.
        target: the regression target if the loss has one, e.g. the velocity ``ε − x0`` ``(B, C, H, W)``.
        extras: hook-private values (``sigma (B,)``, noise, the rollout's x0, ...).
        component: which trainable model runs the forward (the denoiser, ``miles.models.base.DENOISER``).
    """

    latents: torch.Tensor
    timestep: torch.Tensor
    cond: dict[str, torch.Tensor]
    target: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    component: str = DENOISER


@dataclass
class TrainContext:
    """Everything a hook may read. One context per micro-batch; the trainer owns it.

    Attributes:
        args: the command's parsed flags (``args.method_settings``: the method's typed settings); the group's own
            settings (its init, learning rate, steps) are its spec's (:class:`miles.config.GroupSpec`), which the
            trainer reads.
        models: trainable models by component name (``{DENOISER: FSDP module}``, ``DENOISER = "transformer"``).
        teacher_models: frozen models from ``--teacher-load`` by component name, ``{}`` without a teacher.
        external_data: earlier groups' train outputs for this rank and rollout, by role (``{"critic": ...}``).
        family: the model family (``miles.models``): prompt encoding, velocity forward.
        device: where the models run.
        dtype: the training dtype (``--train-dtype``).
        rollout_id: the rollout being trained on.
        microbatch_id: the micro-batch's index within this rank's rollout shard.
        dp_rank: this rank's data-parallel index; dp_size: the group's data-parallel size.
        metrics: in a train-output hook, a ``{name: [values]}`` dict the hook may append figures to (averaged and
            logged with the group's last step, like a loss hook's); None elsewhere.
    """

    args: Any
    models: dict[str, nn.Module]
    teacher_models: dict[str, nn.Module]
    external_data: dict[str, Any]
    family: Any
    device: torch.device
    dtype: torch.dtype
    rollout_id: int
    microbatch_id: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    metrics: Metrics | None = None

    def predict_velocity(
        self, model: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Run ``model`` on this context's device and dtype and return the velocity ``v`` as float32 of the
        latents' shape."""
        cond = {key: value.to(self.device, self.dtype) for key, value in cond.items()}
        return self.family.predict_velocity(
            model, latents.to(self.device, self.dtype), timestep.to(self.device, torch.float32), cond
        )
