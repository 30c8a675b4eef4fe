"""Rank functions for tests that spawn gloo processes; a light module, so that each spawned child imports little."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from miles.utils.collectives import ProcessGroupCollectives


def rank_waits_for_rank_0(rank: int, port: int, watchdog_s: float, hold_s: float) -> None:
    """Rank ``rank`` of 2: a default gloo group with a ``watchdog_s`` timeout, :class:`ProcessGroupCollectives`
    beside it, rank 0 busy for ``hold_s`` before both meet in ``collectives.barrier()``; then both groups are used
    once more. Raises in the child (and so in ``mp.start_processes``) when a wait times out."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    # Start both ranks' groups together, so that a slow process start never eats into the short watchdog.
    store.set(f"ready{rank}", "1")
    store.wait(["ready0", "ready1"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=watchdog_s))
    collectives = ProcessGroupCollectives(torch.device("cpu"))
    if rank == 0:
        time.sleep(hold_s)  # rank 0 alone writes the pipeline
    collectives.barrier()
    # The device group is still usable after the wait, and the collectives agree.
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2
    assert collectives.all_reduce_max([rank, -rank]) == [1, 0]
    gathered = collectives.gather_objects({"rank": rank})
    assert gathered == ([{"rank": 0}, {"rank": 1}] if rank == 0 else None)
    dist.destroy_process_group()
