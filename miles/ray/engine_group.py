"""``EngineGroup``: the dedicated rollout-engine replicas of ``--rollout-num-gpus N``.

N replicas of ``RolloutEngineWorker``, one per bundle of their own placement group. The DP shards of a rollout are
dealt out in contiguous runs: replica j generates the shards of DP ranks ``j·D/N .. (j + 1)·D/N − 1`` (N must
divide the DP size D), so each replica takes 1/N of the prompts.
"""

import logging
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.config import RunSpec
from miles.ray.actor_group import evaluate_on
from miles.rollout.worker import RolloutEngineWorker
from miles.utils.types import Box

__all__ = ["EngineGroup"]

logger = logging.getLogger(__name__)


class EngineGroup:
    """Spawn and initialise ``len(bundle_indices)`` engine replicas.

    Args:
        run: the run's specs (the engine's: the student's settings).
        pg: ``(placement_group, bundle_indices)``, one bundle per replica.
        num_gpus, num_cpus: what each replica reserves of its bundle.
        num_threads: torch CPU threads per replica.
    """

    # Placed like RayTrainGroup's ranks (a placement group's bundles, a share of each), hence the same arguments.
    def __init__(
        self,
        run: RunSpec,
        pg: tuple[PlacementGroup, list[int]],
        num_gpus: float,
        num_cpus: float,
        num_threads: int | None = None,
    ) -> None:
        placement_group, bundle_indices = pg
        self.num_threads = num_threads
        remote_cls = ray.remote(RolloutEngineWorker)
        self.engines = [
            remote_cls.options(
                num_gpus=num_gpus,
                num_cpus=num_cpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=index
                ),
            ).remote()
            for index in bundle_indices
        ]
        ray.get([engine.init.remote(run, num_threads) for engine in self.engines])

    def async_generate(self, rollout_id: int, shard_boxes: list[Box]) -> list[ray.ObjectRef]:
        """One ref per replica, each resolving to the ``RolloutResult`` list of its run of DP shards; flatten them
        in order to get one result per DP rank.

        Raises:
            ValueError: if the number of replicas does not divide the number of shards.
        """
        count = len(self.engines)
        if len(shard_boxes) % count:
            raise ValueError(
                f"{len(shard_boxes)} DP shards do not split over {count} engine replicas: --rollout-num-gpus must "
                "divide the DP size"
            )
        per = len(shard_boxes) // count
        return [
            engine.generate.remote(rollout_id, shard_boxes[j * per : (j + 1) * per])
            for j, engine in enumerate(self.engines)
        ]

    def evaluate(self, shard, **kwargs: Any) -> torch.Tensor:
        """Sample ``shard`` with the replicas' student, split over them: uint8 images ``(B, H, W, C)``."""
        return evaluate_on(self.engines, shard, **kwargs)
