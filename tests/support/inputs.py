"""Small real inputs of the reliability tests: digits records, pipelines that are broken in one way, checkpoint
directories laid out as ``checkpoint.py`` writes them, and a tree hash to prove nothing was touched."""

import hashlib
import json
from pathlib import Path

import numpy as np


def write_digit_records(path: Path, count: int = 16, *, images: bool = True, start: int = 0) -> Path:
    """``count`` sklearn digits as JSONL records ``{"prompt", "label"[, "image"]}`` (uint8 8×8 pixels)."""
    from sklearn.datasets import load_digits

    from miles.eval.digits.data import prompt_for_label

    digits = load_digits()
    lines = []
    for i in range(start, start + count):
        record = {"prompt": prompt_for_label(int(digits.target[i])), "label": int(digits.target[i])}
        if images:
            record["image"] = np.floor(digits.images[i] * (255.0 / 16.0) + 0.5).astype(int).tolist()
        lines.append(json.dumps(record) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return path


def copy_pipeline(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def poison_weight(pipeline: Path) -> str:
    """Set one element of the pipeline's denoiser to NaN (in its safetensors file); returns the tensor's name."""
    from safetensors.torch import load_file, save_file

    path = next((pipeline / "transformer").glob("*.safetensors"))
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    return name


def truncate_weights(pipeline: Path) -> None:
    """Cut the denoiser's safetensors file in half, as an interrupted download leaves it."""
    path = next((pipeline / "transformer").glob("*.safetensors"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def checkpoint_layout(save_dir: Path, rollout_id: int, *, commit: bool = True) -> Path:
    """A directory laid out as a committed checkpoint of ``rollout_id`` (``metadata.json``, ``dcp/.metadata``,
    ``latest``): what the preflight reads. Its tensors are absent, so it serves checks that never load it."""
    path = save_dir / f"rollout_{rollout_id}"
    (path / "dcp").mkdir(parents=True)
    (path / "dcp" / ".metadata").write_bytes(b"")
    from miles.backends.fsdp_utils.checkpoint import FORMAT_VERSION

    metadata = {"rollout_id": rollout_id, "role": "actor", "world_size": 1, "format_version": FORMAT_VERSION}
    (path / "metadata.json").write_text(json.dumps(metadata))
    if commit:
        (save_dir / "latest").write_text(f"{rollout_id}\n")
    return path


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (and the names of its directories), keyed by relative path."""
    hashes = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            hashes[key] = "link:" + str(path.readlink())
        elif path.is_file():
            hashes[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            hashes[key] = "dir"
    return hashes
