"""The driver's bookkeeping of a run's checkpoint directories: the commit, the resume point, the clean-up.

Every group saves its own state (:mod:`miles.backends.fsdp_utils.checkpoint`, layout there); this module decides which
of those rollouts the run stands on. One commit per rollout: after every group has renamed its ``rollout_<id>``
into place, :func:`commit` replaces ``<save>/latest``. A crash at any point leaves ``latest`` naming the previous
complete rollout; a resume (:func:`resume_rollout`) takes it and removes what a crashed rollout left behind
(:func:`remove_uncommitted`), so nothing needs a hand edit. Runs in the driver process (no process group needed).
"""

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from miles.backends.fsdp_utils.checkpoint import DATA_STATE_FILE, LATEST_FILE, checkpoint_dir, verified_dir

__all__ = [
    "checkpoint_entries",
    "commit",
    "complete_rollouts",
    "prune",
    "read_data_state",
    "read_latest",
    "remove_checkpoints",
    "remove_uncommitted",
    "resume_rollout",
]

_ROLLOUT_DIR = re.compile(r"^rollout_(\d+)$")
_TEMPORARY = (".tmp_rollout_", ".stale_rollout_", f".{LATEST_FILE}.tmp")


def read_latest(load_dir: str | Path) -> int:
    """The committed rollout id in ``<load_dir>/latest``.

    Raises:
        ValueError: if ``load_dir`` does not exist or holds no ``latest`` file (no rollout was committed there).
        RuntimeError: if ``latest`` does not hold a rollout id (an integer >= 0).
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
        rollout = int(text)
    except ValueError:
        rollout = -1
    if rollout < 0:  # a rollout id counts from 0: "-1" is as corrupt as "abc"
        raise RuntimeError(f"--load {load_dir}: '{LATEST_FILE}' holds {text!r}, not a rollout id; the file is corrupt")
    return rollout


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
                verified_dir(save_dir, int(match.group(1)))
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
            committed rollout is missing, incomplete or of another format.
    """
    rollout_id = read_latest(group_dirs[0])
    for directory in group_dirs:
        try:
            verified_dir(directory, rollout_id)
        except RuntimeError as exc:
            raise RuntimeError(f"--load {group_dirs[0]} committed rollout {rollout_id}, but {exc}") from None
    return rollout_id


def read_data_state(load_dir: str | Path, rollout_id: int | None = None) -> tuple[int, Any]:
    """``(rollout_id, data_state)`` of a checkpoint in the actor's directory (default: the committed one).

    ``data_state`` is what the driver saved with the rollout (the rollout manager's ``state_dict()``), or None.
    """
    rollout_id = read_latest(load_dir) if rollout_id is None else rollout_id
    data_file = verified_dir(load_dir, rollout_id) / DATA_STATE_FILE
    if not data_file.is_file():
        return rollout_id, None
    # The cursor is the rollout manager's own structure: plain ints and lists, so the safe loader reads it.
    return rollout_id, torch.load(data_file, map_location="cpu", weights_only=True)


def commit(group_dirs: list[str | Path], rollout_id: int) -> None:
    """Make ``rollout_id`` the resume point of the run: check it is complete in every group's directory, then
    replace ``group_dirs[0]/latest`` atomically (write a temporary file, fsync, ``os.replace``).

    Raises:
        RuntimeError: if a group's checkpoint of the rollout is missing or incomplete (``latest`` is untouched).
    """
    for directory in group_dirs:
        verified_dir(directory, rollout_id)
    primary = Path(group_dirs[0])
    tmp = primary / f".{LATEST_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{rollout_id}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, primary / LATEST_FILE)


def remove_uncommitted(group_dirs: list[str | Path], committed: int | None) -> list[Path]:
    """Remove what a crash left behind in the groups' directories: temporary directories, and rollouts newer than
    the commit (``committed``; None: every rollout). Returns the removed paths. Only names a checkpoint writes are
    touched."""
    removed = []
    for directory in map(Path, group_dirs):
        if not directory.is_dir():
            continue
        for entry in directory.iterdir():
            match = _ROLLOUT_DIR.match(entry.name)
            stale = entry.name.startswith(_TEMPORARY)
            newer = bool(match) and (committed is None or int(match.group(1)) > committed)
            if entry.is_dir() and (stale or newer) or (entry.is_file() and stale):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                removed.append(entry)
    return removed


def checkpoint_entries(directory: str | Path) -> list[str]:
    """The names in ``directory`` a checkpoint writes (``latest``, ``rollout_<id>``, temporary entries), sorted."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(
        entry.name
        for entry in directory.iterdir()
        if _ROLLOUT_DIR.match(entry.name) or entry.name == LATEST_FILE or entry.name.startswith(_TEMPORARY)
    )


def remove_checkpoints(group_dirs: list[str | Path]) -> list[Path]:
    """``--overwrite-save``: remove every entry a checkpoint writes from the groups' directories (the ``latest``
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


def prune(
    group_dirs: list[str | Path],
    committed: int,
    keep_last: int | None,
    keep_every: int | None,
    keep: tuple[int, ...] = (),
) -> list[Path]:
    """After a commit: remove older complete rollouts beyond the ``keep_last`` newest, sparing every rollout whose
    id + 1 is a multiple of ``keep_every`` and the rollouts in ``keep`` (``--keep-best``'s). The committed rollout is
    always kept. Returns the removed paths."""
    if not keep_last:
        return []
    removed = []
    for directory in map(Path, group_dirs):
        ids = [rollout for rollout in complete_rollouts(directory) if rollout <= committed]
        for rollout in ids[:-keep_last]:
            if keep_every and (rollout + 1) % keep_every == 0 or rollout in keep:
                continue
            path = checkpoint_dir(directory, rollout)
            shutil.rmtree(path)
            removed.append(path)
    return removed
