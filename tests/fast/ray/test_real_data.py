"""The RolloutManager deals real data (the DMD2 GAN's) one record per generated sample, from its own seeded cursor
that a checkpoint restores."""

import json

from miles.ray.rollout import RolloutManager
from tests.support.trainer import make_args, make_pipeline


def _setup(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(6)))
    real = tmp_path / "real" / "train.jsonl"
    real.parent.mkdir()
    real.write_text("".join(json.dumps({"prompt": f"real {i}", "image": [[i] * 8] * 8}) + "\n" for i in range(10)))
    args = make_args(pipeline, tmp_path, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", train_only=False)
    return args, real


def test_each_shard_gets_one_real_record_per_sample_from_its_own_cursor(tmp_path):
    args, real = _setup(tmp_path)
    manager = RolloutManager(args, 2, real_data=str(real))
    shards = manager.shards(0)
    assert [len(shard) for shard in shards] == [4, 4]
    assert all(len(shard.real_records) == len(shard) for shard in shards)
    assert all(shard.real_base_dir == str(real.parent) for shard in shards)
    first = [record["prompt"] for shard in shards for record in shard.real_records]
    assert len(set(first)) == 8  # 8 distinct real records of the 10, shuffled by their own seed
    # The prompts' order is the prompt source's alone: the same with or without real data.
    plain = RolloutManager(args, 2).shards(0)
    assert [shard.prompts for shard in plain] == [shard.prompts for shard in shards]


def test_the_real_data_cursor_is_restored(tmp_path):
    args, real = _setup(tmp_path)
    manager = RolloutManager(args, 2, real_data=str(real))
    manager.shards(0)
    state = manager.state_dict()
    assert set(state) == {"data_source", "real_source"}
    expected = [shard.real_records for shard in manager.shards(1)]
    resumed = RolloutManager(args, 2, real_data=str(real))
    resumed.load_state_dict(state)
    assert [shard.real_records for shard in resumed.shards(1)] == expected
    try:
        RolloutManager(args, 2, real_data=str(real)).load_state_dict({"data_source": state["data_source"]})
    except ValueError as exc:
        assert "without real data" in str(exc)
    else:
        raise AssertionError("a checkpoint without the real-data cursor was accepted")
