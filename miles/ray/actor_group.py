"""``RayTrainGroup``: the Ray actors of one trainer group, one per data-parallel rank.

A plain list of actor handles; every ``async_*`` method calls the same method on each rank and returns the list of
ObjectRefs for the caller to wait on with :meth:`RayTrainGroup.get` (slime's ``RayTrainGroup``). The calls that a
method makes outside the driver's loop (an evaluation's probe: generate a shard's pairs, run a train-output hook on
them) are dispatched here once (:meth:`RayTrainGroup.generate_shard`, :meth:`RayTrainGroup.run_train_output`), so
no method puts, splits or gets objects itself.
"""

import logging
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
from miles.config import RunSpec
from miles.ray.errors import get_all
from miles.utils.types import Box, PromptShard, SideRecords, TrainPair

__all__ = ["RayTrainGroup", "evaluate_on", "per_rank", "split_shard"]

logger = logging.getLogger(__name__)


def split_shard(shard: PromptShard, parts: int) -> tuple[list[PromptShard], int]:
    """Split a shard into ``parts`` equal contiguous shards, padding with copies of its last sample (its side
    inputs' last record too) so that every rank runs the same forwards (FSDP collectives). Returns the shards and
    the pad count to drop from the end of the results."""
    total = len(shard)
    size = -(-total // parts)
    pad = size * parts - total

    def padded(values: list) -> list:
        return values + values[-1:] * pad

    indices, prompts, records = padded(shard.sample_indices), padded(shard.prompts), padded(shard.records)
    side = {name: SideRecords(padded(data.records), data.base_dir) for name, data in shard.side_data.items()}

    def part(values: list, i: int) -> list:
        return values[i * size : (i + 1) * size]

    shards = [
        PromptShard(
            shard.rollout_id,
            part(indices, i),
            part(prompts, i),
            part(records, i),
            shard.base_dir,
            side_data={name: SideRecords(part(data.records, i), data.base_dir) for name, data in side.items()},
        )
        for i in range(parts)
    ]
    return shards, pad


def per_rank(values: list, cp: int) -> list:
    """One value per DP rank → one per trainer rank: the ``cp`` consecutive ranks of a context-parallel group
    (:mod:`miles.backends.fsdp_utils.context_parallel`) get their DP rank's value."""
    return [value for value in values for _ in range(cp)]


def evaluate_on(workers: list, shard: PromptShard, cp: int = 1, **kwargs: Any) -> torch.Tensor:
    """Sample ``shard`` split over ``workers`` (actor ranks or engine replicas, each with ``evaluate``): uint8
    images ``(B, H, W, C)`` in the shard's order. With context parallelism (``cp`` > 1) the ``cp`` ranks of a CP
    group sample the same part together and the first one's images count."""
    shards, pad = split_shard(shard, len(workers) // cp)
    refs = [worker.evaluate.remote(part, **kwargs) for worker, part in zip(workers, per_rank(shards, cp))]
    images = torch.cat(ray.get(refs)[::cp])
    return images[: len(images) - pad] if pad else images


class RayTrainGroup:
    """Spawn ``num_nodes · num_gpus_per_node`` ranks of ``FSDPTrainRayActor`` into a placement group.

    Rank r runs in bundle ``bundle_indices[r]``; rank 0 starts first and reports the address and port the others
    join. Colocated groups are placed on the same bundles and each takes a fraction of a bundle.

    Args:
        run: the run's specs; sent to every rank by ``async_init`` (each rank reads its group's,
            ``run.group(role)``).
        role: the group's role (``"actor"``, ``"critic"``).
        num_nodes, num_gpus_per_node: the group's size; without CUDA the same numbers count CPU ranks.
        pg: ``(placement_group, bundle_indices)``, one bundle index per rank.
        num_gpus_per_actor, num_cpus_per_actor: the fraction of its bundle each rank reserves
            (``placement_group.trainer_resources``).
        num_threads: torch CPU threads per rank (``placement_group.rank_threads``: the bundle's CPUs, at most
            ``OMP_NUM_THREADS``).

    Raises:
        ValueError: if the placement group has fewer bundles than ranks.
    """

    def __init__(
        self,
        run: RunSpec,
        role: str,
        num_nodes: int,
        num_gpus_per_node: int,
        pg: tuple[PlacementGroup, list[int]],
        num_gpus_per_actor: float,
        num_cpus_per_actor: float,
        num_threads: int | None = None,
    ) -> None:
        self.run, self.spec = run, run.group(role)
        self.role = role
        self.world_size = num_nodes * num_gpus_per_node
        # Context parallelism: runs of cp consecutive ranks share one DP rank's data (per_rank).
        self.cp = run.context_parallel_size
        self.dp_size = self.world_size // self.cp
        self.num_threads = num_threads
        # Set by create_training_models from async_init: 0, or the loaded checkpoint's rollout + 1.
        self.start_rollout_id = 0
        # The driver's DeviceTurns while colocated groups take turns on their GPUs (take_turns), else None.
        self.turns = None
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
        logger.debug("%s group: %d ranks, master %s:%d", role, self.world_size, self.master_addr, self.master_port)

    @property
    def labels(self) -> list[str]:
        """``["critic rank 0", "critic rank 1"]``: how errors name the ranks."""
        return [f"{self.role} rank {rank}" for rank in range(self.world_size)]

    def get(self, refs: list[ray.ObjectRef], method: str, rollout_id: Any = None) -> list:
        """The ranks' results of ``method`` in rank order; the first failure as one line
        (:func:`miles.ray.errors.get_all`: "critic rank 1 failed in train (rollout 3): ValueError: ...").

        Raises:
            WorkerError: naming the rank, ``method`` and ``rollout_id``.
        """
        return get_all(refs, self.labels, method, rollout_id)

    def async_init(self, load_rollout_id: int | None = None) -> list[ray.ObjectRef]:
        """Each rank joins the process group, loads its models and (with ``load_rollout_id``) its checkpoint of that
        rollout; each ref resolves to the first rollout id."""
        return [
            actor.init.remote(
                self.run,
                self.role,
                self.master_addr,
                self.master_port,
                rank,
                self.world_size,
                self.num_threads,
                load_rollout_id,
            )
            for rank, actor in enumerate(self.actors)
        ]

    def take_turns(self, turns: Any) -> None:
        """From now on every call of this group that computes on the device (generate, evaluate, train,
        train_output, save, update_weights, export, the full state dict) first calls ``turns.hand_to(role)`` (the
        driver's ``DeviceTurns``): the group awake so far sleeps and this one wakes, so that a shared GPU holds one
        group at a time whoever calls (the driver's loop, an evaluation, a method's debug grid)."""
        self.turns = turns

    def _take_turn(self) -> None:
        if self.turns is not None:
            self.turns.hand_to(self.role)

    def _check_per_rank(self, what: str, values: list) -> None:
        if len(values) != self.world_size:
            raise ValueError(f"{self.role} group has {self.world_size} ranks but got {len(values)} {what}")

    def async_generate(self, rollout_id: int, shard_boxes: list[Box]) -> list[ray.ObjectRef]:
        """Rank i generates and converts ``shard_boxes[i // cp]`` (one box per DP rank: the ranks of a
        context-parallel group generate their shard together); one ref per rank, each resolving to its
        ``RolloutResult``."""
        if len(shard_boxes) != self.dp_size:
            raise ValueError(f"{self.role} group has {self.dp_size} DP ranks but got {len(shard_boxes)} prompt shards")
        self._take_turn()
        boxes = per_rank(shard_boxes, self.cp)
        return [actor.generate.remote(rollout_id, box) for actor, box in zip(self.actors, boxes)]

    def evaluate(self, shard: PromptShard, **kwargs: Any) -> torch.Tensor:
        """Sample ``shard`` with the student, split over the DP ranks: uint8 images ``(B, H, W, C)`` in order."""
        self._take_turn()
        return evaluate_on(self.actors, shard, self.cp, **kwargs)

    def async_train(
        self, rollout_id: int, pairs_boxes: list[Box], external_data: dict[str, list[Box]] | None = None
    ) -> list[ray.ObjectRef]:
        """Train every rank on its pairs; rank i gets ``pairs_boxes[i]`` and ``{role: boxes[i]}``.

        Args:
            rollout_id: the rollout.
            pairs_boxes: the generated train pairs, one box per rank.
            external_data: earlier groups' train outputs this rollout, ``{role: [Box per rank]}``.

        Returns:
            One ref per rank, each resolving to the rank's ``TrainResult``.

        Raises:
            ValueError: if a list does not hold one box per rank.
        """
        external_data = external_data or {}
        self._check_per_rank("train-pair shards", pairs_boxes)
        for role, boxes in external_data.items():
            self._check_per_rank(f"outputs of group {role!r}", boxes)
        self._take_turn()
        return [
            actor.train.remote(
                rollout_id, pairs_boxes[rank], {role: boxes[rank] for role, boxes in external_data.items()}
            )
            for rank, actor in enumerate(self.actors)
        ]

    def async_train_output(self, rollout_id: int | str, pairs_boxes: list[Box]) -> list[ray.ObjectRef]:
        """Run only the train-output hook of every rank on its pairs (no training); refs of ``Box(output)``."""
        self._check_per_rank("train-pair shards", pairs_boxes)
        self._take_turn()
        return [actor.train_output.remote(rollout_id, box) for actor, box in zip(self.actors, pairs_boxes)]

    # -- an evaluation's probes: put, split, call and get dispatched here once --------------------------------------
    def generate_shard(self, rollout_id: int | str, shard: PromptShard) -> tuple[list[Box], int]:
        """Generate and convert ``shard`` split over the DP ranks (:func:`split_shard`; no training): one box of train
        pairs per DP rank (a context-parallel group's first rank's), and the pad count (the last pairs of the last
        rank repeat its last sample).

        Raises:
            WorkerError: naming the rank that failed.
        """
        shards, pad = split_shard(shard, self.dp_size)
        results = self.get(
            self.async_generate(rollout_id, [Box(ray.put(part)) for part in shards]), "generate", rollout_id
        )
        return [result.pairs for result in results[:: self.cp]], pad

    def run_train_output(self, rollout_id: int | str, pairs: list[Box] | list[list[TrainPair]]) -> list[Any]:
        """Each DP rank's train-output hook on its pairs (a box per DP rank, or the pairs themselves; the ranks of a
        context-parallel group run on the same pairs), no training; the outputs in DP rank order.

        Raises:
            WorkerError: naming the rank that failed.
        """
        boxes = [part if isinstance(part, Box) else Box(ray.put(part)) for part in pairs]
        outputs = self.get(self.async_train_output(rollout_id, per_rank(boxes, self.cp)), "train_output", rollout_id)
        return ray.get([box.inner for box in outputs[:: self.cp]])

    @staticmethod
    def unbox(boxes: list[Box]) -> list[Any]:
        """The values of ``boxes`` (one object-store read for all of them)."""
        return ray.get([box.inner for box in boxes])

    def describe(self) -> dict[str, Any]:
        """Rank 0's start-up summary (``FSDPTrainRayActor.describe``)."""
        (info,) = self.get([self.actors[0].describe.remote()], "describe")
        return info

    def async_save(self, rollout_id: int, data_state: Any = None) -> list[ray.ObjectRef]:
        """Checkpoint every rank after ``rollout_id``; ``data_state`` is the driver's data cursor."""
        self._take_turn()
        return [actor.save.remote(rollout_id, data_state) for actor in self.actors]

    def async_sleep(self) -> list[ray.ObjectRef]:
        """Move every rank's model and optimizer state off the device; each ref resolves to its seconds."""
        return [actor.sleep.remote() for actor in self.actors]

    def async_wake_up(self) -> list[ray.ObjectRef]:
        """Move every rank's state back onto the device; each ref resolves to its seconds."""
        return [actor.wake_up.remote() for actor in self.actors]

    def async_update_weights(self, engines: list) -> list[ray.ObjectRef]:
        """Push the gathered weights to the dedicated engine replicas (rank 0 sends; all ranks gather)."""
        self._take_turn()
        return [actor.update_weights.remote(engines) for actor in self.actors]

    def async_export_hf(
        self,
        out_dir: str,
        schedule: dict[str, Any] | None,
        run_paths: list[tuple[str, str]] | None = None,
        keep_best: dict[str, Any] | None = None,
    ) -> list[ray.ObjectRef]:
        """Write the trained denoiser as a diffusers pipeline directory at ``out_dir`` (rank 0 writes), checked
        against ``run_paths`` (every directory the run reads or writes) right before it writes; ``schedule`` None
        keeps the source's scheduler; ``keep_best`` marks ``--keep-best``'s export and is written into it."""
        self._take_turn()
        return [actor.export_hf.remote(out_dir, schedule, run_paths, keep_best) for actor in self.actors]

    def async_get_full_state_dict(self) -> list[ray.ObjectRef]:
        """Every rank joins the gather; rank 0's ref holds the unsharded state dict, the others ``{}``."""
        self._take_turn()
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
