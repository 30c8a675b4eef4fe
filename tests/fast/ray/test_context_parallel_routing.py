"""``RayTrainGroup`` with ``--context-parallel-size``: one prompt shard per DP rank reaches every rank of its CP group
(consecutive ranks), and the evaluation's and the probes' results count each CP group once, in the shard's order.

The ranks are small Ray actors that echo what they received (real Ray, no model): the routing is the group's, the
ranks' work is tested in tests/fast/backends/fsdp_utils/test_context_parallel.py."""

from types import SimpleNamespace

import ray
import torch

from miles.ray.actor_group import RayTrainGroup, per_rank
from miles.rollout.data_source import make_prompt_shard
from miles.utils.types import Box

WORLD, CP = 4, 2  # DP 2 × CP 2


@ray.remote(num_cpus=0)
class EchoRank:
    """A rank that answers with its rank and what it was given."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def generate(self, rollout_id, box):
        shard = ray.get(box.inner)
        return SimpleNamespace(pairs=Box(ray.put((self.rank, list(shard.sample_indices)))), perf={})

    def evaluate(self, shard):
        # one "image" per sample: its index, and the rank that drew it in the second pixel
        return torch.tensor([[index, self.rank] for index in shard.sample_indices], dtype=torch.uint8)[
            :, None, :, None
        ]

    def train_output(self, rollout_id, box):
        return Box(ray.put((self.rank, ray.get(box.inner))))


def _group() -> RayTrainGroup:
    group = object.__new__(RayTrainGroup)
    group.role, group.world_size, group.cp, group.dp_size, group.turns = "actor", WORLD, CP, WORLD // CP, None
    group.actors = [EchoRank.remote(rank) for rank in range(WORLD)]
    return group


def _shard(count: int):
    return make_prompt_shard("eval", [{"text": f"p{i}"} for i in range(count)], input_key="text")


def test_a_cp_group_shares_its_dp_ranks_shard_and_counts_once(ray_cluster):
    assert per_rank(["a", "b"], 2) == ["a", "a", "b", "b"]
    group = _group()
    # the rollout: one shard per DP rank; ranks 0, 1 get shard 0 and ranks 2, 3 shard 1
    shards = [Box(ray.put(part)) for part in (_shard(2), _shard(3))]
    results = ray.get(group.async_generate(0, shards))
    assert [ray.get(result.pairs.inner) for result in results] == [(0, [0, 1]), (1, [0, 1]), (2, [0, 1, 2])] + [
        (3, [0, 1, 2])
    ]
    # an evaluation of 5 samples: DP rank 0 draws 0-2, DP rank 1 draws 3, 4 (and a pad); each CP group once
    images = group.evaluate(_shard(5))
    assert images[:, 0, 0, 0].tolist() == [0, 1, 2, 3, 4]
    assert images[:, 0, 1, 0].tolist() == [0, 0, 0, 2, 2]  # the CP groups' first ranks
    # the debug grid's probes: one box per DP rank out, one output per DP rank back
    boxes, pad = group.generate_shard("debug", _shard(3))
    assert pad == 1 and [ray.get(box.inner) for box in boxes] == [(0, [0, 1]), (2, [2, 2])]
    outputs = group.run_train_output("debug", [["x"], ["y"]])
    assert outputs == [(0, ["x"]), (2, ["y"])]
    for actor in group.actors:
        ray.kill(actor)
