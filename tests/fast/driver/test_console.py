"""The driver's start-up lines: each group's ranks, device, torch threads per rank and parameters."""

import logging

from miles.driver.console import log_groups_ready


class _Group:
    """What ``log_groups_ready`` reads of a ``RayTrainGroup``: its world size and rank 0's ``describe()``."""

    def __init__(self, world_size: int, threads: int) -> None:
        self.world_size, self.threads = world_size, threads

    def describe(self) -> dict:
        return {
            "device": "cpu",
            "threads": self.threads,
            "trainable_parameters": 630_000,
            "frozen_parameters": 0,
            "sharded": self.world_size > 1,
        }


class _Engines:
    def __init__(self, count: int, num_threads: int | None) -> None:
        self.engines, self.num_threads = [object()] * count, num_threads


def test_each_group_line_names_the_threads_per_rank(caplog):
    with caplog.at_level(logging.INFO, logger="train_diffusion"):
        log_groups_ready({"critic": _Group(2, 2), "actor": _Group(1, 1)}, _Engines(1, 3), 12.4)
    assert caplog.messages == [
        "critic group: 2 ranks on cpu, 2 torch threads per rank, 0.63M trainable + 0.00M frozen parameters, "
        "FSDP-sharded",
        "actor group: 1 ranks on cpu, 1 torch thread per rank, 0.63M trainable + 0.00M frozen parameters",
        "rollout: 1 dedicated engine replicas, 3 torch threads each",
        "ready in 12s",
    ]
