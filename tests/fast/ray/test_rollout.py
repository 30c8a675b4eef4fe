"""The RolloutManager: the rollout's prompts, one PromptShard per DP rank (contiguous, equal, a prompt's samples kept
together), its resumable cursor, and exact splits. It samples nothing: the actor ranks generate their shards
(tests/fast/backends/fsdp_utils/test_actor.py)."""

import json

import pytest

from miles.driver.arguments import parse_args
from miles.driver.specs import data_spec
from miles.ray.rollout import RayRolloutManager, RolloutManager
from miles.utils.types import Box, PromptShard


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    records = [{"prompt": f"a handwritten digit {d}", "label": d} for d in range(5)]
    path = root / "digits.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path, records


def dmd2_args(data, *extra):
    # parse_args opens no file: the pipelines need not exist for the manager, which only reads --prompt-data.
    return parse_args(
        ["--hf-checkpoint", "/models/student", "--teacher-load", "/models/teacher", "--prompt-data", str(data)]
        + ["--loss-type", "dmd2", "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]
        + ["--actor-num-gpus-per-node", "2", "--dmd2-critic-steps-per-rollout", "1", "--rollout-seed", "11", *extra]
    )


def test_generate_returns_one_box_per_dp_rank_with_its_prompt_shard(ray_cluster, data):
    ray = ray_cluster
    path, records = data
    args = dmd2_args(path, "--no-rollout-shuffle")
    manager = RayRolloutManager.remote(data_spec(args), 2)
    boxes = ray.get(manager.generate.remote(0))
    assert len(boxes) == 2 and all(isinstance(box, Box) for box in boxes)
    shards = [ray.get(box.inner) for box in boxes]
    assert all(isinstance(shard, PromptShard) for shard in shards)
    # 4 prompts x 2 samples over 2 ranks: rank r holds prompts 2r, 2r + 1 and both samples of each, in order.
    assert [shard.sample_indices for shard in shards] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shards[0].prompts == ["a handwritten digit 0"] * 2 + ["a handwritten digit 1"] * 2
    assert shards[1].records == [records[2], records[2], records[3], records[3]]
    assert all(shard.rollout_id == 0 and shard.base_dir == str(path.parent) for shard in shards)
    assert ray.get(manager.state_dict.remote()) == {"data_source": {"epoch": 0, "cursor": 4}}

    # The next rollout continues the cursor into the next epoch; indices restart at 0 per rollout.
    shards = [ray.get(box.inner) for box in ray.get(manager.generate.remote(1))]
    assert [shard.sample_indices for shard in shards] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [shard.prompts[0] for shard in shards] == ["a handwritten digit 4", "a handwritten digit 1"]
    assert ray.get(manager.state_dict.remote()) == {"data_source": {"epoch": 1, "cursor": 3}}

    # the cursor survives a restart of the manager
    ray.get(manager.load_state_dict.remote({"data_source": {"epoch": 1, "cursor": 4}}))
    assert ray.get(manager.state_dict.remote()) == {"data_source": {"epoch": 1, "cursor": 4}}
    ray.kill(manager)


def test_shards_are_seeded_by_the_rollout_seed_and_split_exactly(data):
    path, records = data
    shuffled = RolloutManager(data_spec(dmd2_args(path)), dp_size=2)
    order = shuffled.data_source._epoch_order(0)
    shards = shuffled.shards(0)
    assert [shard.records[0]["label"] for shard in shards] == [order[0], order[2]]
    again = RolloutManager(data_spec(dmd2_args(path)), dp_size=2).shards(0)
    assert [shard.prompts for shard in again] == [shard.prompts for shard in shards]
    # One shard at DP 1 holds the same samples in the same order as the shards of DP 2.
    (whole,) = RolloutManager(data_spec(dmd2_args(path)), dp_size=1).shards(0)
    assert whole.sample_indices == shards[0].sample_indices + shards[1].sample_indices
    assert whole.prompts == shards[0].prompts + shards[1].prompts


def test_uneven_split_raises_naming_the_flags(data):
    path, _ = data
    manager = RolloutManager(data_spec(dmd2_args(path)), dp_size=3)
    with pytest.raises(ValueError, match="4 prompts do not split evenly over 3 DP ranks: make --rollout-batch-size"):
        manager.shards(0)
