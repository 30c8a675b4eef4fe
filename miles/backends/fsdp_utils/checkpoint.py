"""Sharded checkpoints of the trainer groups (torch.distributed.checkpoint), committed one rollout at a time.

A group's state is a list of ``Stateful`` things (torchtitan's ``CheckpointManager(states=...)``): its trainable
modules and optimizer (:class:`TrainState`, through ``get_state_dict`` / ``set_state_dict``, so a checkpoint loads
into another world size), its EMA when it keeps one, and per rank the LR schedule and RNG states.

Layout, for every group's save directory (the actor's is ``--save``, the critic's the sibling ``<save>_critic``)::

    <dir>/rollout_<id>/dcp/             DCP shards of {"train": model(s), optimizer, ema}
    <dir>/rollout_<id>/rank_<r>.pt      rank r's LR-scheduler and RNG states
    <dir>/rollout_<id>/data_state.pt    the data cursor (the actor's directory only)
    <dir>/rollout_<id>/metadata.json    {"rollout_id", "role", "world_size", "format_version", ...}; written last
    <save>/latest                       the commit: the id of the newest rollout complete in every group

One commit per rollout: each group writes ``.tmp_rollout_<id>`` and renames it to ``rollout_<id>`` when every rank
has finished; only after every group has done so does the driver replace ``<save>/latest`` (:func:`commit`). A
crash at any point leaves ``latest`` naming the previous complete rollout; a resume (:func:`resume_rollout`) takes
it and removes what a crashed rollout left behind (:func:`remove_uncommitted`), so nothing needs a hand edit.
"""

import errno
import json
import logging
import os
import random
import re
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
from torch.distributed.checkpoint.stateful import Stateful

from miles.utils.validation import CheckpointWriteError

__all__ = [
    "FORMAT_VERSION",
    "LATEST_FILE",
    "TrainState",
    "checkpoint_dir",
    "checkpoint_entries",
    "commit",
    "complete_rollouts",
    "describe_os_error",
    "load_checkpoint",
    "prune",
    "read_data_state",
    "read_latest",
    "remove_checkpoints",
    "remove_uncommitted",
    "resume_rollout",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
LATEST_FILE = "latest"
METADATA_FILE = "metadata.json"
DATA_STATE_FILE = "data_state.pt"
_ROLLOUT_DIR = re.compile(r"^rollout_(\d+)$")


class TrainState(Stateful):
    """A group's trainable modules (one ``nn.ModuleDict``), their optimizer and, when kept, their EMA."""

    def __init__(self, modules: nn.ModuleDict, optimizer: torch.optim.Optimizer, ema: Any = None) -> None:
        self.modules, self.optimizer, self.ema = modules, optimizer, ema

    def state_dict(self) -> dict[str, Any]:
        # get_state_dict gives the optimizer its state entries (a zero-lr step) so a load knows what to read into.
        model_state, optim_state = get_state_dict(self.modules, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.modules, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])


def checkpoint_dir(save_dir: str | Path, rollout_id: int) -> Path:
    """``<save_dir>/rollout_<rollout_id>``."""
    return Path(save_dir) / f"rollout_{rollout_id}"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def read_latest(load_dir: str | Path) -> int:
    """The committed rollout id in ``<load_dir>/latest``.

    Raises:
        ValueError: if ``load_dir`` does not exist or holds no ``latest`` file (no rollout was committed there).
        RuntimeError: if ``latest`` does not hold an integer.
    """
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise ValueError(f"--load {load_dir}: no such directory; pass a directory written by --save, or drop --load")
    latest = load_dir / LATEST_FILE
    if not latest.is_file():
        raise ValueError(
            f"--load {load_dir}: no '{LATEST_FILE}' file, so no rollout was committed there; "
            "pass a directory written by --save, or drop --load"
        )
    text = latest.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(
            f"--load {load_dir}: '{LATEST_FILE}' holds {text!r}, not a rollout id; the file is corrupt"
        ) from None


def _verified_dir(save_dir: str | Path, rollout_id: int) -> Path:
    """The checkpoint directory of ``rollout_id``, after checking that it is complete. Raises RuntimeError if not."""
    path = checkpoint_dir(save_dir, rollout_id)
    if not path.is_dir():
        raise RuntimeError(f"checkpoint {path} is missing")
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


