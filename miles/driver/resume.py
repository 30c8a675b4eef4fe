"""What a resume continues: the run record kept with each checkpoint, and what the driver checks and says with it.

Every save commits, beside the groups' checkpoints, ``<save>/rollout_<id>/run.json``: the method (``--loss-type``),
the flags a resume may change (the optimizers' and schedules' settings), the wandb run id and, with ``--keep-best``,
the best evaluation so far. A resume (``--load``) reads the record of the committed rollout and

- refuses another method's checkpoint before Ray starts (an ``sft_loss`` run would otherwise load a DMD2 student,
  its optimizer and a data cursor of another file, without a word);
- lists, on one line, the settings this command changes; the trainer applies them after loading
  (``miles.backends.fsdp_utils.optimizer.apply_optimizer_spec``);
- continues the same wandb run (its id is in the record);
- continues ``--keep-best`` from the best value the record names (:mod:`miles.driver.keep_best`).

Checkpoints written before the record existed resume as before (nothing to compare), except that a command is
refused when a sibling ``<load>_<suffix>`` holds the committed rollout of a group this command does not have (a
DMD2 run's ``<load>_critic`` under an ``sft_loss`` command).
"""

import argparse
import json
import os
from pathlib import Path
from typing import Any

from miles.methods import get_method
from miles.utils.validation import flag, reject

__all__ = [
    "RUN_RECORD",
    "changed_settings",
    "check_resume",
    "read_run_record",
    "resumable_settings",
    "resumed_line",
    "run_record",
    "write_run_record",
]

RUN_RECORD = "run.json"
FORMAT = 1


def resumable_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags a resume may change, by dest (the trainer applies the new values after loading the checkpoint):
    the optimizers' and schedules' settings and the run's length."""
    return {
        "lr": args.lr,
        "critic_lr": args.critic_lr,
        "min_lr": args.min_lr,
        "lr_warmup_steps": args.lr_warmup_steps,
        "lr_decay_style": args.lr_decay_style,
        "adam_beta1": args.adam_beta1,
        "adam_beta2": args.adam_beta2,
        "adam_eps": args.adam_eps,
        "weight_decay": args.weight_decay,
        "clip_grad": args.clip_grad,
        "num_rollout": args.num_rollout,
    }


def run_record(
    args: argparse.Namespace, rollout_id: int, wandb_run_id: str | None, best: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The record a save of ``rollout_id`` commits: ``{"format", "rollout_id", "method", "settings": {dest: value},
    "wandb_run_id"}`` (``method``: the ``--loss-type``), and with ``--keep-best`` ``"keep_best"``: the best
    evaluation so far (:meth:`miles.driver.keep_best.KeepBest.state`)."""
    settings = resumable_settings(args)
    record = {
        "format": FORMAT,
        "rollout_id": rollout_id,
        "method": get_method(args).name,
        "settings": settings,
        "wandb_run_id": wandb_run_id,
    }
    if best is not None:
        record["keep_best"] = best
    return record


def _record_path(directory: str | os.PathLike, rollout_id: int) -> Path:
    return Path(directory) / f"rollout_{rollout_id}" / RUN_RECORD


def write_run_record(save_dir: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Write ``record`` into the actor's checkpoint of its rollout (temporary file, fsync, rename), before the
    driver commits that rollout."""
    path = _record_path(save_dir, record["rollout_id"])
    tmp = path.with_name(f".{RUN_RECORD}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(record, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_run_record(load_dir: str | os.PathLike, rollout_id: int) -> dict[str, Any] | None:
    """The run record of checkpoint ``rollout_id`` in ``load_dir``, or None for a checkpoint written without one.

    Raises:
        ValueError: naming the file, when it is not a JSON object.
    """
    path = _record_path(load_dir, rollout_id)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} holds {type(record).__name__}, not the run record's JSON object")
    return record


def check_resume(args: argparse.Namespace, rollout_id: int) -> dict[str, Any] | None:
    """Refuse a ``--load`` of another method's checkpoint; return its run record (None when it has none).

    Raises:
        ArgumentValidationError: naming ``--load``, both methods and the fix.
    """
    method = get_method(args).name
    try:
        record = read_run_record(args.load, rollout_id)
    except ValueError as exc:
        reject(f"--load {args.load}: {exc}")
    if record is not None:
        saved = record.get("method")
        if saved != method:
            reject(
                f"--load {args.load} holds a --loss-type {saved} checkpoint (rollout {rollout_id}) but this command "
                f"is --loss-type {method}; resume it with --loss-type {saved}, or start the {method} run from an "
                "exported pipeline (--hf-checkpoint) with a new --save"
            )
        return record
    from miles.driver.validators import group_layout

    roles = {group.role for group in group_layout(args)}
    for sibling, role in _sibling_groups(args.load, rollout_id):
        if role not in roles:
            reject(
                f"--load {args.load} has a {role} group's checkpoint beside it ({sibling}) that --loss-type {method} "
                "does not load; resume it with the --loss-type that saved it, or start from an exported pipeline "
                "(--hf-checkpoint)"
            )
    return None


def _sibling_groups(load: str, rollout_id: int) -> list[tuple[Path, str]]:
    """``(checkpoint, role)`` of the other groups' checkpoints of ``rollout_id`` beside ``load`` (``<load>_<x>``)."""
    base = Path(os.path.normpath(load))
    found = []
    for sibling in sorted(base.parent.glob(f"{base.name}_*")):
        metadata = sibling / f"rollout_{rollout_id}" / "metadata.json"
        try:
            role = json.loads(metadata.read_text()).get("role")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(role, str):
            found.append((metadata.parent, role))
    return found


def changed_settings(args: argparse.Namespace, record: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """``(flag, the checkpoint's value, this command's)`` of every resumable setting this command changes."""
    if not record:
        return []
    saved = record.get("settings") or {}
    now = resumable_settings(args)
    return [(flag(dest), saved[dest], value) for dest, value in now.items() if dest in saved and saved[dest] != value]


def resumed_line(args: argparse.Namespace, start: int, roles: list[str], record: dict[str, Any] | None) -> list[str]:
    """The driver's lines about a resume: where it continues and which groups it loaded, then (when any) the
    settings it changes, e.g. ``resumed at rollout 10 (actor + critic) from --load ckpt`` and ``resume changes
    --lr 0.0001 -> 0.0002, --weight-decay 0.0 -> 0.01; the new values apply from rollout 10``."""
    lines = [f"resumed at rollout {start} ({' + '.join(roles)}) from --load {args.load}"]
    changes = changed_settings(args, record)
    if changes:
        listed = ", ".join(f"{name} {old} -> {new}" for name, old, new in changes)
        lines.append(f"resume changes {listed}; the new values apply from rollout {start}")
    return lines
