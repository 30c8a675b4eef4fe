"""The trainer groups a run places, seen through the placement helpers (seed ``[DMD2 4/7]``); no Ray session.

``create_training_models`` gives each group ``compute_trainer_args(args, config)`` and reserves
``trainer_resources(len(configs), engine_colocated(args), use_gpu)`` of every bundle; the rollout manager takes
``rollout_resources(...)`` of bundle 0. These tests build the same group args and fractions the way it does, then
check what the groups would do with them: which hooks load, how a DP shard splits into optimizer steps, where each
group checkpoints, and that everything fits one bundle per rank.
"""

import copy
import sys
from pathlib import Path

import pytest

# train_diffusion.py (the driver with --dry-run's log_plan) is a script at the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import train_diffusion  # noqa: E402
from miles.backends.fsdp_utils import actor as trainer  # noqa: E402
from miles.backends.fsdp_utils.loss_hub import dmd2, sft  # noqa: E402
from miles.ray.placement_group import (  # noqa: E402
    ENGINE_BUNDLE_SHARE,
    TRAINER_BUNDLE_SHARE,
    engine_colocated,
    rollout_resources,
    trainer_resources,
)
from miles.utils.arguments import parse_args  # noqa: E402
from miles.utils.trainer_config import compute_trainer_args, compute_trainer_configs  # noqa: E402

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


def _group_args(args) -> dict:
    """``{role: group args}`` in training order, built as ``create_training_models`` builds them."""
    return {config.role: compute_trainer_args(args, config) for config in compute_trainer_configs(args)}


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("loss_type", ["sft_loss", "custom_loss", "dmd2"])
def test_only_dmd2_adds_a_trainer_and_every_group_fits_one_bundle_per_rank(loss_type, dp):
    args = _args(loss_type, dp)
    groups = _group_args(args)
    assert list(groups) == (["critic", "actor"] if loss_type == "dmd2" else ["actor"])
    assert engine_colocated(args)  # --rollout-num-gpus 0: the engine shares bundle 0
    for use_gpu in (True, False):
        gpus, cpus = trainer_resources(len(groups), engine_colocated(args), use_gpu)
        engine_gpus, engine_cpus = rollout_resources(engine_colocated(args), use_gpu)
        # Bundle 0 holds one rank of every group plus the rollout manager: exactly the whole bundle.
        assert len(groups) * cpus + engine_cpus == pytest.approx(1.0)
        assert cpus == pytest.approx(TRAINER_BUNDLE_SHARE / len(groups)) and engine_cpus == ENGINE_BUNDLE_SHARE
        if use_gpu:
            assert len(groups) * gpus + engine_gpus == pytest.approx(1.0)
        else:
            assert gpus == engine_gpus == 0.0
    # Several users of one device take turns: the driver sleeps each group after its train.
    assert train_diffusion.needs_sleep(args, len(groups))


def test_an_engine_on_its_own_bundles_leaves_the_trainer_bundles_to_the_groups():
    for loss_type, num_groups in (("sft_loss", 1), ("dmd2", 2)):
        args = _args(loss_type, 2, "--rollout-num-gpus", "1")
        assert not engine_colocated(args) and len(_group_args(args)) == num_groups
        gpus, cpus = trainer_resources(num_groups, engine_colocated(args), use_gpu=True)
        assert num_groups * gpus == pytest.approx(1.0) and num_groups * cpus == pytest.approx(1.0)
        assert rollout_resources(engine_colocated(args), use_gpu=True) == (1.0, 1.0)
    # One group with its devices to itself never sleeps; a second group makes it take turns again.
    assert not train_diffusion.needs_sleep(_args("sft_loss", 2, "--rollout-num-gpus", "1"), 1)
    assert train_diffusion.needs_sleep(_args("dmd2", 2, "--rollout-num-gpus", "1"), 2)


def test_dmd2_critic_trains_first_from_critic_load_at_critic_lr_with_sibling_dirs_and_k_steps():
    args = _args(
        "dmd2", 2, "--critic-load", "/models/critic_init", "--critic-lr", "8e-6", "--lr", "2e-6",
        "--load", "/ckpt/run", "--save", "/ckpt/run", "--micro-batch-size", "2",
    )  # fmt: skip
    critic, actor = _group_args(args).values()
    assert (critic.hf_checkpoint, critic.lr, critic.teacher_load) == ("/models/critic_init", 8e-6, "/models/teacher")
    assert (actor.hf_checkpoint, actor.lr, actor.teacher_load) == ("/models/student", 2e-6, None)
    assert (critic.load, critic.save) == ("/ckpt/run_critic", "/ckpt/run_critic")
    assert (actor.load, actor.save) == ("/ckpt/run", "/ckpt/run")
    assert critic.save_hf is None  # only the student is exported

    # The hooks each group's ranks load: SFT-shaped critic steps and the scoring; the generator loss on the actor.
    critic_hooks, actor_hooks = trainer.load_hooks(critic), trainer.load_hooks(actor)
    assert (critic_hooks.prepare, critic_hooks.loss) == (dmd2.prepare_critic_batch, sft.sft_loss_formula)
    assert critic_hooks.train_output is dmd2.predict_teacher_and_critic_x0
    assert (actor_hooks.prepare, actor_hooks.loss) == (dmd2.prepare_generator_batch, dmd2.dmd2_loss_formula)
    assert actor_hooks.train_output is None and actor_hooks.train_input is None

    # Both groups train on the same DP shard (12 pairs / 2 ranks): the critic in K = 3 steps, the actor in one.
    shard = list(range(6))
    critic_windows = trainer.split_windows(shard, critic.num_steps_per_rollout, critic.micro_batch_size)
    actor_windows = trainer.split_windows(shard, actor.num_steps_per_rollout, actor.micro_batch_size)
    assert critic_windows == [[[0, 1]], [[2, 3]], [[4, 5]]]
    assert actor_windows == [[[0, 1], [2, 3], [4, 5]]]
    assert critic.global_batch_size * critic.num_steps_per_rollout == actor.global_batch_size == 12
    # The LR schedule counts the group's own optimizer steps.
    assert (
        critic.num_rollout * critic.num_steps_per_rollout == 12
        and actor.num_rollout * actor.num_steps_per_rollout == 4
    )


def test_dmd2_actor_copy_drops_only_the_teacher_and_the_input_args_stay_untouched(caplog):
    args = _args("dmd2", 2, "--save", "/ckpt/run", "--save-interval", "2")
    snapshot = copy.deepcopy(vars(args))
    groups = _group_args(args)
    actor = dict(vars(groups["actor"]))
    assert {name for name in actor.keys() | snapshot.keys() if actor.get(name) != snapshot.get(name)} == {
        "teacher_load"
    }
    # Mutating a group's copy never reaches the run's args or the other group.
    groups["critic"].diffusion_timesteps = [1000.0]
    groups["actor"].custom_train_output_function_path = "x.y"
    assert vars(args) == snapshot and vars(_group_args(args)["actor"]) == actor
    # The dry run builds the same group args and the placement from them, and leaves the input alone too.
    with caplog.at_level("INFO", logger="train_diffusion"):
        train_diffusion.log_plan(args)
    assert vars(args) == snapshot
    assert caplog.text.index("group critic:") < caplog.text.index("group actor:")
    assert "each rank of each group takes GPU 0.00 CPU 0.40" in caplog.text
