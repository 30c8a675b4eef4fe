"""Preflight of ``--load``: the committed checkpoint is complete, readable and of this command's loss type.

Run by the driver before Ray starts (:func:`miles.driver.preflight.validate_inputs`, in a ``--dry-run`` too). Reads
only headers and small files: each group's DCP ``.metadata`` (the shards' expected sizes, compared with the files'),
the data cursor, and the run record (:mod:`miles.driver.resume`). A checkpoint
whose shards were truncated (a copy cut short, a disk that filled under another tool) is refused here, with the
newest earlier checkpoint that is complete in every group offered instead, rather than failing in every worker.
"""

import argparse
import math
from pathlib import Path

from miles.config import GroupSpec
from miles.utils.validation import ArgumentValidationError, reject

__all__ = ["check_load"]


def _fail(load: str, message: str) -> None:
    reject(message if message.startswith("--load") else f"--load {load}: {message}")


def _damaged(directory: str, rollout_id: int) -> str | None:
    """What is wrong with a group's checkpoint of ``rollout_id`` beyond what ``resume_rollout`` checks (None if
    nothing): a DCP shard shorter than its ``.metadata`` says."""
    from torch.distributed.checkpoint import FileSystemReader

    from miles.backends.fsdp_utils.checkpoint import checkpoint_dir

    path = checkpoint_dir(directory, rollout_id)
    try:
        metadata = FileSystemReader(str(path / "dcp")).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is a damaged checkpoint
        return f"{path / 'dcp' / '.metadata'} is not readable ({type(exc).__name__}: {exc})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = path / "dcp" / name
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < end:
            held = "is missing" if size is None else f"holds {size} bytes"
            return f"shard {shard} {held}, but the checkpoint's metadata needs {end}"
    return None


def _offer(load: str, earlier: int | None) -> str:
    """The sentence that names the newest earlier checkpoint complete in every group ('' when there is none)."""
    if earlier is None:
        return ""
    return f"; rollout_{earlier} is complete: write {earlier} into {Path(load) / 'latest'} to resume from it"


def _earlier_complete(dirs: list[str], before: float) -> int | None:
    from miles.driver.run_dir import complete_rollouts

    common = set(complete_rollouts(dirs[0]))
    for directory in dirs[1:]:
        common &= set(complete_rollouts(directory))
    earlier = [rollout for rollout in common if rollout < before and not any(_damaged(d, rollout) for d in dirs)]
    return max(earlier, default=None)


def check_load(args: argparse.Namespace, groups: list[GroupSpec]) -> None:
    """``--load`` holds a commit (``latest``) of this command's loss type, complete and readable in every group's
    directory, with a rollout left to train below ``--num-rollout``.

    Raises:
        ArgumentValidationError: naming ``--load``, the file at fault and, for a corrupt ``latest``, a committed
            rollout missing in a group or a damaged checkpoint, the newest earlier one complete in every group.
    """
    from miles.driver.resume import check_data_cursor, check_resume
    from miles.driver.run_dir import read_data_state, read_latest, resume_rollout

    loads = [group.checkpoint.load for group in groups]
    load_dirs = [args.load] + [load for load in loads if load and load != args.load]
    latest = None
    try:
        latest = read_latest(args.load)
        check_resume(args, latest)
        committed = resume_rollout(load_dirs)
    except ArgumentValidationError:
        raise  # a command that does not fit the checkpoint: no earlier rollout fits it better
    except (OSError, ValueError, RuntimeError) as exc:
        # A commit that is unreadable, or names a rollout some group lacks, may leave an earlier one whole.
        earlier = _earlier_complete(load_dirs, math.inf if latest is None else latest)
        _fail(args.load, f"{exc}{_offer(args.load, earlier)}")
    if committed + 1 >= args.num_rollout:
        reject(
            f"--load {args.load} committed rollout {committed}, the last of --num-rollout {args.num_rollout}: "
            f"nothing is left to train; raise --num-rollout above {committed + 1}"
        )
    problem = next((p for p in (_damaged(directory, committed) for directory in load_dirs) if p), None)
    data_state = None
    if problem is None:
        try:
            _, data_state = read_data_state(args.load, committed)
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign pickle
            problem = f"its data cursor does not load ({type(exc).__name__}: {exc})"
    if problem is not None:
        earlier = _earlier_complete(load_dirs, committed)
        offer = _offer(args.load, earlier) or "; no earlier complete checkpoint is left: start afresh without --load"
        reject(f"--load {args.load} committed rollout {committed}, but it is damaged: {problem}{offer}")
    check_data_cursor(args, committed, data_state)
