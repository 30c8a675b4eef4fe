"""The RolloutManager in a local Ray session: one Box per DP rank with the right pairs, exact splits, weights, eval."""

import json
import os
import tempfile

import pytest
import torch

from miles.models.digits import init_digits_pipeline
from miles.ray.rollout import RayRolloutManager, RolloutManager, split_for_dp
from miles.rollout.engine import initial_noise
from miles.rollout.step_strategy_hub import stop_at_random_step
from miles.utils.arguments import parse_args
from miles.utils.types import Box, TrainPair

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    pipeline = init_digits_pipeline(root / "pipe", seed=0, num_layers=1, attention_head_dim=8)
    records = [
        {"prompt": f"a handwritten digit {d}", "label": d, "image": [[(d * 16 + x + y) % 256 for x in range(8)] for y in range(8)]}
        for d in range(5)
    ]  # fmt: skip
    data = root / "digits.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    return pipeline, data, records


def dmd2_args(pipeline, data):
    return parse_args(
        ["--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline), "--prompt-data", str(data)]
        + ["--loss-type", "dmd2", "--num-rollout", "2", "--rollout-batch-size", "3", "--n-samples-per-prompt", "2"]
        + ["--actor-num-gpus-per-node", "2", "--dmd2-critic-steps-per-rollout", "1"]
        + ["--dmd2-teacher-guidance-scale", "4.0", "--rollout-seed", "11"]
    )


def test_generate_returns_one_box_per_dp_rank_with_the_dmd2_pairs(ray_session, workdir):
    ray = ray_session
    pipeline, data, records = workdir
    args = dmd2_args(pipeline, data)
    manager = RayRolloutManager.remote(args, 2)
    boxes = ray.get(manager.generate.remote(0))
    assert len(boxes) == 2 and all(isinstance(box, Box) for box in boxes)
    shards = [ray.get(box.inner) for box in boxes]
    assert [len(shard) for shard in shards] == [3, 3]
    pairs = shards[0] + shards[1]
    assert all(isinstance(pair, TrainPair) for pair in pairs)
    assert [pair.sample_index for pair in pairs] == list(range(6))
    assert [pair.step_index for pair in pairs] == stop_at_random_step(args, 0, list(range(6)), 4)
    sigmas = [1.0, 0.9, 0.75, 0.5]
    for pair in pairs:
        assert pair.sigma == pytest.approx(sigmas[pair.step_index]) and pair.timestep == pytest.approx(
            pair.sigma * 1000
        )
        assert pair.latent.shape == pair.x0.shape == (1, 8, 8)
        assert set(pair.neg_cond) == {"encoder_hidden_states", "pooled_projections"}  # teacher CFG 4 > 1
        if pair.step_index == 0:
            assert torch.equal(pair.latent, initial_noise((1, 8, 8), 11, 0, [pair.sample_index])[0])
    # samples 2j and 2j+1 come from prompt j: same cond, different noise
    for j in range(3):
        a, b = pairs[2 * j], pairs[2 * j + 1]
        assert torch.equal(a.pos_cond["pooled_projections"], b.pos_cond["pooled_projections"])
    assert not torch.equal(pairs[0].pos_cond["pooled_projections"], pairs[2].pos_cond["pooled_projections"])
    assert ray.get(manager.state_dict.remote()) == {"data_source": {"epoch": 0, "cursor": 3}}

    # evaluation, then new student weights through the object store change the samples
    images = ray.get(manager.evaluate.remote(["a handwritten digit 1"] * 2, [0, 1]))
    assert images.shape == (2, 8, 8, 1) and images.dtype == torch.uint8
    again = ray.get(manager.evaluate.remote(["a handwritten digit 1"] * 2, [0, 1]))
    assert torch.equal(again, images)
    from miles.models import get_model_family

    weights = get_model_family(pipeline).load_denoiser(pipeline).state_dict()
    ray.get(manager.update_weights.remote(ray.put({key: -value for key, value in weights.items()})))
    updated = ray.get(manager.evaluate.remote(["a handwritten digit 1"] * 2, [0, 1], num_steps=2))
    assert not torch.equal(updated, images)

    # the cursor survives a restart of the manager
    ray.get(manager.load_state_dict.remote({"data_source": {"epoch": 1, "cursor": 4}}))
    assert ray.get(manager.state_dict.remote()) == {"data_source": {"epoch": 1, "cursor": 4}}
    ray.kill(manager)


def test_uneven_split_raises_naming_the_flags(ray_session, workdir):
    pipeline, data, _ = workdir
    manager = RolloutManager(dmd2_args(pipeline, data), dp_size=4)
    with pytest.raises(ValueError, match=r"6 train pairs.*DP size 4.*--rollout-batch-size x --n-samples-per-prompt"):
        manager.generate(0)
    with pytest.raises(ValueError, match="DP size 4"):
        split_for_dp(list(range(6)), 4)
    assert split_for_dp(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]


def test_a_converter_that_breaks_the_dp_split_is_named(ray_session, workdir):
    pipeline, data, _ = workdir
    manager = RolloutManager(dmd2_args(pipeline, data), dp_size=2)
    converter = manager.converter
    manager.converter = lambda args, samples: converter(args, samples)[:-1]
    message = r"--custom-expand-samples-to-train-pairs-path .* returned 5 train pairs for 6 samples in rollout 0"
    with pytest.raises(ValueError, match=message + ".*must return a multiple of the DP size"):
        manager.generate(0)


def test_train_only_sft_pairs_carry_the_data_images(ray_session, workdir):
    ray = ray_session
    pipeline, data, records = workdir
    args = parse_args(
        ["--hf-checkpoint", str(pipeline), "--prompt-data", str(data), "--train-only", "--rollout-shuffle"]
        + ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
    )
    manager = RolloutManager(args, dp_size=1)
    assert manager._engine is None  # no sampler is built for data rollouts
    (box,) = manager.generate(0)
    pairs = ray.get(box.inner)
    order = manager.data_source._epoch_order(0)
    for pair in pairs:
        record = records[order[pair.sample_index // 2]]
        image = torch.tensor(record["image"], dtype=torch.float32)
        torch.testing.assert_close(pair.x0, (image / 255 * 2 - 1)[None])
        assert pair.latent is None and pair.neg_cond == {}
        expected = manager.family.encode_prompts(manager.encoder, [record["prompt"]])
        assert torch.equal(pair.pos_cond["encoder_hidden_states"], expected["encoder_hidden_states"][0])
    samples = manager.generate_samples(1)
    assert samples[0].metadata == {"label": records[order[2]]["label"]}
