"""Where the trainer groups and engine replicas run (``miles.ray.placement_group``, seed ``[DMD2 4/7]``).

``create_training_models`` hands every rank the run's specs (each reads its group's) and reserves
``trainer_resources(len(run.groups), use_gpu, bundle_cpus(args))`` of every bundle; the RolloutManager reserves none.
The first tests build the same specs and fractions the way the driver does, then check what the groups would do
with them: which hooks run, how a DP shard splits into optimizer steps, where each group checkpoints, and that
everything fits one bundle per rank. The others place and start real groups on the session's CPU-only Ray cluster.
"""

import dataclasses
import os

import pytest
import ray

from miles.backends.fsdp_utils import hooks as trainer
from miles.backends.fsdp_utils.loss_hub import dmd2, sft
from miles.driver.arguments import parse_args
from miles.driver.schedule import needs_sleep
from miles.ray import placement_group as placement
from tests.support.trainer import make_args, make_pipeline, run_spec

SFT = "miles.backends.fsdp_utils.loss_hub.sft"
BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "4"]


def _args(loss_type: str, dp: int = 2, *extra: str):
    argv = [*BASE, "--loss-type", loss_type, "--actor-num-gpus-per-node", str(dp), "--rollout-batch-size", "12"]
    if loss_type == "dmd2":
        argv += ["--teacher-load", "/models/teacher", "--dmd2-critic-steps-per-rollout", "3"]
    if loss_type == "custom_loss":
        argv += [
            "--custom-expand-samples-to-train-pairs-path", "miles.ray.data_conversion_hub.sft.expand_samples_to_train_pairs",
            "--custom-prepare-train-batch-path", f"{SFT}.prepare_sft_batch",
            "--custom-loss-function-path", f"{SFT}.sft_loss_formula",
        ]  # fmt: skip
    return parse_args([*argv, *extra])


def _groups(args) -> dict:
    """``{role: GroupSpec}`` in training order, as the driver builds them for ``create_training_models``."""
    return {group.role: group for group in run_spec(args).groups}


# -- without Ray -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("loss_type", ["sft_loss", "custom_loss", "dmd2"])
def test_only_dmd2_adds_a_trainer_and_every_group_fits_one_bundle_per_rank(loss_type, dp):
    args = _args(loss_type, dp)
    groups = _groups(args)
    assert list(groups) == (["critic", "actor"] if loss_type == "dmd2" else ["actor"])
    for use_gpu in (True, False):
        for bundle_cpus in (1, 3):
            gpus, cpus = placement.trainer_resources(len(groups), use_gpu, bundle_cpus)
            # A bundle holds one rank of every group and nothing else (the RolloutManager reserves no CPU).
            assert len(groups) * cpus == pytest.approx(bundle_cpus)
            assert len(groups) * gpus == pytest.approx(1.0 if use_gpu else 0.0)
    # Several groups on one GPU take turns (each sleeps after its train); on the CPU nothing is freed by sleeping.
    assert needs_sleep(len(groups), use_gpu=True) is (loss_type == "dmd2")
    assert needs_sleep(len(groups), use_gpu=False) is False


def test_resource_fractions_fill_a_bundle_exactly():
    assert placement.trainer_resources(num_groups=2, use_gpu=True, cpus=2) == (0.5, 1.0)
    assert placement.trainer_resources(num_groups=1, use_gpu=True, cpus=1) == (1.0, 1.0)
    # Without CUDA the same shares are CPU-only.
    assert placement.trainer_resources(num_groups=2, use_gpu=False, cpus=4) == (0.0, 2.0)


def _node(cpus: float, gpus: float = 0, alive: bool = True) -> dict:
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return {"Alive": alive, "Resources": resources}


def test_threads_per_rank_are_the_bundles_cpus_at_most_omp_num_threads(tmp_path):
    args = make_args(tmp_path / "pipeline", tmp_path, num_cpus_per_rank=4)
    assert placement.rank_threads(args, {}) == 4
    assert placement.rank_threads(args, {"OMP_NUM_THREADS": "2"}) == 2
    assert placement.rank_threads(args, {"OMP_NUM_THREADS": "8"}) == 4  # a cap, never more than the bundle
    for ignored in ("", "0", "-1", "two", "1.5"):
        assert placement.rank_threads(args, {"OMP_NUM_THREADS": ignored}) == 4, ignored


