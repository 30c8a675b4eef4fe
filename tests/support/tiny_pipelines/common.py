"""What the tiny pipeline builders share: seeded construction and writing the directory."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["seeded", "seeded_values", "write_pipeline"]


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
