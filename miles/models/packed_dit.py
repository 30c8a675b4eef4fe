"""What the families of the FLUX-style pipelines share (``qwen_image``, ``flux``): 2×2 latent packing, a sample size
chosen per pipeline directory, the stock pipeline's flow shift at it, a static stock scheduler for the export, and
their joint blocks' activation layout.

miles keeps latents unpacked, ``(B, C, H, W)``; such a family packs them into the transformer's tokens inside its
``predict_velocity``. A token is one 2×2 patch of latent pixels, its ``4·C`` values laid out as (c, dy, dx), tokens
in raster order over the ``(H/2, W/2)`` grid (``FluxPipeline._pack_latents`` / ``_unpack_latents``; the same in
``QwenImagePipeline``). These pipelines call ``scheduler.set_timesteps(sigmas=linspace(1, 1/S, S), mu=...)``
themselves, so their export carries :func:`~miles.models.stock_schedulers.sigmas_call_scheduler_config`.
"""

from pathlib import Path
from typing import Any, ClassVar

import torch

from miles.models.diffusers_family import DiffusersFamily
from miles.models.memory import ActivationLayout, joint_layout
from miles.models.pipeline_files import read_json
from miles.models.stock_defaults import dynamic_flow_shift, read_sample_size
from miles.models.stock_schedulers import sigmas_call_scheduler_config

__all__ = ["PACK", "PackedDiTFamily", "pack_latents", "unpack_latents"]

# latent pixels per token side
PACK = 2


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` → ``(B, (H/2)·(W/2), 4·C)`` tokens.

    Raises:
        ValueError: if H or W is odd (the pipelines need latent sizes that are multiples of 2: pixel sizes that are
            multiples of 16).
    """
    batch, channels, height, width = latents.shape
    if height % PACK or width % PACK:
        raise ValueError(f"2x2 packing needs an even latent height and width, got {height} x {width}")
    patches = latents.reshape(batch, channels, height // PACK, PACK, width // PACK, PACK).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(batch, (height // PACK) * (width // PACK), channels * PACK * PACK)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(B, (H/2)·(W/2), 4·C)`` tokens → ``(B, C, H, W)`` latents: the inverse of :func:`pack_latents`."""
    batch, _, packed = tokens.shape
    channels = packed // (PACK * PACK)
    patches = tokens.reshape(batch, height // PACK, width // PACK, channels, PACK, PACK).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(batch, channels, height, width)


class PackedDiTFamily(DiffusersFamily):
    """The shared half of a family over a FLUX-style pipeline; a subclass adds its guidance form, its prompts and its
    forward's inputs (:meth:`~miles.models.diffusers_family.DiffusersFamily.forward_inputs`).

    The transformer takes σ (miles' timestep / 1000) and the latents packed 2×2 into tokens; its blocks are joint
    blocks with QK-norm and rope (FLUX.1 then adds single-stream blocks).

    Class attributes:
        default_sample_size: ``(height, width)`` the stock pipeline samples without ``height`` / ``width``
            (``default_sample_size · vae_scale_factor``).
    """

    default_sample_size: ClassVar[tuple[int, int]] = (1024, 1024)
    timestep_divisor = 1000.0

    def pixel_size(self, path: str | Path) -> tuple[int, int]:
        """``(height, width)`` in pixels: ``model_index.json``'s ``_miles_sample_size``, else
        :attr:`default_sample_size` (:mod:`miles.models.stock_defaults`).

        Raises:
            ValueError: when a side is not a multiple of 16 (the VAE's 8, times the 2×2 packing).
        """
        height, width = read_sample_size(path, self.default_sample_size)
        if height % 16 or width % 16:
            raise ValueError(
                f"{path}: the {self.name} family samples sizes that are multiples of 16, got {height} x {width}"
            )
        return height, width

    def sample_size_rule(self, path: str | Path) -> tuple[tuple[str, int, int], ...]:
        """Height and width, multiples of 16 (the VAE's 8, times the 2×2 packing; :meth:`pixel_size`)."""
        return (("height", 16, 0), ("width", 16, 0))

    def latent_shape(self, path: str | Path) -> tuple[int, int, int]:
        """``(C, H/8, W/8)``: C = the transformer's ``in_channels`` / 4 (the packed channels), H × W the sample
        size."""
        height, width = self.pixel_size(path)
        return (int(self.transformer_config(path)["in_channels"]) // (PACK * PACK), height // 8, width // 8)

    def image_shape(self, path: str | Path) -> tuple[int, int, int]:
        """``(H, W, 3)``: the sample size (the pixel shape of :class:`~miles.models.capabilities.PixelCodec`)."""
        height, width = self.pixel_size(path)
        return (height, width, 3)

    def flow_shift(self, path: str | Path, num_steps: int | None = None) -> float:
        """The stock pipeline's shift at the sample size's ``(H/16)·(W/16)`` tokens: ``e^mu`` for a dynamic scheduler
        config, else its static ``shift`` (:func:`~miles.models.stock_defaults.dynamic_flow_shift`)."""
        height, width = self.pixel_size(path)
        config = read_json(Path(path) / "scheduler" / "scheduler_config.json", "scheduler config")
        return dynamic_flow_shift(config, (height // 16) * (width // 16))

    def latent_patch(self, config: dict) -> tuple[int, int]:
        """``(2, 2)``: one token per 2×2 patch of latent pixels, in raster order, whatever the config's
        ``patch_size``."""
        return (PACK, PACK)

    def velocity_from_output(self, out: torch.Tensor, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The packed output tokens as latents ``(B, C, H, W)``."""
        return unpack_latents(out, latent_shape[-2], latent_shape[-1])

    def activation_layout(self, config: dict) -> ActivationLayout:
        """Joint blocks with QK-norm and rope over packed tokens of ``in_channels`` values, then FLUX.1's
        ``num_single_layers`` single-stream blocks (none in Qwen-Image)."""
        return joint_layout(config, patch_inputs=int(config["in_channels"]))

    def stock_scheduler_config(self, schedule: dict[str, Any]) -> dict[str, Any]:
        """A static stock scheduler with ``shift`` = k: the pipeline passes ``sigmas=linspace(1, 1/S, S)`` itself."""
        return sigmas_call_scheduler_config(**schedule)
