"""Where the trainer groups and the rollout engines run.

One placement-group bundle per trainer rank: ``{"GPU": 1, "CPU": c}`` on a cluster with GPUs, ``{"CPU": c}``
without (``--actor-num-gpus-per-node`` then counts CPU ranks), so a laptop, CI and a multi-node cluster run the same
code. Every trainer group of a run has the same DP size and sits on the same bundles (colocated): rank i of each
group shares bundle i, and the groups take turns on it (the driver runs them one after the other). The actor group's
ranks generate the rollouts themselves; ``--rollout-num-gpus N`` instead reserves N bundles for N engine replicas.
The RolloutManager only reads prompts and reserves no bundle.

The fractions of a bundle each process reserves are the constants below and nowhere else.
"""

import logging
import os
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from miles.config import RunSpec
from miles.ray.actor_group import RayTrainGroup
from miles.utils.validation import RunError

__all__ = [
    "PLACEMENT_TIMEOUT_S",
    "PlacementTimeoutError",
    "bundle_cpus",
    "rank_threads",
    "create_engine_group",
    "create_placement_groups",
    "create_rollout_manager",
    "create_training_models",
    "trainer_resources",
    "use_gpu_bundles",
]

logger = logging.getLogger(__name__)

# How long to wait for the cluster to grant the bundles before failing with the flags to change.
PLACEMENT_TIMEOUT_S = 120


class PlacementTimeoutError(RunError, RuntimeError):
    """The cluster did not grant a placement group's bundles in time; the message names the flags to change."""


def use_gpu_bundles() -> bool:
    """True when the Ray cluster has GPUs (bundles then hold one GPU each); needs ``ray.init`` first."""
    return ray.cluster_resources().get("GPU", 0) > 0


