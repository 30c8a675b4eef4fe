"""The few collectives a trainer group and a rollout generator use, behind one small interface.

``GroupTrainer`` and ``RolloutGenerator`` never call ``torch.distributed`` themselves: they are handed a
``Collectives``. A Ray rank passes :class:`ProcessGroupCollectives` (its group's process group); a unit test, an
engine replica or any single process passes :class:`LocalCollectives`, so the same code runs at world size 1 with
no process group at all.
"""

from datetime import timedelta
from typing import Any, Protocol

import torch

from miles.utils.validation import HookResultError

__all__ = ["Collectives", "LocalCollectives", "ProcessGroupCollectives", "check_equal_counts"]


class Collectives(Protocol):
    """What a group's ranks agree on. Every method is collective: each rank calls it, in the same order."""

    rank: int
    world_size: int

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the ranks."""

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0; None on the other ranks."""

    def barrier(self) -> None:
        """Wait until every rank arrived."""


class LocalCollectives:
    """The collectives of a group of one (a unit test, an engine replica): each is the identity."""

    rank = 0
    world_size = 1

    def all_reduce_max(self, values: list[int]) -> list[int]:
        return [int(value) for value in values]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        return [obj]

    def barrier(self) -> None:
        pass


class ProcessGroupCollectives:
    """The collectives of the default ``torch.distributed`` process group's ranks, run on a gloo group of their own.

    What the ranks agree on here are a few host-side values (counts, the metrics, "everyone arrived"), so they go
    over a CPU (gloo) group created beside the default one, never over NCCL: a rank waiting in :meth:`barrier` while
    rank 0 alone exports a pipeline or pushes weights to the engine replicas then waits on the host, outside NCCL's
    watchdog, and no CUDA stream is synchronised for a handful of integers. FSDP2 and DCP keep using the default
    (NCCL) group for the tensors.

    Args:
        device: the rank's training device (kept for callers; the collectives here run on the CPU).
        timeout: how long a rank waits in one of these collectives (``--distributed-timeout-minutes``); None is
            gloo's default (30 minutes).

    Collective: every rank of the default group constructs it, in the same order as its other group creations.
    """

    def __init__(self, device: torch.device, timeout: timedelta | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timeout)

    def all_reduce_max(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=self.group)
        return [int(value) for value in tensor.tolist()]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(obj, gathered, dst=0, group=self.group)
        return gathered

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)


def check_equal_counts(
    collectives: Collectives, count: int, source: str, group: str, problem: Exception | None = None
) -> None:
    """Collective: every rank must hold as many train pairs as the others, or the FSDP collectives that follow hang.

    ``problem`` is this rank's failed check of ``source``'s result (a hook or the converter); it is raised here,
    after every rank took part, and the other ranks raise naming the first failed rank instead of waiting for it.
    One MAX all-reduce carries the largest count, the smallest (negated) and the first failed rank (negated, with a
    sentinel below every rank when none failed).

    Raises:
        HookResultError: ``problem`` itself, or naming the failed rank on the others.
        ValueError: if the ranks' counts differ.
    """
    none_failed = -(1 << 30)
    first_failed = -collectives.rank if problem is not None else none_failed
    largest, neg_smallest, failed = collectives.all_reduce_max([count, -count, first_failed])
    if problem is not None:
        raise problem
    if failed != none_failed:
        raise HookResultError(
            f"{source} failed its check on DP rank {-failed} of the {group} group (that rank's error says why)"
        )
    if largest != -neg_smallest:
        raise ValueError(
            f"{group} ranks hold different numbers of train pairs ({-neg_smallest}..{largest}) after {source}; it "
            "must keep every rank's count equal"
        )