def test_bundle_cpus_count_only_the_gpu_nodes_of_a_cluster_with_gpus(monkeypatch):
    # Mocked ray.nodes(): it stands in for a multi-node GPU cluster (an 8-CPU head without GPUs beside two
    # 192-CPU nodes of 8 GPUs each), which this machine cannot start. Only GPU nodes hold bundles there.
    args = _args("sft_loss", 8, "--actor-num-nodes", "2", "--rollout-batch-size", "16")
    head, gpu_node = _node(8), _node(192, gpus=8)
    monkeypatch.setattr(ray, "nodes", lambda: [head, gpu_node, dict(gpu_node), _node(4, gpus=8, alive=False)])
    assert placement.bundle_cpus(args) == 24  # 192 CPUs / 8 ranks; the base commit gave 8 // 8 = 1
    # A GPU node smaller than the others sets the share.
    monkeypatch.setattr(ray, "nodes", lambda: [head, gpu_node, _node(96, gpus=8)])
    assert placement.bundle_cpus(args) == 12
    # Without GPUs every node may hold CPU bundles, so the smallest node counts.
    monkeypatch.setattr(ray, "nodes", lambda: [_node(16), _node(64)])
    assert placement.bundle_cpus(args) == 2
    monkeypatch.setattr(ray, "nodes", lambda: [head])
    assert placement.bundle_cpus(_args("sft_loss", 12)) == 1  # at least 1


def test_dmd2_critic_trains_first_from_critic_load_at_critic_lr_with_sibling_dirs_and_k_steps():
    args = _args(
        "dmd2", 2, "--critic-load", "/models/critic_init", "--critic-lr", "8e-6", "--lr", "2e-6",
        "--load", "/ckpt/run", "--save", "/ckpt/run", "--micro-batch-size", "2",
    )  # fmt: skip
    critic, actor = _groups(args).values()
    assert (critic.init, critic.optimizer.lr, critic.teacher) == ("/models/critic_init", 8e-6, "/models/teacher")
    assert (actor.init, actor.optimizer.lr, actor.teacher) == ("/models/student", 2e-6, None)
    assert (critic.checkpoint.load, critic.checkpoint.save) == ("/ckpt/run_critic", "/ckpt/run_critic")
    assert (actor.checkpoint.load, actor.checkpoint.save) == ("/ckpt/run", "/ckpt/run")

    # The hooks each group's ranks run: SFT-shaped critic steps and the scoring; the generator loss on the actor.
    critic_hooks, actor_hooks = trainer.check_hooks(critic.hooks), trainer.check_hooks(actor.hooks)
    assert (critic_hooks.prepare, critic_hooks.loss) == (dmd2.prepare_critic_batch, sft.sft_loss_formula)
    assert critic_hooks.train_output is dmd2.predict_teacher_and_critic_x0
    assert (actor_hooks.prepare, actor_hooks.loss) == (dmd2.prepare_generator_batch, dmd2.dmd2_loss_formula)
    assert actor_hooks.train_output is None and actor_hooks.train_input is None

    # Both groups train on the same DP shard (12 pairs / 2 ranks): the critic in K = 3 steps, the actor in one.
    shard = list(range(6))
    critic_windows = trainer.split_windows(shard, critic.steps_per_rollout, critic.micro_batch_size)
    actor_windows = trainer.split_windows(shard, actor.steps_per_rollout, actor.micro_batch_size)
    assert critic_windows == [[[0, 1]], [[2, 3]], [[4, 5]]]
    assert actor_windows == [[[0, 1], [2, 3], [4, 5]]]
    # The LR schedule counts the group's own optimizer steps.
    assert critic.schedule.total_steps == 12 and actor.schedule.total_steps == 4


