"""``RayTrainGroup``: the Ray actors of one trainer group, one per data-parallel rank.

A plain list of actor handles; every ``async_*`` method calls the same method on each rank and returns the list of
ObjectRefs for the caller to ``ray.get`` (slime's ``RayTrainGroup``).
"""

import logging
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
from miles.utils.types import Box

__all__ = ["RayTrainGroup"]

logger = logging.getLogger(__name__)


class RayTrainGroup:
    """Spawn ``num_nodes · num_gpus_per_node`` ranks of ``FSDPTrainRayActor`` into a placement group.

    Rank r runs in bundle ``bundle_indices[r]``; rank 0 starts first and reports the address and port the others
    join. Colocated groups are placed on the same bundles and each takes a fraction of a bundle.

    Args:
        args: this group's args (``compute_trainer_args(args, trainer)``); sent to every rank by ``async_init``.
        role: the group's role (``"actor"``, ``"critic"``).
        num_nodes, num_gpus_per_node: the group's size; without CUDA the same numbers count CPU ranks.
        pg: ``(placement_group, bundle_indices)``, one bundle index per rank.
        num_gpus_per_actor, num_cpus_per_actor: the fraction of its bundle each rank reserves
            (``placement_group.trainer_resources``).

    Raises:
        ValueError: if the placement group has fewer bundles than ranks.
    """

    def __init__(
        self,
        args,
        role: str,
        num_nodes: int,
        num_gpus_per_node: int,
        pg: tuple[PlacementGroup, list[int]],
        num_gpus_per_actor: float,
        num_cpus_per_actor: float,
    ) -> None:
        self.args = args
        self.role = role
        self.world_size = num_nodes * num_gpus_per_node
        # Set by create_training_models from async_init: 0, or the loaded checkpoint's rollout + 1.
        self.start_rollout_id = 0
        placement_group, bundle_indices = pg
        if len(bundle_indices) < self.world_size:
            raise ValueError(
                f"{role} group needs {self.world_size} bundles (--actor-num-nodes × --actor-num-gpus-per-node) but "
                f"the placement group has {len(bundle_indices)}"
            )
        remote_cls = ray.remote(FSDPTrainRayActor)
        self.actors = []
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle_indices[rank]
            )
            options = dict(num_cpus=num_cpus_per_actor, num_gpus=num_gpus_per_actor, scheduling_strategy=strategy)
            self.actors.append(remote_cls.options(**options).remote())
        # Rank 0's node hosts the process group's rendezvous.
        self.master_addr, self.master_port = ray.get(self.actors[0].get_master_addr_and_port.remote())
        logger.info("%s group: %d ranks, master %s:%d", role, self.world_size, self.master_addr, self.master_port)

    def async_init(self) -> list[ray.ObjectRef]:
        """Each rank joins the process group and loads its models; each ref resolves to the first rollout id."""
        return [
            actor.init.remote(self.args, self.role, self.master_addr, self.master_port, rank, self.world_size)
            for rank, actor in enumerate(self.actors)
        ]

    def async_train(
        self, rollout_id: int, rollout_data_refs: list[Box], external_data: dict[str, list[Box]] | None = None
    ) -> list[ray.ObjectRef]:
        """Train every rank on its shard; rank i gets ``rollout_data_refs[i]`` and ``{role: boxes[i]}``.

        Args:
            rollout_id: the rollout.
            rollout_data_refs: the rollout manager's boxes, one per rank.
            external_data: earlier groups' train outputs this rollout, ``{role: [Box per rank]}``.

        Returns:
            One ref per rank, each resolving to the rank's ``Box`` of its train output.

        Raises:
            ValueError: if a list does not hold one box per rank.
        """
        external_data = external_data or {}
        if len(rollout_data_refs) != self.world_size:
            raise ValueError(
                f"{self.role} group has {self.world_size} ranks but the rollout has {len(rollout_data_refs)} shards"
            )
        for role, boxes in external_data.items():
            if len(boxes) != self.world_size:
                raise ValueError(
                    f"{self.role} group has {self.world_size} ranks but group {role!r} handed over {len(boxes)} outputs"
                )
        return [
            actor.train.remote(
                rollout_id, rollout_data_refs[rank], {role: boxes[rank] for role, boxes in external_data.items()}
            )
            for rank, actor in enumerate(self.actors)
        ]

    def async_save(self, rollout_id: int, data_state: Any = None) -> list[ray.ObjectRef]:
        """Checkpoint every rank after ``rollout_id``; ``data_state`` is the driver's data cursor."""
        return [actor.save.remote(rollout_id, data_state) for actor in self.actors]

    def async_sleep(self) -> list[ray.ObjectRef]:
        """Move every rank's model and optimizer state off the device."""
        return [actor.sleep.remote() for actor in self.actors]

    def async_wake_up(self) -> list[ray.ObjectRef]:
        """Move every rank's state back onto the device."""
        return [actor.wake_up.remote() for actor in self.actors]

    def async_update_weights(self, rollout_manager) -> list[ray.ObjectRef]:
        """Push the gathered weights to the rollout engine (rank 0 sends; all ranks gather)."""
        return [actor.update_weights.remote(rollout_manager) for actor in self.actors]

    def async_export_hf(self, out_dir: str) -> list[ray.ObjectRef]:
        """Write the trained denoiser as a diffusers pipeline directory at ``out_dir`` (rank 0 writes)."""
        return [actor.export_hf.remote(out_dir) for actor in self.actors]

    def async_get_full_state_dict(self) -> list[ray.ObjectRef]:
        """Every rank joins the gather; rank 0's ref holds the unsharded state dict, the others ``{}``."""
        return [actor.get_full_state_dict.remote() for actor in self.actors]

    def async_sleep_state(self) -> list[ray.ObjectRef]:
        """Each rank's ``"awake"``/``"asleep"``."""
        return [actor.sleep_state.remote() for actor in self.actors]

    def shutdown(self) -> None:
        """Close each rank's process group and end its Ray actor."""
        try:
            ray.get([actor.shutdown.remote() for actor in self.actors], timeout=60)
        finally:
            for actor in self.actors:
                ray.kill(actor)
