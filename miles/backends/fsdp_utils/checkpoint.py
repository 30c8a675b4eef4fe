"""Sharded, atomic checkpoints of one trainer group (torch.distributed.checkpoint).

Layout under a group's save directory (the critic's is the sibling ``<save>_critic``)::

    <save>/rollout_<id>/dcp/            DCP shards of {"model": ..., "optimizer": ...} (every rank writes its shard)
    <save>/rollout_<id>/rank_<r>.pt     rank r's LR-scheduler state and RNG states
    <save>/rollout_<id>/data_state.pt   the driver's data cursor (the rollout manager's state_dict), if given
    <save>/rollout_<id>/metadata.json   {"rollout_id", "role", "world_size", "format_version", "saved_at"}; last file
    <save>/latest                       text file holding the id of the newest complete checkpoint

Atomicity: everything is written into ``<save>/.tmp_rollout_<id>``, renamed to ``rollout_<id>`` once every rank has
finished, and only then is ``latest`` replaced (write a temporary file, ``os.replace``). A crash at any point leaves
``latest`` naming the previous complete checkpoint, which is never touched. Every rank must see the same
``<save>`` path (a shared filesystem on multi-node runs).

Model and optimizer state go through ``get_state_dict`` / ``set_state_dict``, so a checkpoint loads into another
world size; the scheduler and RNG fall back to rank 0's file when a rank has no file of its own.
"""

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = [
    "FORMAT_VERSION",
    "LATEST_FILE",
    "checkpoint_dir",
    "read_latest",
    "read_data_state",
    "save_checkpoint",
    "load_checkpoint",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
LATEST_FILE = "latest"
METADATA_FILE = "metadata.json"
DATA_STATE_FILE = "data_state.pt"


def checkpoint_dir(save_dir: str | Path, rollout_id: int) -> Path:
    """``<save_dir>/rollout_<rollout_id>``."""
    return Path(save_dir) / f"rollout_{rollout_id}"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def read_latest(load_dir: str | Path) -> int:
    """The rollout id in ``<load_dir>/latest``.

    Raises:
        ValueError: if ``load_dir`` does not exist or holds no ``latest`` file (nothing complete was saved there).
        RuntimeError: if ``latest`` does not hold an integer.
    """
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise ValueError(f"--load {load_dir}: no such directory; pass a directory written by --save, or drop --load")
    latest = load_dir / LATEST_FILE
    if not latest.is_file():
        raise ValueError(
            f"--load {load_dir}: no '{LATEST_FILE}' file, so no checkpoint finished saving there; "
            "pass a directory written by --save, or drop --load"
        )
    text = latest.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(
            f"--load {load_dir}: '{LATEST_FILE}' holds {text!r}, not a rollout id; the file is corrupt"
        ) from None


def _verified_dir(load_dir: str | Path, rollout_id: int) -> Path:
    """The checkpoint directory of ``rollout_id``, after checking that it is complete. Raises RuntimeError if not."""
    path = checkpoint_dir(load_dir, rollout_id)
    if not path.is_dir():
        raise RuntimeError(f"--load {load_dir}: '{LATEST_FILE}' names rollout {rollout_id} but {path} is missing")
    try:
        metadata = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"checkpoint {path} is incomplete or corrupt: cannot read {METADATA_FILE} ({exc})") from exc
    if metadata.get("rollout_id") != rollout_id:
        raise RuntimeError(
            f"checkpoint {path}: {METADATA_FILE} says rollout {metadata.get('rollout_id')}, not {rollout_id}"
        )
    if not (path / "dcp" / ".metadata").is_file():
        raise RuntimeError(f"checkpoint {path} is incomplete or corrupt: dcp/.metadata is missing")
    return path


