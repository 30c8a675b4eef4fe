"""What every model family gives the engine and the trainers.

A family wraps one kind of diffusers pipeline directory (``sd3``, ``digits``): it loads the denoiser (an
``SD3Transformer2DModel`` for both), the flow-matching scheduler settings and the text encoder, turns prompts into the
denoiser's cond kwargs, converts between pixel images and latents, and runs one forward.

Velocity convention (diffusers SD3, torchtitan Flux): ``x_σ = (1 − σ)·x0 + σ·ε``; the transformer's output is the
velocity ``v = ε − x0`` at ``timestep = σ · num_train_timesteps`` (σ ∈ [0, 1], timestep ∈ [0, 1000]).
"""

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

__all__ = ["ModelFamily", "PromptEncoder", "read_json"]


class PromptEncoder(Protocol):
    """A loaded text encoder. ``encode`` is deterministic (eval mode, no dropout)."""

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(hidden, pooled)``: float32 ``(B, L, D)`` token states and float32 ``(B, P)`` pooled states."""
        ...


def read_json(path: str | Path, what: str) -> dict:
    """Read a JSON file of a pipeline directory; the error names the file and what it should hold."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path} (is the pipeline directory complete?)")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} {path} is not valid JSON ({exc}); is the file truncated?") from exc


class ModelFamily(ABC):
    """Base class of the model families. One instance per pipeline directory (``pipeline_path``).

    Methods that take a ``path`` may be given another pipeline of the same family (the teacher, the critic); the
    image ↔ latent conversion uses the instance's own pipeline (its VAE, for SD3).
    """

    name: str = ""

    def __init__(self, pipeline_path: str | Path) -> None:
        self.pipeline_path = Path(pipeline_path)

    # -- loading -------------------------------------------------------------------------------------------------
    def load_denoiser(self, path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
        """Load ``<path>/transformer`` as an ``SD3Transformer2DModel`` in eval mode on CPU, in ``dtype``."""
        from diffusers import SD3Transformer2DModel

        folder = Path(path) / "transformer"
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"no transformer/config.json under pipeline directory {path}")
        model = SD3Transformer2DModel.from_pretrained(folder, torch_dtype=dtype)
        return model.eval()

    def load_scheduler_config(self, path: str | Path) -> dict:
        """Return ``{"shift": float, "num_train_timesteps": int}`` from ``<path>/scheduler/scheduler_config.json``."""
        config = read_json(Path(path) / "scheduler" / "scheduler_config.json", "scheduler config")
        return {
            "shift": float(config.get("shift", 1.0)),
            "num_train_timesteps": int(config.get("num_train_timesteps", 1000)),
        }

    @abstractmethod
    def load_text_encoder(self, path: str | Path, device: str | torch.device = "cpu") -> PromptEncoder:
        """Load the pipeline's text encoder(s) in eval mode."""

    def encode_prompts(self, encoder: PromptEncoder, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Encode ``prompts`` to batched cond kwargs (float32, on CPU).

        Returns:
            ``{"encoder_hidden_states": (B, L, D), "pooled_projections": (B, P)}``.
        """
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        hidden, pooled = encoder.encode(list(prompts))
        return {
            "encoder_hidden_states": hidden.detach().to("cpu", torch.float32),
            "pooled_projections": pooled.detach().to("cpu", torch.float32),
        }

    # -- shapes and pixels ---------------------------------------------------------------------------------------
    @abstractmethod
    def latent_shape(self, path: str | Path) -> tuple[int, int, int]:
        """The denoiser's latent shape ``(C, H, W)``."""

    @abstractmethod
    def images_to_latents(self, images: torch.Tensor) -> torch.Tensor:
        """Pixel images ``(B, H, W, C)`` (or ``(B, H, W)`` for one channel), uint8 or float in 0..255, to float32
        latents ``(B, C', H', W')``."""

    @abstractmethod
    def latents_to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C', H', W')`` to uint8 images ``(B, H, W, C)`` in 0..255."""

    # -- forward -------------------------------------------------------------------------------------------------
    def predict_velocity(
        self, denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One denoiser forward.

        Args:
            denoiser: the ``SD3Transformer2DModel`` (plain or FSDP-wrapped).
            latents: ``(B, C, H, W)`` model input ``x_σ``, any float dtype; cast to the denoiser's dtype.
            timestep: float ``(B,)`` in [0, 1000] (``σ · 1000``); kept in float32, as diffusers' pipelines do.
            cond: batched kwargs ``{"encoder_hidden_states": (B, L, D), "pooled_projections": (B, P)}``.

        Returns:
            The velocity ``v = ε − x0``, float32 ``(B, C, H, W)``.
        """
        param = next(denoiser.parameters())
        device, dtype = param.device, param.dtype
        kwargs = {key: value.to(device, dtype) for key, value in cond.items()}
        out = denoiser(
            hidden_states=latents.to(device, dtype),
            timestep=timestep.to(device, torch.float32),
            return_dict=False,
            **kwargs,
        )[0]
        return out.float()

    # -- sharding ------------------------------------------------------------------------------------------------
    def blocks(self, denoiser: nn.Module) -> list[nn.Module]:
        """The blocks FSDP shards one by one before the root (diffusers' ``_no_split_modules``)."""
        return list(denoiser.transformer_blocks)

    def no_split_modules(self, denoiser: nn.Module) -> list[str]:
        """Class names of the blocks that must not be split (``["JointTransformerBlock"]`` for SD3)."""
        return list(getattr(denoiser, "_no_split_modules", None) or [])
