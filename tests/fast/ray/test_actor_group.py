"""RayTrainGroup: two colocated groups of 2 CPU ranks, the rank pairing of external_data, and the eval split."""

import dataclasses

import pytest
import ray

from miles.models import get_model_family
from miles.ray.actor_group import RayTrainGroup, split_shard
from miles.ray.placement_group import bundle_cpus, create_placement_groups, trainer_resources
from miles.utils.types import Box, PromptShard, SideRecords, TrainResult
from tests.support.trainer import digits_pairs, make_args, make_pipeline, run_spec

WORLD = 2


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


def _shutdown(groups):
    for group in groups:
        group.shutdown()


def test_each_rank_gets_same_rank_outputs_of_earlier_groups(ray_cluster, pipeline, tmp_path):
    args = make_args(pipeline, tmp_path, custom_train_output_function_path="tests.support.trainer.echo_output")
    pgs = create_placement_groups(args)
    gpus, cpus = trainer_resources(num_groups=2, use_gpu=False, cpus=bundle_cpus(args))
    run = run_spec(args)
    # Two groups of the same spec under two roles: the critic's outputs reach the actor's ranks.
    run = dataclasses.replace(run, groups=(dataclasses.replace(run.group("actor"), role="critic"), *run.groups))
    groups = [
        RayTrainGroup(run, role, 1, WORLD, pgs["actor"], num_gpus_per_actor=gpus, num_cpus_per_actor=cpus)
        for role in ("critic", "actor")
    ]
    try:
        ray.get([ref for group in groups for ref in group.async_init()])
        family = get_model_family(pipeline)
        for rollout_id in (0, 1):
            pairs = digits_pairs(family, rollout_id, 8)
            for i, pair in enumerate(pairs):
                pair.sample_index = 100 * rollout_id + i
            refs = [Box(ray.put(pairs[:4])), Box(ray.put(pairs[4:]))]
            first = ray.get(groups[0].async_train(rollout_id, refs))
            assert all(isinstance(result, TrainResult) and isinstance(result.output, Box) for result in first)
            # Per-step metrics, averaged over the ranks, come back once: from rank 0.
            assert [len(result.metrics) for result in first] == [1, 0]
            assert "train/critic-loss" in first[0].metrics[0] and first[1].perf == {}
            outputs = [result.output for result in first]
            second = ray.get(groups[1].async_train(rollout_id, refs, external_data={"critic": outputs}))
            assert "train/loss" in second[0].metrics[0]

            first_out = [ray.get(result.output.inner) for result in first]
            second_out = [ray.get(result.output.inner) for result in second]
            for rank in range(WORLD):
                expected_indices = [100 * rollout_id + rank * 4 + i for i in range(4)]
                assert first_out[rank] == {
                    "rollout_id": rollout_id,
                    "dp_rank": rank,
                    "sample_indices": expected_indices,
                    "external": {},
                }
                assert second_out[rank]["external"] == {"critic": first_out[rank]}
                assert second_out[rank]["sample_indices"] == expected_indices

        # A method's probe (an evaluation's), dispatched once by the group: put, call, get, in rank order.
        probes = groups[0].run_train_output("probe", [pairs[:4], pairs[4:]])
        assert [probe["sample_indices"] for probe in probes] == [
            [100 + i for i in range(4)],
            [104 + i for i in range(4)],
        ]
        assert [probe["rollout_id"] for probe in probes] == ["probe", "probe"]
        with pytest.raises(ValueError, match="actor group has 2 ranks but got 1 outputs of group 'critic'"):
            groups[1].async_train(2, refs, external_data={"critic": outputs[:1]})
        with pytest.raises(ValueError, match="critic group has 2 ranks but got 1 train-pair shards"):
            groups[0].async_train(2, refs[:1])
        with pytest.raises(ValueError, match="actor group has 2 DP ranks but got 3 prompt shards"):
            groups[1].async_generate(2, refs + refs[:1])
    finally:
        _shutdown(groups)
        ray.util.remove_placement_group(pgs["actor"][0])


def test_split_shard_pads_with_the_last_sample_so_every_rank_runs_the_same_forwards():
    shard = PromptShard("eval", [0, 1, 2, 3, 4], [f"p{i}" for i in range(5)], [{"i": i} for i in range(5)], "/data")
    parts, pad = split_shard(shard, 2)
    assert pad == 1
    assert [part.sample_indices for part in parts] == [[0, 1, 2], [3, 4, 4]]
    assert [part.prompts for part in parts] == [["p0", "p1", "p2"], ["p3", "p4", "p4"]]
    assert all(part.rollout_id == "eval" and part.base_dir == "/data" for part in parts)
    parts, pad = split_shard(shard, 5)
    assert pad == 0 and [len(part) for part in parts] == [1] * 5
    # A side input's records (the DMD2 GAN's reals) are split and padded with their samples.
    shard.side_data = {"real": SideRecords([{"r": i} for i in range(5)], "/reals")}
    parts, pad = split_shard(shard, 2)
    assert [part.side_data["real"].records for part in parts] == [
        [{"r": 0}, {"r": 1}, {"r": 2}],
        [{"r": 3}, {"r": 4}, {"r": 4}],
    ]
    assert all(part.side_data["real"].base_dir == "/reals" for part in parts)
