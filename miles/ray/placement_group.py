"""Where the trainer groups and the rollout manager run.

One placement-group bundle per trainer rank: ``{"GPU": 1, "CPU": 1}`` on a cluster with GPUs, ``{"CPU": 1}``
without (``--actor-num-gpus-per-node`` then counts CPU ranks), so a laptop, CI and a multi-node cluster run the same
code. Every trainer group of a run has the same DP size and sits on the same bundles (colocated); the rollout
manager and its engine share bundle 0 with them (``--rollout-num-gpus 0``, the default) or get their own bundles.

The fractions of a bundle each process reserves are the constants below and nowhere else.
"""

import logging
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.ray.actor_group import RayTrainGroup
from miles.utils.trainer_config import compute_trainer_args, compute_trainer_configs

__all__ = [
    "TRAINER_BUNDLE_SHARE",
    "ENGINE_BUNDLE_SHARE",
    "PLACEMENT_TIMEOUT_S",
    "use_gpu_bundles",
    "trainer_resources",
    "rollout_resources",
    "create_placement_groups",
    "create_training_models",
    "create_rollout_manager",
]

logger = logging.getLogger(__name__)

# A colocated bundle is split between the trainer groups (equally) and the rollout manager with its engine. Ray
# counts these fractions only for scheduling; sleep/wake is what actually frees device memory between the users.
TRAINER_BUNDLE_SHARE = 0.8
ENGINE_BUNDLE_SHARE = 0.2
# How long to wait for the cluster to grant the bundles before failing with the flags to change.
PLACEMENT_TIMEOUT_S = 120


def use_gpu_bundles() -> bool:
    """True when the Ray cluster has GPUs (bundles then hold one GPU each); needs ``ray.init`` first."""
    return ray.cluster_resources().get("GPU", 0) > 0


def engine_colocated(args) -> bool:
    """The rollout manager shares the trainers' bundle 0 unless ``--rollout-num-gpus`` gives it its own."""
    return not args.rollout_num_gpus


def trainer_resources(num_groups: int, colocated_engine: bool, use_gpu: bool) -> tuple[float, float]:
    """``(num_gpus, num_cpus)`` each trainer rank reserves of its bundle.

    The trainer share (all of the bundle when the engine has its own) is split equally among the ``num_groups``
    colocated groups: 2 groups with a colocated engine take 0.4 each and the engine 0.2.
    """
    share = (TRAINER_BUNDLE_SHARE if colocated_engine else 1.0) / num_groups
    return (share if use_gpu else 0.0), share


def rollout_resources(colocated_engine: bool, use_gpu: bool) -> tuple[float, float]:
    """``(num_gpus, num_cpus)`` of the rollout manager: a slice of bundle 0, or all of its own first bundle."""
    share = ENGINE_BUNDLE_SHARE if colocated_engine else 1.0
    return (share if use_gpu else 0.0), share


def _ready(pg: PlacementGroup, what: str, bundles: list[dict[str, float]]) -> PlacementGroup:
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as exc:
        raise RuntimeError(
            f"the Ray cluster could not place {len(bundles)} bundles of {bundles[0]} for {what} within "
            f"{PLACEMENT_TIMEOUT_S}s (cluster has {ray.cluster_resources()}); lower --actor-num-nodes / "
            "--actor-num-gpus-per-node / --rollout-num-gpus or add resources"
        ) from exc
    return pg


def create_placement_groups(args) -> dict[str, tuple[PlacementGroup, list[int]]]:
    """Reserve the run's bundles.

    Returns:
        ``{"actor": (pg, [bundle per trainer rank]), "rollout": (pg, [bundle indices of the rollout manager])}``;
        every trainer group uses the ``"actor"`` entry.

    Raises:
        RuntimeError: if the cluster cannot grant the bundles in time.
    """
    bundle = {"GPU": 1, "CPU": 1} if use_gpu_bundles() else {"CPU": 1}
    num_ranks = args.actor_num_nodes * args.actor_num_gpus_per_node
    bundles = [dict(bundle) for _ in range(num_ranks)]
    trainer_pg = _ready(placement_group(bundles, strategy="PACK"), "the trainer groups", bundles)
    pgs = {"actor": (trainer_pg, list(range(num_ranks)))}
    if engine_colocated(args):
        pgs["rollout"] = (trainer_pg, [0])
    else:
        rollout_bundles = [dict(bundle) for _ in range(args.rollout_num_gpus)]
        rollout_pg = _ready(placement_group(rollout_bundles, strategy="PACK"), "the rollout engine", rollout_bundles)
        pgs["rollout"] = (rollout_pg, list(range(args.rollout_num_gpus)))
    logger.info("placement: %d trainer bundles of %s, rollout on %s", num_ranks, bundle, pgs["rollout"][1])
    return pgs


def create_training_models(args, pgs: dict[str, tuple[PlacementGroup, list[int]]]) -> dict[str, RayTrainGroup]:
    """Spawn and initialise one ``RayTrainGroup`` per ``compute_trainer_configs(args)`` entry, in training order.

    Each group gets ``compute_trainer_args(args, config)``; all groups initialise concurrently. Each returned
    group's ``start_rollout_id`` is 0, or its checkpoint's rollout + 1 with ``--load``.

    Raises:
        RuntimeError: if the groups' checkpoints resume at different rollouts (e.g. an actor checkpoint newer than
            the critic's ``<load>_critic``).
    """
    configs = compute_trainer_configs(args)
    gpus, cpus = trainer_resources(len(configs), engine_colocated(args), use_gpu_bundles())
    groups = {
        config.role: RayTrainGroup(
            compute_trainer_args(args, config),
            config.role,
            args.actor_num_nodes,
            args.actor_num_gpus_per_node,
            pgs["actor"],
            num_gpus_per_actor=gpus,
            num_cpus_per_actor=cpus,
        )
        for config in configs
    }
    init_refs = {role: group.async_init() for role, group in groups.items()}
    starts = {}
    for role, refs in init_refs.items():
        rank_starts = set(ray.get(refs))
        if len(rank_starts) != 1:
            raise RuntimeError(f"{role} ranks resume at different rollouts {sorted(rank_starts)}")
        starts[role] = groups[role].start_rollout_id = rank_starts.pop()
    if len(set(starts.values())) != 1:
        raise RuntimeError(
            f"trainer groups resume at different rollouts {starts}; their --load checkpoints (the critic's is "
            "<load>_critic) must come from the same save"
        )
    return groups


def create_rollout_manager(args, pgs: dict[str, tuple[PlacementGroup, list[int]]]) -> Any:
    """Start the ``RolloutManager`` actor on the rollout bundle; it splits every rollout over the trainers' DP size."""
    from miles.ray.rollout import RayRolloutManager

    pg, bundle_indices = pgs["rollout"]
    gpus, cpus = rollout_resources(engine_colocated(args), use_gpu_bundles())
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_indices[0])
    dp = args.actor_num_nodes * args.actor_num_gpus_per_node
    return RayRolloutManager.options(num_gpus=gpus, num_cpus=cpus, scheduling_strategy=strategy).remote(args, dp)