def bundle_cpus(args) -> int:
    """CPUs per bundle: ``--num-cpus-per-rank``, or the smallest bundle-holding node's CPUs divided among the
    processes that hold a bundle on it (``--actor-num-gpus-per-node`` trainer ranks, plus the engine replicas), at
    least 1. Needs ``ray.init`` first.

    On a cluster with GPUs the bundles hold a GPU each, so only the nodes with GPUs count: a CPU-only head node (8
    CPUs beside 192-CPU GPU nodes) holds no bundle and must not leave every rank one thread. Without GPUs every node
    may hold bundles and all count.
    """
    if args.num_cpus_per_rank:
        return int(args.num_cpus_per_rank)
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    gpu_nodes = [resources for resources in nodes if resources.get("GPU", 0) > 0]
    node_cpus = [resources.get("CPU", 0) for resources in (gpu_nodes or nodes)]
    node_cpus = [cpus for cpus in node_cpus if cpus > 0] or [1]
    per_node = args.actor_num_gpus_per_node + (args.rollout_num_gpus if args.actor_num_nodes == 1 else 0)
    return max(1, int(min(node_cpus) // max(1, per_node)))


def rank_threads(args, environ=None) -> int:
    """torch intra-op threads per trainer rank and engine replica: the CPUs of its bundle (:func:`bundle_cpus`), at
    most ``OMP_NUM_THREADS`` when the driver's environment sets it (a positive integer; anything else is ignored).

    The bundle's CPUs are what Ray reserved, not what is free: a Ray cluster may declare more CPUs than the machine
    has, and a second run on the same cores does not show in it. More threads than free cores make OpenMP's
    parallel regions wait on descheduled threads: a tiny DMD2 run of 2 ranks at 2 threads each took 32× as long per
    rollout as at 1 thread on the loaded 2-core machine (docs/performance.md, "Threads per rank").
    ``OMP_NUM_THREADS``, which torch itself reads, is how a user or a test session shares the cores. Needs
    ``ray.init`` first (unless ``--num-cpus-per-rank`` is given).
    """
    cpus = bundle_cpus(args)
    cap = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    if cap.strip().isdigit() and int(cap) >= 1:
        return min(cpus, int(cap))
    return cpus


def trainer_resources(num_groups: int, use_gpu: bool, cpus: int) -> tuple[float, float]:
    """``(num_gpus, num_cpus)`` each trainer rank reserves of its bundle: an equal share among the colocated
    groups (2 groups on a 1-GPU, 2-CPU bundle take 0.5 GPU and 1 CPU each)."""
    share = 1.0 / num_groups
    return (share if use_gpu else 0.0), share * cpus


def _ready(pg: PlacementGroup, what: str, bundles: list[dict[str, float]]) -> PlacementGroup:
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as exc:
        # A pending group stays queued on the cluster (one the driver joined outlives it) and takes its bundles once
        # they free up: hand it back.
        remove_placement_group(pg)
        raise PlacementTimeoutError(
            f"the Ray cluster could not place {len(bundles)} bundles of {bundles[0]} for {what} within "
            f"{PLACEMENT_TIMEOUT_S}s (cluster has {ray.cluster_resources()}); lower --actor-num-nodes / "
            "--actor-num-gpus-per-node / --rollout-num-gpus / --num-cpus-per-rank or add resources"
        ) from exc
    return pg


def create_placement_groups(args) -> dict[str, tuple[PlacementGroup, list[int]]]:
    """Reserve the run's bundles.

    Returns:
        ``{"actor": (pg, [bundle per trainer rank])}``, plus ``"rollout": (pg, [bundle per engine replica])`` with
        ``--rollout-num-gpus``; every trainer group uses the ``"actor"`` entry.

    Raises:
        PlacementTimeoutError: if the cluster cannot grant the bundles in time; nothing stays reserved then.
    """
    cpus = bundle_cpus(args)
    bundle = {"GPU": 1, "CPU": cpus} if use_gpu_bundles() else {"CPU": cpus}
    num_ranks = args.actor_num_nodes * args.actor_num_gpus_per_node
    bundles = [dict(bundle) for _ in range(num_ranks)]
    pgs = {
        "actor": (
            _ready(placement_group(bundles, strategy="PACK"), "the trainer groups", bundles),
            list(range(num_ranks)),
        )
    }
    if args.rollout_num_gpus:
        engine_bundles = [dict(bundle) for _ in range(args.rollout_num_gpus)]
        try:
            engine_pg = _ready(placement_group(engine_bundles, strategy="PACK"), "the rollout engines", engine_bundles)
        except PlacementTimeoutError:
            remove_placement_group(pgs["actor"][0])  # the caller never sees it, so cannot end it
            raise
        pgs["rollout"] = (engine_pg, list(range(args.rollout_num_gpus)))
    logger.debug("placement: %d trainer bundles of %s, %d engine bundles", num_ranks, bundle, args.rollout_num_gpus)
    return pgs


def create_training_models(
    args,
    run: RunSpec,
    pgs: dict[str, tuple[PlacementGroup, list[int]]],
    started: list | None = None,
    load_rollout_id: int | None = None,
) -> dict[str, RayTrainGroup]:
    """Spawn one ``RayTrainGroup`` per group of ``run`` (its specs), then initialise them one after the other, in
    training order; ``args`` are the placement flags (nodes, ranks, CPUs per rank).

    Every rank gets the run's specs and reads its group's. One group at a time loads its models (each rank reading
    its shards, :mod:`miles.backends.fsdp_utils.weights`) so that a GPU never holds two groups' start-up at once;
    when the groups share GPUs, each sleeps (its state in host memory) before the next one starts, and the actor
    group is the one left awake, as the driver's turns expect. Each returned group's ``start_rollout_id`` is 0, or
    ``load_rollout_id + 1`` (the committed rollout of ``--load``, which every group loads from its own load
    directory). ``started`` (optional) receives ``("actor", handle)`` for every rank spawned, before any can fail to
    initialise, so the caller can end them.

    Raises:
        WorkerError: naming the first rank whose ``init`` failed; the groups after it are not initialised.
        RuntimeError: if the groups' checkpoints resume at different rollouts.
    """
    cpus = bundle_cpus(args)
    gpus, cpus_per_rank = trainer_resources(len(run.groups), use_gpu_bundles(), cpus)
    groups = {
        group.role: RayTrainGroup(
            run,
            group.role,
            args.actor_num_nodes,
            args.actor_num_gpus_per_node,
            pgs["actor"],
            num_gpus_per_actor=gpus,
            num_cpus_per_actor=cpus_per_rank,
            num_threads=rank_threads(args),
        )
        for group in run.groups
    }
    if started is not None:
        started += [("actor", handle) for group in groups.values() for handle in group.actors]
    # Colocated groups on GPUs take turns from the start (miles.driver.schedule.needs_sleep's rule).
    take_turns = len(groups) > 1 and gpus > 0
    roles = list(groups)
    awake = "actor" if "actor" in groups else roles[-1]  # the actor generates first
    starts = {}
    for i, (role, group) in enumerate(groups.items()):
        rank_starts = set(group.get(group.async_init(load_rollout_id), "init"))
        if len(rank_starts) != 1:
            raise RuntimeError(f"{role} ranks resume at different rollouts {sorted(rank_starts)}")
        starts[role] = group.start_rollout_id = rank_starts.pop()
        if take_turns and (i < len(roles) - 1 or role != awake):
            group.get(group.async_sleep(), "sleep")
    if take_turns and awake != roles[-1]:
        groups[awake].get(groups[awake].async_wake_up(), "wake_up")
    if len(set(starts.values())) != 1:
        raise RuntimeError(f"trainer groups resume at different rollouts {starts}")
    return groups


def create_engine_group(args, run: RunSpec, pgs: dict[str, tuple[PlacementGroup, list[int]]]) -> Any:
    """The ``--rollout-num-gpus`` engine replicas on their own bundles (each reads the run's engine spec), or None
    when the actor ranks generate."""
    if "rollout" not in pgs:
        return None
    from miles.ray.engine_group import EngineGroup

    cpus = bundle_cpus(args)
    return EngineGroup(
        run, pgs["rollout"], num_gpus=1.0 if use_gpu_bundles() else 0.0, num_cpus=cpus, num_threads=rank_threads(args)
    )


def create_rollout_manager(run: RunSpec, side_inputs: list = ()) -> Any:
    """Start the ``RolloutManager`` actor (the run's data spec, the method's side inputs, the DP split; it reserves
    no CPU of the bundles)."""
    from miles.ray.rollout import RayRolloutManager

    return RayRolloutManager.options(num_cpus=0).remote(run.engine.data, run.dp_size, list(side_inputs))
