"""Small real inputs of the reliability tests: digits records, pipelines that are broken in one way, checkpoint
directories laid out as ``checkpoint.py`` writes them, and a tree hash to prove nothing was touched."""

import hashlib
import json
import warnings
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


def checkpoint_layout(
    save_dir: Path,
    rollout_id: int,
    *,
    commit: bool = True,
    data_state=None,
    loss_type: str | None = None,
    role: str = "actor",
    command: list[str] | None = None,
) -> Path:
    """A real checkpoint of ``rollout_id`` as ``checkpoint.save_checkpoint`` writes it (format 3: DCP shards of the
    modules, optimizer, schedule and RNG, ``metadata.json``; ``latest`` with ``commit``), of a 4×4 linear layer and
    its AdamW: what the preflight reads, though no trainer could load it. ``data_state`` is written as the data cursor; ``loss_type`` writes a run
    record of ``miles.driver.resume`` with the method and optimizer settings only, ``command`` (argv) the record that
    command writes; ``role`` is the group's, in its metadata."""

    import torch

    from miles.backends.fsdp_utils import checkpoint
    from miles.backends.fsdp_utils.optimizer import build_lr_scheduler, build_optimizer
    from miles.config import OptimizerSpec, ScheduleSpec
    from miles.driver.resume import FORMAT, run_record, write_run_record
    from miles.models.base import DENOISER

    module = torch.nn.Linear(4, 4)
    optimizer = build_optimizer([module], OptimizerSpec(lr=1e-3))
    scheduler = build_lr_scheduler(optimizer, ScheduleSpec(total_steps=10), 1e-3)
    states = {
        "train": checkpoint.ModulesState(torch.nn.ModuleDict({DENOISER: module}), optimizer),
        "scheduler": checkpoint.SchedulerState(scheduler),
        "rng": checkpoint.RNGState(),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, no group
        path = checkpoint.save_checkpoint(save_dir, rollout_id, states, role=role, data_state=data_state)
    if command is not None:
        # The record the command that saved it writes (its settings and what each group's checkpoint holds).
        from tests.support.arguments import parsed_with_defaults

        write_run_record(save_dir, run_record(parsed_with_defaults(command), rollout_id, None))
    elif loss_type is not None:
        # A record of the method and the optimizer's settings only (as before the groups were recorded).
        settings = dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.0, min_lr=0.0,
                        lr_warmup_steps=0, lr_decay_style="constant")  # fmt: skip
        record = {"format": FORMAT, "rollout_id": rollout_id, "method": loss_type, "settings": settings,
                  "wandb_run_id": None}  # fmt: skip
        write_run_record(save_dir, record)
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
