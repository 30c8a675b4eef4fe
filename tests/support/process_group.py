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


def rank_scores_with_sharded_experts(rank: int, port: int, pipeline: str, cases: str) -> None:
    """Rank ``rank`` of 2: the two-expert teacher of ``pipeline`` loaded frozen and sharded per block over a gloo
    mesh (ZeRO-3: every block all-gathers in its forward), then one forward of this rank's case from ``cases`` (a
    ``torch.save`` of ``[{"latents", "timestep", "cond", "expected"}, ...]``, one per rank) whose velocity must equal
    ``expected`` (the unsharded teacher's). The ranks' batches need different experts; a rank that skipped an expert
    would leave the other waiting in that expert's all-gather until the 60 s timeout raises."""
    from torch.distributed.device_mesh import init_device_mesh

    from miles.backends.fsdp_utils.model import load_frozen_denoiser, reshard
    from miles.models import get_model_family

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    family = get_model_family(pipeline)
    teacher = load_frozen_denoiser(family, pipeline, mesh, torch.device("cpu"), torch.float32)
    case = torch.load(cases)[rank]
    with torch.no_grad():
        velocity = family.predict_velocity(teacher, case["latents"], case["timestep"], case["cond"])
    reshard(teacher)
    torch.testing.assert_close(velocity, case["expected"], rtol=0, atol=1e-5)
    dist.destroy_process_group()
