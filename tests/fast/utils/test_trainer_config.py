"""Trainer groups of a run and each group's own copy of the args (seeds [DMD2 1/10] and [DMD2 4/7])."""

import argparse
import copy

import pytest

from miles.utils.arguments import parse_args
from miles.utils.trainer_config import TrainerConfig, compute_trainer_args, compute_trainer_configs, sibling_dir

BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "3"]
DMD2 = [
    *BASE,
    "--loss-type",
    "dmd2",
    "--teacher-load",
    "/models/teacher",
    "--rollout-batch-size",
    "10",
    "--lr",
    "2e-6",
    "--load",
    "/ckpt/run",
    "--save",
    "/ckpt/run/",
    "--diffusion-timesteps",
    "1000,750,500,250",
]

CRITIC_PREPARE = "miles.backends.fsdp_utils.loss_hub.dmd2.prepare_critic_batch"
CRITIC_SCORING = "miles.backends.fsdp_utils.loss_hub.dmd2.predict_teacher_and_critic_x0"
SFT_LOSS = "miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula"


def _diff(before: argparse.Namespace, after: argparse.Namespace) -> dict:
    """name → (before, after) for every attribute that differs (or exists on one side only)."""
    old, new = vars(before), vars(after)
    return {name: (old.get(name), new.get(name)) for name in old.keys() | new.keys() if old.get(name) != new.get(name)}


@pytest.mark.parametrize("loss_type", ["sft_loss", "custom_loss"])
def test_actor_alone_without_overrides_by_default(loss_type):
    extra = ["--rollout-batch-size", "4", "--loss-type", loss_type]
    if loss_type == "custom_loss":
        extra += [
            "--custom-expand-samples-to-train-pairs-path",
            "my.hooks.convert",
            "--custom-prepare-train-batch-path",
            "my.hooks.prepare",
            "--custom-loss-function-path",
            "my.hooks.loss",
        ]
    args = parse_args([*BASE, *extra])
    assert compute_trainer_configs(args) == [TrainerConfig("actor", {})]
    actor_args = compute_trainer_args(args, compute_trainer_configs(args)[0])
    assert actor_args is not args and vars(actor_args) == vars(args)


def test_overrides_go_to_a_deep_copy_and_input_is_untouched():
    args = parse_args([*BASE, "--rollout-batch-size", "4", "--diffusion-timesteps", "1000,500"])
    snapshot = copy.deepcopy(vars(args))
    trainer_args = compute_trainer_args(args, TrainerConfig("actor", {"lr": 3e-4, "save": "/elsewhere"}))
    assert _diff(args, trainer_args) == {"lr": (1e-5, 3e-4), "save": (None, "/elsewhere")}
    assert vars(args) == snapshot
    # Deep, not shallow: mutating the copy's list must not reach the input.
    trainer_args.diffusion_timesteps.append(1.0)
    assert args.diffusion_timesteps == [1000.0, 500.0]


def test_unknown_override_is_rejected_and_names_it():
    args = parse_args([*BASE, "--rollout-batch-size", "4"])
    snapshot = copy.deepcopy(vars(args))
    with pytest.raises(ValueError, match=r"'critic'.*\['learning_rate'\]"):
        compute_trainer_args(args, TrainerConfig("critic", {"learning_rate": 1e-4, "lr": 1e-4}))
    assert vars(args) == snapshot


def test_dmd2_critic_first_from_critic_load_at_critic_lr():
    args = parse_args([*DMD2, "--critic-load", "/models/critic_init", "--critic-lr", "8e-6"])
    snapshot = copy.deepcopy(vars(args))
    configs = compute_trainer_configs(args)
    assert [config.role for config in configs] == ["critic", "actor"]
    critic_args = compute_trainer_args(args, configs[0])
    assert _diff(args, critic_args) == {
        "hf_checkpoint": ("/models/student", "/models/critic_init"),
        "lr": (2e-6, 8e-6),
        "load": ("/ckpt/run", "/ckpt/run_critic"),
        "save": ("/ckpt/run/", "/ckpt/run_critic"),
        "num_steps_per_rollout": (1, 5),
        "global_batch_size": (10, 2),
        "custom_prepare_train_batch_path": (
            "miles.backends.fsdp_utils.loss_hub.dmd2.prepare_generator_batch",
            CRITIC_PREPARE,
        ),
        "custom_loss_function_path": ("miles.backends.fsdp_utils.loss_hub.dmd2.dmd2_loss_formula", SFT_LOSS),
        "custom_train_output_function_path": (None, CRITIC_SCORING),
    }
    assert critic_args.teacher_load == "/models/teacher"
    assert critic_args.train_output_before_step is None
    # The critic's K steps cover the same DP shard as the actor's one step.
    assert critic_args.global_batch_size * critic_args.num_steps_per_rollout == args.global_batch_size
    assert vars(args) == snapshot


def test_dmd2_critic_defaults_to_teacher_and_actor_lr_without_checkpoint_dirs():
    argv = [*BASE, "--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--rollout-batch-size", "6"]
    args = parse_args([*argv, "--dmd2-critic-steps-per-rollout", "3"])
    critic_args = compute_trainer_args(args, compute_trainer_configs(args)[0])
    assert critic_args.hf_checkpoint == "/models/teacher"
    assert critic_args.lr == args.lr == 1e-5
    assert critic_args.load is None and critic_args.save is None
    assert (critic_args.num_steps_per_rollout, critic_args.global_batch_size) == (3, 2)


@pytest.mark.parametrize("k", [1, 2, 5, 10])
def test_dmd2_critic_scoring_original_scores_before_the_last_critic_step(k):
    args = parse_args([*DMD2, "--dmd2-critic-steps-per-rollout", str(k), "--dmd2-critic-scoring", "original"])
    critic_args = compute_trainer_args(args, compute_trainer_configs(args)[0])
    assert critic_args.num_steps_per_rollout == k
    assert critic_args.train_output_before_step == k - 1


def test_dmd2_actor_copy_differs_only_by_dropping_the_teacher():
    args = parse_args(DMD2)
    snapshot = copy.deepcopy(vars(args))
    actor = compute_trainer_configs(args)[1]
    assert actor == TrainerConfig("actor", {"teacher_load": None})
    actor_args = compute_trainer_args(args, actor)
    assert _diff(args, actor_args) == {"teacher_load": ("/models/teacher", None)}
    assert vars(args) == snapshot


def test_sibling_dir():
    assert sibling_dir("/ckpt/run", "_critic") == "/ckpt/run_critic"
    assert sibling_dir("/ckpt/run/", "_critic") == "/ckpt/run_critic"
    assert sibling_dir("relative/run", "_critic") == "relative/run_critic"
    assert sibling_dir(None, "_critic") is None
