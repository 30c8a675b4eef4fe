"""The process groups of a trainer group: their timeout, and ranks that wait for rank 0 on the host.

Rank 0 alone exports a pipeline (80 GB for Qwen-Image) or pushes the weights to the engine replicas while the other
ranks wait in ``collectives.barrier()``. On a GPU node that barrier used to be a NCCL collective, which NCCL's
watchdog aborts after 10 minutes. Here two gloo processes recreate it: the default group gets a 1-second timeout
(standing in for the NCCL group's watchdog) and rank 0 works for 3 seconds before it joins the barrier.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles.backends.fsdp_utils.actor import init_distributed
from miles.driver.arguments import parse_args
from miles.utils.validation import ArgumentValidationError
from tests.support.process_group import rank_waits_for_rank_0
from tests.support.trainer import free_port

WATCHDOG_S = 1.0  # the device group's timeout, NCCL's 10-minute watchdog in miniature
HOLD_S = 3.0  # rank 0's single-rank work (an export), longer than the watchdog


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_ranks_wait_for_rank_0s_long_work_outside_the_device_groups_watchdog():
    # Fails on the base commit: the barrier ran on the default group, whose 2 s timeout rank 1 outwaits.
    # A fork server that imported torch once forks both ranks: no process inherits this one's threads (Ray's), and
    # neither imports torch again.
    mp.get_context("forkserver").set_forkserver_preload(["tests.support.process_group"])
    args = (free_port(), WATCHDOG_S, HOLD_S)
    mp.start_processes(rank_waits_for_rank_0, args=args, nprocs=2, join=True, start_method="forkserver")


def test_the_timeout_reaches_both_process_groups():
    mesh, collectives, _ = init_distributed(torch.device("cpu"), f"tcp://127.0.0.1:{free_port()}", 0, 1, 7)
    try:
        assert _timeout(dist.distributed_c10d._get_default_group()) == timedelta(minutes=7)
        assert _timeout(collectives.group) == timedelta(minutes=7)
        assert mesh.mesh_dim_names == ("dp",) and mesh.size() == 1
        assert collectives.all_reduce_max([3, -2]) == [3, -2] and collectives.gather_objects(5) == [5]
        collectives.barrier()
    finally:
        dist.destroy_process_group()


def test_distributed_timeout_flag_defaults_to_an_hour_and_must_be_positive():
    base = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "1"]
    base += ["--rollout-batch-size", "2", "--global-batch-size", "2"]
    assert parse_args(base).distributed_timeout_minutes == 60
    assert parse_args([*base, "--distributed-timeout-minutes", "120"]).distributed_timeout_minutes == 120
    with pytest.raises((ArgumentValidationError, SystemExit)):
        parse_args([*base, "--distributed-timeout-minutes", "0"])