def test_the_specs_are_frozen_and_building_them_leaves_the_args_untouched():
    import copy

    args = _args("dmd2", 2, "--save", "/ckpt/run", "--save-interval", "2")
    snapshot = copy.deepcopy(vars(args))
    groups = _groups(args)
    with pytest.raises(dataclasses.FrozenInstanceError):
        groups["actor"].init = "/elsewhere"
    assert vars(args) == snapshot and _groups(args) == groups


class _RecordingGroup:
    """Stands in for ``RayTrainGroup`` (no processes): each call appends to ``log``; a ref "resolves" in ``get``."""

    def __init__(self, log: list, run, role: str, *_, **__) -> None:
        self.log, self.run, self.role, self.actors = log, run, role, [f"{role} rank 0", f"{role} rank 1"]

    def async_init(self, load_rollout_id):
        self.log.append(f"{self.role} init starts")
        return ["init"]

    def async_sleep(self):
        self.log.append(f"{self.role} sleep starts")
        return ["sleep"]

    def async_wake_up(self):
        self.log.append(f"{self.role} wake_up starts")
        return ["wake_up"]

    def get(self, refs, method, rollout_id=None):
        self.log.append(f"{self.role} {method} done")
        return [0, 0]  # both ranks start at rollout 0


@pytest.mark.parametrize("use_gpu", [True, False])
def test_groups_initialise_one_after_the_other_and_on_shared_gpus_each_sleeps_before_the_next(use_gpu, monkeypatch):
    """On a GPU the critic and the actor share, two concurrent start-ups would hold both groups' weights at once
    (3ea913a started every group's init, then waited): Ray's groups are recorded, and a GPU cluster is what
    ``use_gpu_bundles`` reports."""
    log, started = [], []
    monkeypatch.setattr(placement, "RayTrainGroup", lambda *a, **k: _RecordingGroup(log, *a, **k))
    monkeypatch.setattr(placement, "use_gpu_bundles", lambda: use_gpu)
    args = _args("dmd2", 2, "--num-cpus-per-rank", "2")
    run = run_spec(args)
    groups = placement.create_training_models(args, run, {"actor": (None, [0, 1])}, started)
    assert list(groups) == ["critic", "actor"] and [g.start_rollout_id for g in groups.values()] == [0, 0]
    assert started == [("actor", f"{role} rank {rank}") for role in ("critic", "actor") for rank in (0, 1)]
    # Colocated on GPUs, the critic sleeps before the actor loads; the actor, whose turn comes first, stays awake.
    critic = ["critic init starts", "critic init done", *(["critic sleep starts", "critic sleep done"] * use_gpu)]
    assert log == [*critic, "actor init starts", "actor init done"]
    if use_gpu:  # an order that does not end with the actor: the last group sleeps too and the actor wakes
        log.clear()
        reversed_run = dataclasses.replace(run, groups=run.groups[::-1])
        placement.create_training_models(args, reversed_run, {"actor": (None, [0, 1])})
        assert log == ["actor init starts", "actor init done", "actor sleep starts", "actor sleep done",
                       "critic init starts", "critic init done", "critic sleep starts", "critic sleep done",
                       "actor wake_up starts", "actor wake_up done"]  # fmt: skip


# -- on the session's Ray cluster (4 CPUs, no GPU) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


def _remove(pgs):
    for pg, _ in pgs.values():
        ray.util.remove_placement_group(pg)


def test_bundle_cpus_share_a_node_among_its_ranks_and_engine_replicas(ray_cluster, pipeline, tmp_path):
    args = make_args(pipeline, tmp_path)
    assert not placement.use_gpu_bundles()
    assert placement.bundle_cpus(args) == 2  # 4 CPUs / 2 trainer ranks
    args.rollout_num_gpus = 1
    assert placement.bundle_cpus(args) == 1  # 4 CPUs / (2 ranks + 1 replica)
    args.num_cpus_per_rank = 3
    assert placement.bundle_cpus(args) == 3
    assert placement.bundle_cpus(make_args(pipeline, tmp_path, actor_num_gpus_per_node=8)) == 1  # at least 1


