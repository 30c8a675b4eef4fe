"""The bundled real dataset: scikit-learn's handwritten digits, split once and written as JSONL.

``sklearn.datasets.load_digits()`` ships with scikit-learn (no download): 1797 grayscale images of 8×8 pixels with
integer values 0..16 (0 = background, 16 = full ink) and labels 0..9. This module fixes one stratified
train / held-out split that every stage uses (teacher SFT data, classifier training, reference statistics for the
Fréchet distance), so that no image the teacher or the classifier saw is ever used to judge generated images.

Split: per class, the class's indices are permuted with ``numpy.random.default_rng(stable_hash("digits_split",
seed))`` and the first ``round(HELDOUT_FRACTION · n_class)`` go to the held-out split (seed 0, fraction 0.2: 1438
train / 359 held-out images). Both splits are returned in ascending dataset order.

Pixels: ``uint8 = floor(value · 255 / 16 + 0.5)`` (round half up), so 0 → 0, 8 → 128, 16 → 255.

Run ``python -m miles.eval.digits.data OUT_DIR`` to write ``train.jsonl``, ``heldout.jsonl``, ``prompts.jsonl``,
``eval_prompts.jsonl`` and ``manifest.json`` into ``OUT_DIR``.
"""

import argparse
import functools
import json
import logging
import os
from pathlib import Path

import numpy as np

from miles.utils.misc import stable_hash

__all__ = [
    "DIGIT_NAMES",
    "DIGIT_PROMPTS",
    "HELDOUT_FRACTION",
    "SPLIT_SEED",
    "SPLITS",
    "prompt_for_label",
    "split_indices",
    "load_split",
    "write_digits_jsonl",
]

logger = logging.getLogger(__name__)

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
DIGIT_PROMPTS = [f"a handwritten digit {name}" for name in DIGIT_NAMES]
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0
SPLITS = ("train", "heldout")
# Bumped whenever the record layout or the split rule changes, so stale output directories are rewritten.
_FORMAT_VERSION = 2
_JSONL_FILES = ("train", "heldout", "prompts", "eval_prompts")
# Train-time eval prompts per digit: 100 images, one grid row of 10 per digit.
EVAL_PROMPT_REPEATS = 10
_MAX_DIGITS_VALUE = 16


def prompt_for_label(label: int) -> str:
    """The text prompt of digit class ``label`` (0..9), e.g. 7 → ``"a handwritten digit seven"``.

    Raises:
        ValueError: if ``label`` is not an integer in 0..9.
    """
    if isinstance(label, bool) or int(label) != label or not 0 <= int(label) <= 9:
        raise ValueError(f"digit label {label!r} is not an integer in 0..9")
    return DIGIT_PROMPTS[int(label)]


@functools.lru_cache(maxsize=1)
def _load_raw() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 digits as (uint8 [1797, 8, 8] in 0..255, int64 [1797] labels); cached, read-only."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.floor(digits.images * (255.0 / _MAX_DIGITS_VALUE) + 0.5).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


@functools.lru_cache(maxsize=4)
def split_indices(split: str, seed: int = SPLIT_SEED) -> np.ndarray:
    """Dataset indices (int64, ascending, read-only) of ``split`` ("train" or "heldout") under split seed ``seed``.

    Raises:
        ValueError: if ``split`` is not one of ``SPLITS``.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown digits split {split!r}; use one of {list(SPLITS)}")
    _, labels = _load_raw()
    rng = np.random.default_rng(stable_hash("digits_split", seed))
    heldout = []
    for label in range(10):
        members = rng.permutation(np.flatnonzero(labels == label))
        heldout.append(members[: int(round(HELDOUT_FRACTION * len(members)))])
    heldout_idx = np.sort(np.concatenate(heldout))
    if split == "heldout":
        indices = heldout_idx
    else:
        indices = np.setdiff1d(np.arange(len(labels)), heldout_idx)
    indices = indices.astype(np.int64)
    indices.setflags(write=False)
    return indices


def load_split(split: str, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of one split.

    Args:
        split: "train" (1438 images at the default seed) or "heldout" (359 images).
        seed: split seed; keep the default so every stage sees the same split.

    Returns:
        ``(images, labels)``: uint8 array ``[N, 8, 8]`` with values 0..255 (ink is bright), int64 array ``[N]`` of
        labels 0..9. Fresh writable copies.

    Raises:
        ValueError: if ``split`` is unknown.
    """
    indices = split_indices(split, seed)
    images, labels = _load_raw()
    return images[indices].copy(), labels[indices].copy()


def _write_jsonl(path: Path, records: list[dict]) -> None:
    # Write to a sibling temp file and rename, so an interrupted run never leaves a truncated file that looks done.
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


