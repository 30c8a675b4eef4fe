"""The pixel size a family without a ``sample_size`` in its transformer config samples a pipeline at.

FLUX.2-klein's and Wan's transformer configs fix no size: their pipelines sample at the call's ``height`` /
``width`` (and Wan's ``num_frames``), or at the pipeline's default (``Flux2KleinPipeline``: 1024 × 1024;
``WanPipeline``: 81 frames of 480 × 832). miles needs one size per run (every rollout's latent shape), so a pipeline
directory may say it in ``model_index.json``::

    "_miles_sample_size": [512, 512]          # [height, width] in pixels; a video family: [frames, height, width]

``DiffusionPipeline.from_pretrained`` drops keys that start with ``_`` without a warning, so the stock pipeline still
opens the directory, and the ``--save-hf`` export keeps the key (it copies ``model_index.json``). The key is the one
branch ``fam-qf`` uses for Qwen-Image and FLUX.1 (``miles.models.stock_defaults`` there).
"""

import json
import os
from pathlib import Path

from miles.models.base import read_json

__all__ = ["SAMPLE_SIZE_KEY", "read_sample_size", "write_sample_size"]

SAMPLE_SIZE_KEY = "_miles_sample_size"


def read_sample_size(path: str | Path, default: tuple[int, ...]) -> tuple[int, ...]:
    """``model_index.json``'s ``_miles_sample_size`` of pipeline ``path``, else ``default`` (the stock default).

    Raises:
        FileNotFoundError / ValueError: for a missing or unreadable ``model_index.json``, or a size that is not
            ``len(default)`` positive integers.
    """
    size = read_json(Path(path) / "model_index.json", "pipeline model_index.json").get(SAMPLE_SIZE_KEY)
    if size is None:
        return tuple(default)
    if not isinstance(size, list) or len(size) != len(default) or not all(type(v) is int and v > 0 for v in size):
        raise ValueError(
            f"{path}/model_index.json has {SAMPLE_SIZE_KEY} {size!r}; expected {len(default)} positive integers, "
            f"e.g. {list(default)}"
        )
    return tuple(size)


def write_sample_size(path: str | Path, size: tuple[int, ...] | list[int]) -> None:
    """Set ``_miles_sample_size`` of pipeline ``path`` to ``size`` (pixels). The file is replaced, not written in
    place, so a hard-linked copy elsewhere keeps its bytes.

    Raises:
        FileNotFoundError / ValueError: for a missing or unreadable ``model_index.json``, or a value < 1.
    """
    size = [int(v) for v in size]
    if not size or min(size) < 1:
        raise ValueError(f"a sample size is positive integers, got {size}")
    index_path = Path(path) / "model_index.json"
    index = {**read_json(index_path, "pipeline model_index.json"), SAMPLE_SIZE_KEY: size}
    tmp = index_path.with_name(index_path.name + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, index_path)
