"""``--rollout-num-gpus N``: dedicated engine replicas (``EngineGroup`` of ``RolloutEngineWorker``s) on their own
bundles generate the DP shards, evaluate, and take new student weights."""

import pytest
import ray
import torch

from miles.driver.specs import data_spec
from miles.eval.digits.data import write_digits_jsonl
from miles.models import get_model_family
from miles.ray.engine_group import EngineGroup
from miles.ray.rollout import RolloutManager
from miles.rollout.data_source import load_record_latent
from miles.utils.types import Box, RolloutResult, SideInput
from tests.support.rollout import make_engine, prompt_shard
from tests.support.trainer import make_args, make_pipeline, run_spec


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


def test_one_replica_generates_every_dp_shard_evaluates_and_loads_weights(ray_cluster, pipeline, tmp_path):
    data = write_digits_jsonl(tmp_path / "data", prompt_repeats=1)["prompts"]
    # SFT on the student's own full trajectories: each pair's x0 is a finished sample.
    args = make_args(pipeline, tmp_path, train_only=False, prompt_data=data, rollout_num_gpus=1, rollout_batch_size=4)
    pg = ray.util.placement_group([{"CPU": 1}])
    ray.get(pg.ready())
    engines = EngineGroup(run_spec(args), (pg, [0]), num_gpus=0.0, num_cpus=1, num_threads=1)
    try:
        shards = RolloutManager(data_spec(args), dp_size=2).shards(0)
        boxes = [Box(ray.put(shard)) for shard in shards]
        (run,) = ray.get(engines.async_generate(0, boxes))  # one replica: the shards of both DP ranks
        assert len(run) == 2 and all(isinstance(result, RolloutResult) for result in run)
        assert [result.num_pairs for result in run] == [2, 2]
        assert "perf/engine-generate_time" in run[0].perf
        pairs = [ray.get(result.pairs.inner) for result in run]
        assert [[pair.sample_index for pair in rank] for rank in pairs] == [[0, 1], [2, 3]]
        # Exactly what an in-process engine on the same weights draws for those shards.
        local = make_engine(args, pipeline)
        for shard, rank_pairs in zip(shards, pairs):
            for sample, pair in zip(local.generate(shard), rank_pairs):
                assert torch.equal(pair.x0, sample.trajectory.final)

        # Evaluation, then new student weights through the object store change the samples.
        eval_shard = prompt_shard("eval", ["a handwritten digit 1"] * 3)
        images = engines.evaluate(eval_shard)
        assert images.shape == (3, 8, 8, 1) and images.dtype == torch.uint8
        assert torch.equal(engines.evaluate(eval_shard), images)
        weights = get_model_family(pipeline).load_denoiser(pipeline).state_dict()
        (engine,) = engines.engines
        ray.get(engine.load_weights.remote(ray.put({key: -value for key, value in weights.items()})))
        assert not torch.equal(engines.evaluate(eval_shard), images)
        with pytest.raises(ray.exceptions.RayTaskError, match="does not match the engine's denoiser"):
            ray.get(engine.load_weights.remote({"nope": torch.zeros(1)}))
    finally:
        for engine in engines.engines:
            ray.kill(engine)
        ray.util.remove_placement_group(pg)


def test_a_replica_trains_on_the_data_and_carries_the_side_inputs(ray_cluster, pipeline, tmp_path):
    """The replicas generate with the actor ranks' ``RolloutGenerator``: with ``--train-only`` each pair is its
    record's data (it once sampled the student instead), and each pair carries its dealt side-input record as a data
    sample (the DMD2 GAN's real data, once missing on the replicas, which failed the first critic step)."""
    train = write_digits_jsonl(tmp_path / "data", prompt_repeats=1)["train"]
    args = make_args(pipeline, tmp_path, prompt_data=train, rollout_num_gpus=1, rollout_batch_size=4)
    pg = ray.util.placement_group([{"CPU": 1}])
    ray.get(pg.ready())
    engines = EngineGroup(run_spec(args), (pg, [0]), num_gpus=0.0, num_cpus=1, num_threads=1)
    try:
        side = [SideInput("real", train, "--dmd2-gan-real-data")]
        shards = RolloutManager(data_spec(args), 2, side).shards(0)
        (run,) = ray.get(engines.async_generate(0, [Box(ray.put(shard)) for shard in shards]))
        pairs = [ray.get(result.pairs.inner) for result in run]
    finally:
        for engine in engines.engines:
            ray.kill(engine)
        ray.util.remove_placement_group(pg)
    family = get_model_family(pipeline)
    base = str(tmp_path / "data")
    for shard, rank_pairs in zip(shards, pairs):
        assert [pair.sample_index for pair in rank_pairs] == shard.sample_indices
        for pair, record, real in zip(rank_pairs, shard.records, shard.side_data["real"].records):
            assert torch.equal(pair.x0, load_record_latent(args, family, record, base))
            assert pair.extras["real"].prompt == real["prompt"]
            assert torch.equal(pair.extras["real"].x0, load_record_latent(args, family, real, base))
            assert set(pair.extras["real"].env.pos_cond) == {"encoder_hidden_states", "pooled_projections"}