def _count_lines(path: Path) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def write_digits_jsonl(
    out_dir: str | os.PathLike, *, prompt_repeats: int = 100, seed: int = SPLIT_SEED
) -> dict[str, str]:
    """Write the digits dataset as JSONL files; skip the work when ``out_dir`` already holds a complete copy.

    Files written into ``out_dir``:

    * ``train.jsonl`` / ``heldout.jsonl``: SFT records ``{"prompt": str, "label": int, "image": [[int] * 8] * 8}``
      (uint8 pixel values 0..255, row-major), one per image of the split, in dataset order.
    * ``prompts.jsonl``: DMD2 prompt records ``{"prompt": str, "label": int}``: each of the 10 class prompts
      ``prompt_repeats`` times, shuffled with ``numpy.random.default_rng(stable_hash("digits_prompts", seed))``.
    * ``eval_prompts.jsonl``: the train-time eval prompts, each class prompt ``EVAL_PROMPT_REPEATS`` times in label
      order (one grid row per digit).
    * ``manifest.json``: format version, split seed, held-out fraction, ``prompt_repeats`` and the record count of
      every file. It is written last; a later call returns at once when the manifest matches these settings and
      every file has its recorded number of lines.

    Args:
        out_dir: directory to create or reuse.
        prompt_repeats: how many times each class prompt appears in ``prompts.jsonl`` (≥ 1).
        seed: split seed (see the module docstring) and prompt shuffle seed.

    Returns:
        ``{"train": path, "heldout": path, "prompts": path, "eval_prompts": path, "manifest": path}`` (strings).

    Raises:
        ValueError: if ``prompt_repeats`` < 1.
    """
    if prompt_repeats < 1:
        raise ValueError(f"prompt_repeats={prompt_repeats} must be at least 1")
    out = Path(out_dir)
    paths = {name: out / f"{name}.jsonl" for name in _JSONL_FILES}
    paths["manifest"] = out / "manifest.json"
    result = {name: str(path) for name, path in paths.items()}
    settings = {
        "format_version": _FORMAT_VERSION,
        "split_seed": seed,
        "heldout_fraction": HELDOUT_FRACTION,
        "prompt_repeats": prompt_repeats,
    }

    if paths["manifest"].exists():
        try:
            manifest = json.loads(paths["manifest"].read_text())
            complete = all(manifest.get(key) == value for key, value in settings.items()) and all(
                paths[name].exists() and _count_lines(paths[name]) == manifest["counts"][name] for name in _JSONL_FILES
            )
        except (json.JSONDecodeError, KeyError, TypeError):
            complete = False
        if complete:
            logger.info("digits data in %s is complete; reusing it", out)
            return result
        logger.info("digits data in %s is incomplete or was written with other settings; rewriting it", out)

    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        images, labels = load_split(split, seed)
        records = [
            {"prompt": prompt_for_label(label), "label": int(label), "image": image.tolist()}
            for image, label in zip(images, labels)
        ]
        _write_jsonl(paths[split], records)
        counts[split] = len(records)

    prompt_labels = np.repeat(np.arange(10, dtype=np.int64), prompt_repeats)
    prompt_labels = np.random.default_rng(stable_hash("digits_prompts", seed)).permutation(prompt_labels)
    _write_jsonl(paths["prompts"], [{"prompt": prompt_for_label(lbl), "label": int(lbl)} for lbl in prompt_labels])
    counts["prompts"] = len(prompt_labels)

    eval_labels = np.repeat(np.arange(10, dtype=np.int64), EVAL_PROMPT_REPEATS)
    _write_jsonl(paths["eval_prompts"], [{"prompt": prompt_for_label(lbl), "label": int(lbl)} for lbl in eval_labels])
    counts["eval_prompts"] = len(eval_labels)

    manifest_tmp = paths["manifest"].with_name("manifest.json.tmp")
    manifest_tmp.write_text(json.dumps({**settings, "counts": counts}, indent=2) + "\n")
    os.replace(manifest_tmp, paths["manifest"])
    logger.info("wrote digits data to %s: %s", out, counts)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the sklearn digits dataset as train/held-out/prompt JSONL.")
    parser.add_argument("out_dir", help="directory to write train.jsonl, heldout.jsonl, prompts.jsonl into")
    parser.add_argument("--prompt-repeats", type=int, default=100, help="copies of each class prompt")
    parser.add_argument("--seed", type=int, default=SPLIT_SEED, help="split and prompt-shuffle seed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_digits_jsonl(args.out_dir, prompt_repeats=args.prompt_repeats, seed=args.seed)


if __name__ == "__main__":
    main()