def complete_rollouts(save_dir: str | Path) -> list[int]:
    """Ids of the complete ``rollout_<id>`` checkpoints in ``save_dir``, ascending (committed or not)."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    ids = []
    for entry in save_dir.iterdir():
        match = _ROLLOUT_DIR.match(entry.name)
        if match and entry.is_dir():
            try:
                _verified_dir(save_dir, int(match.group(1)))
            except RuntimeError:
                continue
            ids.append(int(match.group(1)))
    return sorted(ids)


def resume_rollout(group_dirs: list[str | Path]) -> int:
    """The rollout a resume continues after: the commit in ``group_dirs[0]/latest``, checked complete in every
    group's directory.

    Args:
        group_dirs: every group's load directory, the actor's (``--load``) first.

    Raises:
        ValueError / RuntimeError: naming the directory, when there is no commit or a group's checkpoint of the
            committed rollout is missing or incomplete.
    """
    rollout_id = read_latest(group_dirs[0])
    for directory in group_dirs:
        try:
            _verified_dir(directory, rollout_id)
        except RuntimeError as exc:
            raise RuntimeError(f"--load {group_dirs[0]} committed rollout {rollout_id}, but {exc}") from None
    return rollout_id


def read_data_state(load_dir: str | Path, rollout_id: int | None = None) -> tuple[int, Any]:
    """``(rollout_id, data_state)`` of a checkpoint in the actor's directory (default: the committed one).

    Runs in any process (no process group needed). ``data_state`` is what the driver saved with the rollout (the
    rollout manager's ``state_dict()``), or None.
    """
    rollout_id = read_latest(load_dir) if rollout_id is None else rollout_id
    data_file = _verified_dir(load_dir, rollout_id) / DATA_STATE_FILE
    if not data_file.is_file():
        return rollout_id, None
    # The cursor is the rollout manager's own structure: plain ints and lists, so the safe loader reads it.
    return rollout_id, torch.load(data_file, map_location="cpu", weights_only=True)


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
    state: TrainState,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    role: str,
    data_state: Any = None,
) -> Path:
    """Collective: write this group's checkpoint of ``rollout_id`` (every rank, the same ``save_dir``).

    Writes ``.tmp_rollout_<id>`` and renames it to ``rollout_<id>`` once every rank has finished; ``latest`` is the
    driver's to advance (:func:`commit`), after every group has saved.

    Args:
        save_dir: the group's save directory.
        rollout_id: the rollout just finished; a resumed run continues at ``rollout_id + 1``.
        state: the group's modules, optimizer and EMA.
        scheduler: its LR schedule.
        role: the group's role, recorded in the metadata.
        data_state: the data cursor, written by rank 0 (the actor group's).

    Returns:
        The checkpoint directory.

    Raises:
        OSError: when the disk is full or the directory unwritable; the temporary directory is removed, and no
            complete checkpoint is touched.
    """
    save_dir = Path(save_dir)
    rank = _rank()
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    tmp = save_dir / f".tmp_rollout_{rollout_id}"
    final = checkpoint_dir(save_dir, rollout_id)
    error: BaseException | None = None
    if rank == 0:
        # A leftover temporary directory is an earlier attempt that crashed before its rename.
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = exc
    if not _any_rank(error is not None):
        try:
            dcp.save({"train": state}, checkpoint_id=str(tmp / "dcp"))
            # Python file objects, so that a full disk raises ENOSPC here (torch's own writer reports a full disk
            # as "unexpected pos N vs M").
            _write(tmp / f"rank_{rank}.pt", {"scheduler": scheduler.state_dict(), "rng": _rng_state()})
            if rank == 0:
                if data_state is not None:
                    _write(tmp / DATA_STATE_FILE, data_state)
                metadata = {
                    "rollout_id": rollout_id,
                    "role": role,
                    "world_size": world_size,
                    "format_version": FORMAT_VERSION,
                    "saved_at": time.time(),
                }
                with open(tmp / METADATA_FILE, "w") as f:
                    f.write(json.dumps(metadata, indent=2) + "\n")
        # DCP wraps every rank's error in a CheckpointException, a BaseException.
        except (Exception, CheckpointException) as exc:
            error = exc
    # Every rank learns whether any rank failed, so none waits in a barrier for a rank that gave up.
    if _any_rank(error is not None):
        # Before the temporary directory goes: removing it frees the space whose lack may be the cause.
        cause = _cause(error, save_dir) if isinstance(error, (OSError, CheckpointException)) else None
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            raise CheckpointWriteError(
                f"could not save the {role} checkpoint of rollout {rollout_id} to {save_dir}: another rank failed "
                "(its error names the cause); no complete checkpoint was touched"
            )
        if not isinstance(error, (OSError, CheckpointException)):
            raise error
        raise CheckpointWriteError(
            f"could not save the {role} checkpoint of rollout {rollout_id} to {save_dir}: "
            f"{cause}; no complete checkpoint was touched"
        ) from error
    if rank == 0:
        if final.exists():
            # The same id saved before and never committed (a crash after the rename): replace it now that the new
            # copy is complete.
            stale = save_dir / f".stale_rollout_{rollout_id}"
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(tmp, final)
        logger.debug("saved %s checkpoint of rollout %d to %s", role, rollout_id, final)
    _barrier()
    return final


def _write(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank of the process group (``flag`` itself without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _cause(exc: BaseException, save_dir: str | Path | None = None) -> str:
    """The root cause of an error (DCP wraps each rank's error in a CheckpointException), on one line; a full disk
    is spelled out as "No space left on device", also when a writer reports it in its own words."""
    while True:
        if isinstance(exc, CheckpointException) and exc.failures:
            exc = next(iter(exc.failures.values()))[0]  # (exception, traceback) of the first failed rank
        elif exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            break
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return "No space left on device" + (f" (writing {exc.filename})" if exc.filename else "")
    if save_dir is not None and _disk_full(save_dir):
        return f"No space left on device ({text})"
    return text


def describe_os_error(exc: BaseException, directory: str | Path | None = None) -> str:
    """One line for a failed write into ``directory``: the root cause, a full disk spelled "No space left on
    device"."""
    return _cause(exc, directory)


def _disk_full(path: str | Path) -> bool:
    try:
        return shutil.disk_usage(path).free < 1 << 20
    except OSError:
        return False


def commit(group_dirs: list[str | Path], rollout_id: int) -> None:
    """Make ``rollout_id`` the resume point of the run: check it is complete in every group's directory, then
    replace ``group_dirs[0]/latest`` atomically (write a temporary file, fsync, ``os.replace``).

    Raises:
        RuntimeError: if a group's checkpoint of the rollout is missing or incomplete (``latest`` is untouched).
    """
    for directory in group_dirs:
        _verified_dir(directory, rollout_id)
    primary = Path(group_dirs[0])
    tmp = primary / f".{LATEST_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{rollout_id}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, primary / LATEST_FILE)


def remove_uncommitted(group_dirs: list[str | Path], committed: int | None) -> list[Path]:
    """Remove what a crash left behind in the groups' directories: temporary directories, and rollouts newer than
    the commit (``committed``; None: every rollout). Returns the removed paths. Only names this module writes are
    touched."""
    removed = []
    for directory in map(Path, group_dirs):
        if not directory.is_dir():
            continue
        for entry in directory.iterdir():
            match = _ROLLOUT_DIR.match(entry.name)
            stale = entry.name.startswith((".tmp_rollout_", ".stale_rollout_", f".{LATEST_FILE}.tmp"))
            newer = bool(match) and (committed is None or int(match.group(1)) > committed)
            if entry.is_dir() and (stale or newer) or (entry.is_file() and stale):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                removed.append(entry)
    return removed


def _is_checkpoint_entry(name: str) -> bool:
    return bool(_ROLLOUT_DIR.match(name)) or name == LATEST_FILE or name.startswith(_TEMPORARY)


_TEMPORARY = (".tmp_rollout_", ".stale_rollout_", f".{LATEST_FILE}.tmp")


def checkpoint_entries(directory: str | Path) -> list[str]:
    """The names in ``directory`` this module writes (``latest``, ``rollout_<id>``, temporary entries), sorted."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(entry.name for entry in directory.iterdir() if _is_checkpoint_entry(entry.name))


def remove_checkpoints(group_dirs: list[str | Path]) -> list[Path]:
    """``--overwrite-save``: remove every entry this module writes from the groups' directories (the ``latest``
    commit first, so a crash midway never leaves a commit naming a removed rollout); other files stay. Returns the
    removed paths."""
    removed = []
    for directory in map(Path, group_dirs):
        names = checkpoint_entries(directory)
        for name in sorted(names, key=lambda name: name != LATEST_FILE):
            entry = directory / name
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry)
    return removed


def prune(group_dirs: list[str | Path], committed: int, keep_last: int | None, keep_every: int | None) -> list[Path]:
    """After a commit: remove older complete rollouts beyond the ``keep_last`` newest, sparing every rollout whose
    id + 1 is a multiple of ``keep_every``. The committed rollout is always kept. Returns the removed paths."""
    if not keep_last:
        return []
    removed = []
    for directory in map(Path, group_dirs):
        ids = [rollout for rollout in complete_rollouts(directory) if rollout <= committed]
        for rollout in ids[:-keep_last]:
            if keep_every and (rollout + 1) % keep_every == 0:
                continue
            path = checkpoint_dir(directory, rollout)
            shutil.rmtree(path)
            removed.append(path)
    return removed


def load_checkpoint(
    load_dir: str | Path,
    rollout_id: int,
    state: TrainState,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Collective: load this group's checkpoint of ``rollout_id`` into its modules, optimizer, EMA, scheduler, RNG.

    Raises:
        RuntimeError: if the checkpoint is incomplete, corrupt, or does not fit the modules.
    """
    rank = _rank()
    path = _verified_dir(load_dir, rollout_id)
    try:
        dcp.load({"train": state}, checkpoint_id=str(path / "dcp"))
    # DCP wraps every rank's error in a CheckpointException, a BaseException.
    except (Exception, CheckpointException) as exc:
        raise RuntimeError(f"checkpoint {path} is corrupt or does not fit this model: {_cause(exc)}") from exc
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
    logger.debug("loaded checkpoint of rollout %d from %s", rollout_id, path)
