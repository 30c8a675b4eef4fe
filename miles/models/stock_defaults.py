"""What a stock diffusers pipeline samples by default: its image size, and the flow shift it derives from it.

**The sample size.** The DiT configs of Qwen-Image and FLUX.1 have no ``sample_size``: their pipelines sample at the
``height`` / ``width`` of the call, ``default_sample_size · vae_scale_factor`` = 128 · 8 = 1024 pixels when none is
given (``QwenImagePipeline.__call__``, ``FluxPipeline.__call__``). A miles family needs one size per run (the
latent shape of every rollout), so a pipeline directory may say it in ``model_index.json``::

    "_miles_sample_size": [512, 512]        # [height, width] in pixels; a video family: [frames, height, width]

Keys that start with ``_`` are dropped by ``DiffusionPipeline.from_pretrained`` without a warning, so the stock
pipeline still opens the directory, and the ``--save-hf`` export keeps the key (it copies ``model_index.json``).
Without the key the family uses the stock pipeline's default. ``python -m miles.models.stock_defaults PIPELINE H W``
writes it (replacing the file, so a hard-linked or symlinked copy elsewhere is left as it is) after checking it
against the family's rule (:func:`check_sample_size`: the recipes' ``prepare`` runs it first, so a wrong
``SAMPLE_SIZE`` stops it before it writes into ``MODEL_DIR`` and before the prompt cache runs).

**The dynamic shift.** ``FluxPipeline`` and ``QwenImagePipeline`` pass ``mu = calculate_shift(image_seq_len,
base_image_seq_len, max_image_seq_len, base_shift, max_shift)`` (diffusers, ``pipelines/flux/pipeline_flux.py``):
the line through ``(base_image_seq_len, base_shift)`` and ``(max_image_seq_len, max_shift)`` at the token count,
not clamped. With ``use_dynamic_shifting`` the scheduler's exponential time shift maps σ to ``e^mu / (e^mu + 1/σ −
1)``, the static flow shift ``k = e^mu`` (docs/families.md).
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from miles.models.pipeline_files import read_json

__all__ = [
    "SAMPLE_SIZE_KEY",
    "check_sample_size",
    "dynamic_flow_shift",
    "main",
    "read_sample_size",
    "write_sample_size",
]

SAMPLE_SIZE_KEY = "_miles_sample_size"


def read_sample_size(path: str | Path, default: tuple[int, ...]) -> tuple[int, ...]:
    """The pixel size a family samples pipeline ``path`` at: ``model_index.json``'s ``_miles_sample_size`` when set,
    else ``default`` (the stock pipeline's default size).

    Raises:
        FileNotFoundError / ValueError: for a missing or unreadable ``model_index.json``, or a sample size that is not
            a list of ``len(default)`` positive integers.
    """
    index = read_json(Path(path) / "model_index.json", "pipeline model_index.json")
    size = index.get(SAMPLE_SIZE_KEY)
    if size is None:
        return tuple(default)
    if (
        not isinstance(size, list)
        or len(size) != len(default)
        or not all(isinstance(each, int) and not isinstance(each, bool) and each > 0 for each in size)
    ):
        raise ValueError(
            f"{path}/model_index.json has {SAMPLE_SIZE_KEY} {size!r}; expected {len(default)} positive integers "
            f"(e.g. {list(default)})"
        )
    return tuple(size)


def check_sample_size(family: Any, path: str | Path, size: tuple[int, ...] | list[int]) -> None:
    """Refuse a sample size the family ``family`` of pipeline ``path`` would not sample as given
    (:meth:`~miles.models.base.ModelFamily.sample_size_rule`): the wrong count of values (Wan's frame count missing),
    a value < 1, or one off its multiple (which the family would round, or refuse at the first rollout).

    Raises:
        ValueError: one line naming the size, the family's rule and the nearest valid size; also for a family that
            reads no ``_miles_sample_size`` (its size is the transformer config's).
    """
    rule = family.sample_size_rule(path)
    given = " ".join(str(each) for each in size)
    if rule is None:
        raise ValueError(
            f"sample size {given}: the {family.name} family samples the size its transformer config gives and "
            f"reads no {SAMPLE_SIZE_KEY}; leave the size empty"
        )
    names = " ".join(name for name, _, _ in rule)
    if len(size) != len(rule):
        raise ValueError(
            f"sample size {given}: the {family.name} family takes {len(rule)} values ({names}), got {len(size)}"
        )
    wrong = [
        (name, value, multiple, remainder)
        for (name, multiple, remainder), value in zip(rule, size, strict=True)
        if value < 1 or (value - remainder) % multiple
    ]
    if wrong:
        nearest = " ".join(
            str(max(remainder or multiple, (value - remainder) // multiple * multiple + remainder))
            for (_, multiple, remainder), value in zip(rule, size, strict=True)
        )
        shown = ", ".join(
            f"{name} {value} is not "
            + ("positive" if value < 1 else f"{multiple}k + {remainder}" if remainder else f"a multiple of {multiple}")
            for name, value, multiple, remainder in wrong
        )
        raise ValueError(f"sample size {given}: {shown} (the {family.name} family at {path}); use e.g. {nearest}")


def write_sample_size(path: str | Path, size: tuple[int, ...] | list[int]) -> None:
    """Set ``_miles_sample_size`` in ``<path>/model_index.json`` to ``size`` (pixels; see the module docstring).

    The file is replaced, not written in place: a hard link or a symlink into a shared cache keeps the old bytes.

    Raises:
        FileNotFoundError / ValueError: for a missing or unreadable ``model_index.json``, or a size with a value < 1.
    """
    size = [int(each) for each in size]
    if not size or min(size) < 1:
        raise ValueError(f"a sample size is positive integers, got {size}")
    index_path = Path(path) / "model_index.json"
    index = read_json(index_path, "pipeline model_index.json")
    index[SAMPLE_SIZE_KEY] = size
    tmp = index_path.with_name(index_path.name + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, index_path)


def dynamic_flow_shift(scheduler_config: dict, image_tokens: int) -> float:
    """The flow shift ``k`` the stock pipeline samples ``image_tokens`` tokens with: ``e^mu`` with ``mu`` diffusers'
    ``calculate_shift`` line (module docstring) when the config has ``use_dynamic_shifting``, else its ``shift``.

    Args:
        scheduler_config: a ``FlowMatchEulerDiscreteScheduler`` config (``scheduler_config.json``); the defaults of
            its missing keys are ``calculate_shift``'s as the pipelines call it (256, 4096, 0.5, 1.15).
        image_tokens: packed image tokens per sample (``(H/16)·(W/16)`` for Qwen-Image and FLUX.1).
    """
    if not scheduler_config.get("use_dynamic_shifting", False):
        return float(scheduler_config.get("shift", 1.0))
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    mu = base_shift + slope * (image_tokens - base_len)
    return math.exp(mu)


def main(argv: list[str] | None = None) -> int:
    """``python -m miles.models.stock_defaults PIPELINE H W [--diffusion-model-family NAME]`` (a video family:
    ``PIPELINE F H W``): check the size against the family's rule (:func:`check_sample_size`), then write it into the
    pipeline's ``model_index.json``. Returns the exit code (0, or 2 with one error line on stderr and nothing
    written)."""
    from miles.models import get_model_family

    parser = argparse.ArgumentParser(
        prog="python -m miles.models.stock_defaults",
        description=f"Set the pixel size miles samples a pipeline directory at (model_index.json {SAMPLE_SIZE_KEY}).",
    )
    parser.add_argument("pipeline", help="a diffusers pipeline directory")
    parser.add_argument("size", type=int, nargs="+", help="height width (a video family: frames height width)")
    parser.add_argument(
        "--diffusion-model-family",
        default=None,
        help="the pipeline's model family (default: read from its model_index.json), whose rule the size must meet",
    )
    ns = parser.parse_args(argv)
    try:
        family = get_model_family(ns.pipeline, ns.diffusion_model_family)
        check_sample_size(family, ns.pipeline, ns.size)
        write_sample_size(ns.pipeline, ns.size)
    except (OSError, ValueError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{ns.pipeline}: {SAMPLE_SIZE_KEY} = {ns.size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
