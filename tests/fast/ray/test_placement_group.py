"""Placement on a CPU-only Ray cluster: bundles, resource fractions, and the trainer groups of a run."""

import sys
from pathlib import Path

import pytest
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_support import make_args, make_pipeline, ray_session  # noqa: E402

from miles.ray import placement_group as placement  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    with ray_session(num_cpus=4):
        yield


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


def test_resource_fractions_fill_a_bundle_exactly():
    assert placement.TRAINER_BUNDLE_SHARE + placement.ENGINE_BUNDLE_SHARE == 1.0
    gpus, cpus = placement.trainer_resources(num_groups=2, colocated_engine=True, use_gpu=True)
    engine_gpus, engine_cpus = placement.rollout_resources(colocated_engine=True, use_gpu=True)
    assert (gpus, cpus, engine_gpus, engine_cpus) == (0.4, 0.4, 0.2, 0.2)
    assert 2 * gpus + engine_gpus == pytest.approx(1.0)
    assert placement.trainer_resources(num_groups=1, colocated_engine=False, use_gpu=True) == (1.0, 1.0)
    assert placement.rollout_resources(colocated_engine=False, use_gpu=False) == (0.0, 1.0)
    # Without CUDA the same shares are CPU-only.
    assert placement.trainer_resources(num_groups=2, colocated_engine=True, use_gpu=False) == (0.0, 0.4)


def test_cpu_bundles_per_rank_and_colocated_or_own_engine(ray_cluster, pipeline, tmp_path):
    args = make_args(pipeline, tmp_path)
    assert not placement.use_gpu_bundles()
    pgs = placement.create_placement_groups(args)
    pg, bundles = pgs["actor"]
    assert pg.bundle_specs == [{"CPU": 1}, {"CPU": 1}] and bundles == [0, 1]
    assert pgs["rollout"] == (pg, [0])  # colocated by default
    ray.util.remove_placement_group(pg)

    args.rollout_num_gpus = 1
    pgs = placement.create_placement_groups(args)
    rollout_pg, rollout_bundles = pgs["rollout"]
    assert rollout_pg.id != pgs["actor"][0].id and rollout_pg.bundle_specs == [{"CPU": 1}] and rollout_bundles == [0]
    ray.util.remove_placement_group(rollout_pg)
    ray.util.remove_placement_group(pgs["actor"][0])


def test_unplaceable_bundles_fail_with_the_flags_to_change(ray_cluster, pipeline, tmp_path, monkeypatch):
    args = make_args(pipeline, tmp_path, actor_num_gpus_per_node=8)
    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 2)
    with pytest.raises(RuntimeError, match="could not place 8 bundles .*--actor-num-gpus-per-node"):
        placement.create_placement_groups(args)


def test_create_training_models_builds_dmd2_critic_first(ray_cluster, pipeline, tmp_path):
    args = make_args(
        pipeline, tmp_path, "--loss-type", "dmd2", "--teacher-load", str(pipeline), "--critic-lr", "2e-4",
        "--dmd2-critic-steps-per-rollout", "2", "--save", str(tmp_path / "ckpt"), train_only=False,
    )  # fmt: skip
    pgs = placement.create_placement_groups(args)
    groups = placement.create_training_models(args, pgs)
    try:
        assert list(groups) == ["critic", "actor"]
        assert [group.start_rollout_id for group in groups.values()] == [0, 0]
        critic, actor = groups["critic"].args, groups["actor"].args
        assert (critic.hf_checkpoint, critic.lr, critic.num_steps_per_rollout) == (str(pipeline), 2e-4, 2)
        assert critic.save == str(tmp_path / "ckpt") + "_critic" and actor.save == str(tmp_path / "ckpt")
        assert actor.teacher_load is None and critic.teacher_load == str(pipeline)
        assert ray.get(groups["critic"].async_sleep_state()) == ["awake", "awake"]
    finally:
        for group in groups.values():
            group.shutdown()
        ray.util.remove_placement_group(pgs["actor"][0])
