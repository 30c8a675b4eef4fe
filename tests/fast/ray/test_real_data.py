"""The RolloutManager deals a method's side inputs (the DMD2 GAN's real data) one record per generated sample, from
their own seeded cursors that a checkpoint restores."""

import json

import torch

from miles.driver.specs import data_spec
from miles.ray.rollout import RolloutManager
from miles.utils.misc import make_generator
from miles.utils.types import SideInput
from tests.support.trainer import make_args, make_pipeline


def _setup(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(6)))
    real = tmp_path / "real" / "train.jsonl"
    real.parent.mkdir()
    real.write_text("".join(json.dumps({"prompt": f"real {i}", "image": [[i] * 8] * 8}) + "\n" for i in range(10)))
    args = make_args(pipeline, tmp_path, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", train_only=False)
    return args, [SideInput("real", str(real), "--dmd2-gan-real-data")]


def test_each_shard_gets_one_real_record_per_sample_from_its_own_cursor(tmp_path):
    args, side = _setup(tmp_path)
    manager = RolloutManager(data_spec(args), 2, side)
    shards = manager.shards(0)
    assert [len(shard) for shard in shards] == [4, 4]
    assert all(len(shard.side_data["real"].records) == len(shard) for shard in shards)
    assert all(shard.side_data["real"].base_dir == str(tmp_path / "real") for shard in shards)
    first = [record["prompt"] for shard in shards for record in shard.side_data["real"].records]
    # The first 8 of the 10 real records in the order of their own shuffle ("real_shuffle", seed, epoch 0).
    order = torch.randperm(10, generator=make_generator("real_shuffle", args.rollout_seed, 0)).tolist()
    assert first == [f"real {i}" for i in order[:8]]
    # The prompts' order is the prompt source's alone: the same with or without real data.
    plain = RolloutManager(data_spec(args), 2).shards(0)
    assert [shard.prompts for shard in plain] == [shard.prompts for shard in shards]


def test_the_real_data_cursor_is_restored(tmp_path):
    args, side = _setup(tmp_path)
    manager = RolloutManager(data_spec(args), 2, side)
    manager.shards(0)
    state = manager.state_dict()
    assert set(state) == {"data_source", "side_sources"} and set(state["side_sources"]) == {"real"}
    next_shards = manager.shards(1)
    expected = [shard.side_data["real"].records for shard in next_shards]
    resumed = RolloutManager(data_spec(args), 2, side)
    resumed.load_state_dict(state)
    assert [shard.side_data["real"].records for shard in resumed.shards(1)] == expected
    # A phase-1 checkpoint has no real-data cursor: phase 2's starts at the first record of its epoch-0 order, as a
    # fresh run's does, while the prompts continue from their cursor.
    phase2 = RolloutManager(data_spec(args), 2, side)
    phase2.load_state_dict({"data_source": state["data_source"]})
    fresh = RolloutManager(data_spec(args), 2, side).shards(0)
    continued = phase2.shards(1)
    assert [s.side_data["real"].records for s in continued] == [s.side_data["real"].records for s in fresh]
    assert [s.prompts for s in continued] == [s.prompts for s in next_shards]