def read_data_state(load_dir: str | Path) -> tuple[int, Any]:
    """The driver's view of a checkpoint: ``(rollout_id, data_state)`` of the newest one in ``load_dir``.

    Runs in any process (no process group needed). ``data_state`` is what the driver passed to
    :func:`save_checkpoint` (the rollout manager's ``state_dict()``), or None if it passed nothing.

    Raises:
        ValueError / RuntimeError: as :func:`read_latest`, or when the newest checkpoint is incomplete.
    """
    rollout_id = read_latest(load_dir)
    path = _verified_dir(load_dir, rollout_id)
    data_file = path / DATA_STATE_FILE
    if not data_file.is_file():
        return rollout_id, None
    # The cursor is the rollout manager's own structure (may hold generator states), written by this module.
    return rollout_id, torch.load(data_file, map_location="cpu", weights_only=False)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    save_dir: str | Path,
    rollout_id: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    role: str,
    data_state: Any = None,
) -> Path:
    """Collective: every rank of the group calls this with the same ``save_dir`` and ``rollout_id``.

    Args:
        save_dir: the group's ``--save`` directory.
        rollout_id: the rollout just finished; a resumed run continues at ``rollout_id + 1``.
        model: the trainable FSDP module.
        optimizer, scheduler: its AdamW and LR schedule.
        role: the group's role, recorded in the metadata.
        data_state: the driver's data cursor, written by rank 0 (any picklable object).

    Returns:
        The final checkpoint directory.
    """
    save_dir = Path(save_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    tmp = save_dir / f".tmp_rollout_{rollout_id}"
    final = checkpoint_dir(save_dir, rollout_id)
    if rank == 0:
        # A leftover temporary directory is an earlier attempt that crashed before its rename.
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / "dcp"))
    torch.save({"scheduler": scheduler.state_dict(), "rng": _rng_state()}, tmp / f"rank_{rank}.pt")
    if rank == 0:
        if data_state is not None:
            torch.save(data_state, tmp / DATA_STATE_FILE)
        metadata = {
            "rollout_id": rollout_id,
            "role": role,
            "world_size": world_size,
            "format_version": FORMAT_VERSION,
            "saved_at": time.time(),
        }
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    _barrier()

    if rank == 0:
        if final.exists():
            # Same id saved before but not (or no longer) the newest, e.g. a crash after the rename and before
            # `latest`: replace it only now that the new copy is complete.
            stale = save_dir / f".stale_rollout_{rollout_id}"
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(tmp, final)
        latest_tmp = save_dir / f".{LATEST_FILE}.tmp"
        with open(latest_tmp, "w") as f:
            f.write(f"{rollout_id}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, save_dir / LATEST_FILE)
        logger.info("saved %s checkpoint of rollout %d to %s", role, rollout_id, final)
    _barrier()
    return final


def load_checkpoint(
    load_dir: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """Collective: load the newest checkpoint of ``load_dir`` into the model, optimizer, scheduler and RNG.

    Returns:
        The checkpoint's rollout id; the run resumes at that id + 1.

    Raises:
        ValueError: if ``load_dir`` holds no checkpoint (see :func:`read_latest`).
        RuntimeError: if the newest checkpoint is incomplete, corrupt, or does not fit the model.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    rollout_id = read_latest(load_dir)
    path = _verified_dir(load_dir, rollout_id)
    # get_state_dict gives the optimizer its state entries (a zero-lr step) so DCP knows what to read into.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(path / "dcp"))
    # DCP wraps every rank's error in a CheckpointException, a BaseException; its last line is the cause.
    except (Exception, CheckpointException) as exc:
        cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(f"checkpoint {path} is corrupt or does not fit this model: {cause}") from exc
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    rank_file = path / f"rank_{rank}.pt"
    if not rank_file.is_file():
        logger.warning(
            "%s has no %s (saved with another world size); using rank 0's scheduler/RNG", path, rank_file.name
        )
        rank_file = path / "rank_0.pt"
    try:
        extra = torch.load(rank_file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RuntimeError(f"checkpoint {path} is corrupt: cannot read {rank_file.name} ({exc})") from exc
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])
    logger.info("loaded checkpoint of rollout %d from %s", rollout_id, path)
    return rollout_id
