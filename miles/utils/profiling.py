"""Per-rank ``torch.profiler`` traces of chosen rollouts (``--profile-rollouts``).

A profiled rollout writes, for every rank of every trainer group and each phase it runs (``generate`` on the actor
ranks, ``train`` on every rank)::

    <profile-dir>/rollout_000005/critic-rank1-train.json   # Chrome / Perfetto trace (ui.perfetto.dev)
    <profile-dir>/rollout_000005/critic-rank1-train.txt    # torch's op table, sorted by self time

The phases the trainer times (``train_steps``: one span per optimizer window, ``train_output``: the method's
train-output hook, e.g. DMD2's scoring; ``generate``) appear in both as ``record_function`` spans, so the op table
attributes time to a phase as well as to an op (``aten::mm``, gloo's ``reduce_scatter``, ...). The same flag set
works on CUDA, where kernels join the CPU ops. The shape of the flags follows torchtitan's ``--profiling.*``.
"""

import argparse
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["add_profiling_args", "rollout_range", "profile_dir", "profiled"]

logger = logging.getLogger(__name__)

TABLE_ROWS = 40


def rollout_range(text: str) -> tuple[int, int]:
    """``"5"`` → ``(5, 6)``; ``"5:8"`` → ``(5, 8)``: rollout ids ``start <= id < end``, as a Python slice.

    Raises:
        argparse.ArgumentTypeError: on anything else, a negative start or an empty range.
    """
    start_text, sep, end_text = text.partition(":")
    try:
        start = int(start_text)
        end = int(end_text) if sep else start + 1
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"takes N or START:END (rollout ids, END excluded), got {text!r}") from exc
    if start < 0 or end <= start:
        raise argparse.ArgumentTypeError(f"needs 0 <= START < END, got {text!r}")
    return start, end


def add_profiling_args(parser: argparse.ArgumentParser) -> None:
    """The ``profiling`` flag group of ``train_diffusion.py``."""
    group = parser.add_argument_group("profiling")
    group.add_argument(
        "--profile-rollouts",
        type=rollout_range,
        default=None,
        metavar="START[:END]",
        help="Trace these rollouts with torch.profiler on every rank (END excluded): a Chrome trace and an op table "
        "per rank and phase. Leave out the first rollouts, which include warm-up.",
    )
    group.add_argument(
        "--profile-dir", type=str, default=None, help="Where the traces go; default: <output-dir>/profiles."
    )


def profile_dir(args) -> Path:
    """``--profile-dir``, or ``<--output-dir>/profiles``."""
    return Path(args.profile_dir) if args.profile_dir else Path(args.output_dir) / "profiles"


@contextlib.contextmanager
def profiled(profile, role: str, rank: int, rollout_id: int | str, phase: str) -> Iterator[None]:
    """Profile the block when ``rollout_id`` is in ``--profile-rollouts``; otherwise run it untouched.

    Args:
        profile: the run's :class:`miles.config.ProfileSpec` (``rollouts``: ``(start, end)``, ``directory``), or
            None when no rollout is profiled.
        role / rank: the trainer group and the DP rank; with ``phase`` they name the files.
        rollout_id: the rollout (an evaluation's string id is never profiled).
        phase: ``"generate"`` or ``"train"``.
    """
    rollouts = None if profile is None else profile.rollouts
    if rollouts is None or not isinstance(rollout_id, int) or not rollouts[0] <= rollout_id < rollouts[1]:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    out = Path(profile.directory) / f"rollout_{rollout_id:06d}"
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{role}-rank{rank}-{phase}"
    prof.export_chrome_trace(f"{stem}.json")
    sort_by = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    Path(f"{stem}.txt").write_text(prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS) + "\n")
    logger.info("profile of rollout %d (%s rank %d, %s): %s.{json,txt}", rollout_id, role, rank, phase, stem)
