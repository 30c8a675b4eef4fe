"""RayTrainGroup: two colocated groups of 2 CPU ranks and the rank pairing of external_data."""

import sys
from pathlib import Path

import pytest
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_support import digits_pairs, make_args, make_pipeline, ray_session  # noqa: E402

from miles.models import get_model_family  # noqa: E402
from miles.ray.actor_group import RayTrainGroup  # noqa: E402
from miles.ray.placement_group import create_placement_groups, trainer_resources  # noqa: E402
from miles.utils.types import Box  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def ray_cluster():
    with ray_session(num_cpus=4):
        yield


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


def _shutdown(groups):
    for group in groups:
        group.shutdown()


def test_each_rank_gets_same_rank_outputs_of_earlier_groups(ray_cluster, pipeline, tmp_path):
    args = make_args(pipeline, tmp_path, custom_train_output_function_path="trainer_support.echo_output")
    pgs = create_placement_groups(args)
    gpus, cpus = trainer_resources(num_groups=2, colocated_engine=True, use_gpu=False)
    groups = [
        RayTrainGroup(args, role, 1, WORLD, pgs["actor"], num_gpus_per_actor=gpus, num_cpus_per_actor=cpus)
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
            assert all(isinstance(box, Box) for box in first)
            second = ray.get(groups[1].async_train(rollout_id, refs, external_data={"critic": first}))

            first_out = [ray.get(box.inner) for box in first]
            second_out = [ray.get(box.inner) for box in second]
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

        with pytest.raises(ValueError, match="actor group has 2 ranks but group 'critic' handed over 1 outputs"):
            groups[1].async_train(2, refs, external_data={"critic": first[:1]})
        with pytest.raises(ValueError, match="critic group has 2 ranks but the rollout has 1 shards"):
            groups[0].async_train(2, refs[:1])
    finally:
        _shutdown(groups)
        ray.util.remove_placement_group(pgs["actor"][0])
