"""The few collectives a trainer group and a rollout generator use, behind one small interface.

``GroupTrainer`` and ``RolloutGenerator`` never call ``torch.distributed`` themselves: they are handed a
``Collectives``. A Ray rank passes :class:`ProcessGroupCollectives` (its group's process group); a unit test, an
engine replica or any single process passes :class:`LocalCollectives`, so the same code runs at world size 1 with
no process group at all.
"""

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
    """The collectives over the default ``torch.distributed`` process group.

    Args:
        device: where the reduced tensors live (the rank's CUDA device under NCCL, the CPU under gloo).
    """

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_reduce_max(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX)
        return [int(value) for value in tensor.tolist()]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(obj, gathered, dst=0)
        return gathered

    def barrier(self) -> None:
        self._dist.barrier()


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
