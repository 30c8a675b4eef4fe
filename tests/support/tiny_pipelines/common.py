"""What the tiny pipeline builders share: seeded construction and writing the directory."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["image_vae_kwargs", "seeded", "seeded_values", "video_vae_kwargs", "write_pipeline"]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's global RNG seeded to ``seed`` (diffusers and transformers initialise weights from
    it), forked so that the caller's RNG state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def seeded_values(seed: int, count: int, low: float, high: float) -> list[float]:
    """``count`` floats drawn uniformly from ``[low, high)`` by a generator seeded with ``seed``, rounded to 4
    decimals (they go into JSON configs: VAE latent statistics)."""
    generator = torch.Generator().manual_seed(seed)
    values = low + (high - low) * torch.rand(count, generator=generator, dtype=torch.float64)
    return [round(float(v), 4) for v in values]


def write_pipeline(pipe, folder) -> Path:
    """``pipe.save_pretrained(folder)`` (safetensors weights, ``model_index.json``, component configs); returns the
    folder as a ``Path``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(folder)
    return folder


def image_vae_kwargs(latent_channels: int, pixel_size: int) -> dict:
    """Arguments of a tiny four-block ``AutoencoderKL`` / ``AutoencoderKLFlux2`` (FLUX.1 and FLUX.2 share the block
    layout): three downsamples, so the spatial factor is 8 as in the released VAEs, at width 8."""
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * 4,
        "up_block_types": ("UpDecoderBlock2D",) * 4,
        "block_out_channels": (8, 8, 8, 8),
        "layers_per_block": 1,
        "latent_channels": latent_channels,
        "norm_num_groups": 4,
        "sample_size": pixel_size,
    }


def video_vae_kwargs(latent_channels: int, seed: int) -> dict:
    """Arguments of a tiny ``AutoencoderKLWan`` / ``AutoencoderKLQwenImage`` (Qwen-Image reuses Wan's 3-D VAE): three
    downsamples, two of them temporal, as in the released VAEs (spatial factor 8, temporal factor 4), at width 8, with
    per-channel ``latents_mean`` / ``latents_std`` drawn from ``seed`` so that a missing normalisation shows."""
    return {
        "base_dim": 8,
        "z_dim": latent_channels,
        "dim_mult": [1, 1, 1, 1],
        "num_res_blocks": 1,
        "temperal_downsample": [False, True, True],
        "latents_mean": seeded_values(seed, latent_channels, -1.0, 1.0),
        "latents_std": seeded_values(seed + 1, latent_channels, 1.0, 3.0),
    }
