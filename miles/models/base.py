"""What every model family gives the engine and the trainers: the ``ModelFamily`` protocol.

A family wraps one kind of diffusers pipeline directory (``sd3``, ``digits``): it loads the denoiser and the text
encoder, turns prompts into the denoiser's cond kwargs, converts between pixel images and latents, runs one
forward and names the blocks FSDP shards one by one. A new family (FLUX, Wan, ...) implements these methods; nothing
else in miles knows which denoiser class or cond keys a family uses.

Velocity convention (diffusers SD3, torchtitan Flux): ``x_σ = (1 − σ)·x0 + σ·ε``; the denoiser's output is the
velocity ``v = ε − x0`` at ``timestep = σ · num_train_timesteps`` (σ ∈ [0, 1], timestep ∈ [0, 1000]).
"""

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["ModelFamily", "PromptEncoder", "encode_one_prompt", "read_json", "read_scheduler_config"]


class PromptEncoder(Protocol):
    """A loaded text encoder. ``encode`` is deterministic (eval mode, no dropout)."""

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(hidden, pooled)``: float32 ``(B, L, D)`` token states and float32 ``(B, P)`` pooled states."""
        ...


@runtime_checkable
class ModelFamily(Protocol):
    """One kind of pipeline directory. One instance per pipeline (``pipeline_path``).

    Methods that take a ``path`` may be given another pipeline of the same family (the teacher, the critic); the
    image ↔ latent conversion uses the instance's own pipeline (its VAE, for SD3).
    """

    name: str
    pipeline_path: Path
    # Whether the --save-hf export replaces the scheduler with the stock diffusers scheduler of the student's step
    # rule and grid (miles.models.sampling_schedule.write_sampling_schedule), so that the family's stock diffusers
    # pipeline samples the student as miles does. False where miles' own pipeline class samples the export.
    stock_scheduler: bool

    def load_denoiser(self, path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The pipeline's denoiser in eval mode on the CPU, in ``dtype``."""
        ...

    def load_text_encoder(self, path: str | Path, device: str | torch.device = "cpu") -> PromptEncoder:
        """The pipeline's text encoder(s) in eval mode."""
        ...

    def encode_prompts(self, encoder: PromptEncoder, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batched cond kwargs of the denoiser's forward (float32, on the CPU), one row per prompt."""
        ...

    def latent_shape(self, path: str | Path) -> tuple[int, int, int]:
        """The denoiser's latent shape ``(C, H, W)``."""
        ...

    def text_tokens(self, path: str | Path) -> int:
        """Text tokens per prompt in the denoiser's cond (the memory planner's sequence length)."""
        ...

    def image_shape(self, path: str | Path) -> tuple[int, int, int]:
        """The pixel image shape ``(H, W, C)`` whose ``images_to_latents`` is a latent of ``latent_shape``."""
        ...

    def images_to_latents(self, images: torch.Tensor) -> torch.Tensor:
        """Pixel images ``(B, H, W, C)`` (or ``(B, H, W)``), uint8 or float in 0..255, to float32 latents
        ``(B, C', H', W')``."""
        ...

    def latents_to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C', H', W')`` to uint8 images ``(B, H, W, C)`` in 0..255."""
        ...

    def predict_velocity(
        self, denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One denoiser forward: ``latents`` ``(B, C, H, W)`` at ``timestep`` float ``(B,)`` in [0, 1000] → the
        velocity ``v`` as float32 ``(B, C, H, W)``. Inputs are cast to the denoiser's device and dtype."""
        ...

    def blocks(self, denoiser: nn.Module) -> list[nn.Module]:
        """The blocks FSDP shards one by one before the root (diffusers' ``_no_split_modules``), in forward order."""
        ...


def encode_one_prompt(family: ModelFamily, encoder: PromptEncoder, prompt: str) -> dict[str, torch.Tensor]:
    """One prompt's cond kwargs without a batch dim (the negative prompt of CFG, usually ``""``), float32 on CPU."""
    # clone: a view would carry (and pickle) the whole batch storage
    return {key: value[0].clone() for key, value in family.encode_prompts(encoder, [prompt]).items()}


def read_json(path: str | Path, what: str) -> dict:
    """Read a JSON file of a pipeline directory; the error names the file and what it should hold.

    Raises:
        FileNotFoundError: if the file is missing.
        ValueError: if it is not valid JSON.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path} (is the pipeline directory complete?)")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} {path} is not valid JSON ({exc}); is the file truncated?") from exc


def read_scheduler_config(path: str | Path) -> dict:
    """``{"shift": float, "num_train_timesteps": int}`` of ``<path>/scheduler/scheduler_config.json``; any
    flow-matching scheduler config of diffusers holds both."""
    config = read_json(Path(path) / "scheduler" / "scheduler_config.json", "scheduler config")
    return {
        "shift": float(config.get("shift", 1.0)),
        "num_train_timesteps": int(config.get("num_train_timesteps", 1000)),
    }