def test_cpu_bundles_per_rank_and_own_engine_bundles(ray_cluster, pipeline, tmp_path):
    args = make_args(pipeline, tmp_path)
    pgs = placement.create_placement_groups(args)
    try:
        pg, bundles = pgs["actor"]
        assert pg.bundle_specs == [{"CPU": 2}, {"CPU": 2}] and bundles == [0, 1]
        assert "rollout" not in pgs  # the actor ranks generate; the RolloutManager needs no bundle
    finally:
        _remove(pgs)

    args.rollout_num_gpus = 1
    pgs = placement.create_placement_groups(args)
    try:
        rollout_pg, rollout_bundles = pgs["rollout"]
        assert pgs["actor"][0].bundle_specs == [{"CPU": 1}, {"CPU": 1}]
        assert rollout_pg.id != pgs["actor"][0].id and rollout_pg.bundle_specs == [{"CPU": 1}]
        assert rollout_bundles == [0]
    finally:
        _remove(pgs)


def _live_placement_groups() -> set[str]:
    return {pg_id for pg_id, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}


def test_unplaceable_bundles_fail_with_the_flags_to_change_and_leave_nothing_reserved(
    ray_cluster, pipeline, tmp_path, monkeypatch
):
    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 2)
    before = _live_placement_groups()
    args = make_args(pipeline, tmp_path, actor_num_gpus_per_node=8)
    with pytest.raises(RuntimeError, match="could not place 8 bundles .*--actor-num-gpus-per-node"):
        placement.create_placement_groups(args)
    # The trainer bundles fit but the engine's do not: the granted trainer group is handed back too.
    args = make_args(pipeline, tmp_path, rollout_num_gpus=1, num_cpus_per_rank=2)
    with pytest.raises(RuntimeError, match="could not place 1 bundles .* for the rollout engines"):
        placement.create_placement_groups(args)
    # A driver that joined a running cluster must not leave a pending reservation behind.
    assert _live_placement_groups() == before


def test_create_training_models_builds_dmd2_critic_first(ray_cluster, pipeline, tmp_path):
    args = make_args(
        pipeline, tmp_path, "--loss-type", "dmd2", "--teacher-load", str(pipeline), "--critic-lr", "2e-4",
        "--dmd2-critic-steps-per-rollout", "2", "--save", str(tmp_path / "ckpt"), train_only=False,
    )  # fmt: skip
    pgs = placement.create_placement_groups(args)
    started = []
    groups = placement.create_training_models(args, run_spec(args), pgs, started=started)
    try:
        assert list(groups) == ["critic", "actor"]
        assert started == [("actor", handle) for group in groups.values() for handle in group.actors]
        assert [group.start_rollout_id for group in groups.values()] == [0, 0]
        critic, actor = groups["critic"].spec, groups["actor"].spec
        assert (critic.init, critic.optimizer.lr, critic.steps_per_rollout) == (str(pipeline), 2e-4, 2)
        assert critic.checkpoint.save == str(tmp_path / "ckpt") + "_critic"
        assert actor.checkpoint.save == str(tmp_path / "ckpt")
        assert actor.teacher is None and critic.teacher == str(pipeline)
        assert ray.get(groups["critic"].async_sleep_state()) == ["awake", "awake"]
        # Each rank reports its device and what it holds: only the critic group holds the (frozen) teacher.
        critic_rank0, actor_rank0 = (ray.get(group.actors[0].describe.remote()) for group in groups.values())
        assert critic_rank0["frozen_parameters"] == critic_rank0["trainable_parameters"] > 0
        assert actor_rank0["frozen_parameters"] == 0 and actor_rank0["sharded"] is True
        # Each rank runs as many torch threads as its bundle has CPUs (the session's 4 CPUs over 2 ranks), at most
        # the test session's OMP_NUM_THREADS=1.
        assert placement.bundle_cpus(args) == 2 and os.environ["OMP_NUM_THREADS"] == "1"
        assert critic_rank0["threads"] == actor_rank0["threads"] == placement.rank_threads(args) == 1
    finally:
        for group in groups.values():
            group.shutdown()
        _remove(pgs)
