"""``--loss-type dmd2`` validation and defaults (seeds [DMD2 4/7] and [DMD2 5/7])."""

import copy

import pytest

from miles.utils.arguments import (
    ArgumentValidationError,
    build_parser,
    parse_args,
    set_default_diffusion_args,
    validate_args,
)

BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "3"]
# 10 pairs per rollout on one DP rank: K = 5 critic steps of 2 pairs each.
DMD2 = [*BASE, "--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--rollout-batch-size", "10"]

DMD2_CONVERTER = "miles.ray.data_conversion_hub.dmd2.expand_samples_to_train_pairs"
DMD2_PREPARE = "miles.backends.fsdp_utils.loss_hub.dmd2.prepare_generator_batch"
DMD2_LOSS = "miles.backends.fsdp_utils.loss_hub.dmd2.dmd2_loss_formula"
STOP_AT_RANDOM_STEP = "miles.rollout.step_strategy_hub.stop_at_random_step"


def _parsed_with_defaults(argv):
    return set_default_diffusion_args(build_parser().parse_args(argv))


def _rejection(argv, capsys) -> str:
    """Run ``parse_args`` as the CLI does; return its single stderr line after checking exit code 2."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train_diffusion.py: error: "), err
    return err


@pytest.mark.parametrize(
    "argv",
    [
        DMD2,
        [*DMD2, "--dmd2-teacher-guidance-scale", "4.5", "--fsdp-flow-shift", "0.5"],
        [*DMD2, "--dmd2-critic-steps-per-rollout", "1", "--dmd2-critic-scoring", "original"],
        [
            *DMD2,
            "--dmd2-critic-steps-per-rollout",
            "10",
            "--dmd2-min-timestep-ratio",
            "0",
            "--dmd2-max-timestep-ratio",
            "1",
        ],
        # 2 ranks x 4 pairs; K = 2 steps of 2 pairs = one micro-batch of 2 per step.
        [
            *DMD2[:-1],
            "8",
            "--actor-num-gpus-per-node",
            "2",
            "--micro-batch-size",
            "2",
            "--dmd2-critic-steps-per-rollout",
            "2",
        ],
    ],
)
def test_valid_dmd2_args_pass_unchanged(argv):
    args = _parsed_with_defaults(argv)
    before = copy.deepcopy(vars(args))
    validate_args(args)
    assert vars(args) == before
    assert vars(parse_args(argv)) == before


def test_dmd2_fills_converter_prepare_loss_and_step_strategy():
    args = parse_args(DMD2)
    assert args.custom_expand_samples_to_train_pairs_path == DMD2_CONVERTER
    assert args.custom_prepare_train_batch_path == DMD2_PREPARE
    assert args.custom_loss_function_path == DMD2_LOSS
    assert args.diffusion_step_strategy_path == STOP_AT_RANDOM_STEP
    # The critic's hooks are its trainer overrides, not args of the run.
    assert args.custom_train_output_function_path is None
    assert args.global_batch_size == 10 and args.train_output_before_step is None


@pytest.mark.parametrize(
    "flag, dest",
    [
        ("--custom-expand-samples-to-train-pairs-path", "custom_expand_samples_to_train_pairs_path"),
        ("--custom-prepare-train-batch-path", "custom_prepare_train_batch_path"),
        ("--custom-loss-function-path", "custom_loss_function_path"),
        ("--diffusion-step-strategy-path", "diffusion_step_strategy_path"),
    ],
)
def test_dmd2_never_fills_over_a_user_path(flag, dest):
    args = parse_args([*DMD2, flag, "my_project.hooks.own"])
    assert getattr(args, dest) == "my_project.hooks.own"
    filled = {
        "custom_expand_samples_to_train_pairs_path": DMD2_CONVERTER,
        "custom_prepare_train_batch_path": DMD2_PREPARE,
        "custom_loss_function_path": DMD2_LOSS,
        "diffusion_step_strategy_path": STOP_AT_RANDOM_STEP,
    }
    for other, path in filled.items():
        if other != dest:
            assert getattr(args, other) == path


def test_sft_loss_fills_its_hooks_and_no_step_strategy():
    args = parse_args([*BASE, "--rollout-batch-size", "4"])
    assert args.custom_expand_samples_to_train_pairs_path == (
        "miles.ray.data_conversion_hub.sft.expand_samples_to_train_pairs"
    )
    assert args.custom_prepare_train_batch_path == "miles.backends.fsdp_utils.loss_hub.sft.prepare_sft_batch"
    assert args.custom_loss_function_path == "miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula"
    assert args.diffusion_step_strategy_path is None
    assert args.critic_load is None and args.critic_lr is None
    own = parse_args([*BASE, "--rollout-batch-size", "4", "--custom-loss-function-path", "my_project.hooks.loss"])
    assert own.custom_loss_function_path == "my_project.hooks.loss"
    assert own.custom_prepare_train_batch_path == "miles.backends.fsdp_utils.loss_hub.sft.prepare_sft_batch"


def test_critic_load_and_lr_default_to_teacher_load_and_lr():
    args = parse_args([*DMD2, "--lr", "2e-6"])
    assert (args.critic_load, args.critic_lr) == ("/models/teacher", 2e-6)
    args = parse_args([*DMD2, "--lr", "2e-6", "--critic-load", "/models/critic_init", "--critic-lr", "8e-6"])
    assert (args.critic_load, args.critic_lr) == ("/models/critic_init", 8e-6)
    assert args.teacher_load == "/models/teacher" and args.lr == 2e-6


@pytest.mark.parametrize("extra", [["--critic-load", "/models/critic_init"], ["--critic-lr", "8e-6"]])
@pytest.mark.parametrize("loss_type", ["sft_loss", "custom_loss"])
def test_critic_flags_rejected_without_dmd2(extra, loss_type, capsys):
    hooks = ["--custom-expand-samples-to-train-pairs-path", "m.c", "--custom-prepare-train-batch-path", "m.p"]
    hooks += ["--custom-loss-function-path", "m.l"]
    argv = [*BASE, "--rollout-batch-size", "4", "--loss-type", loss_type, *hooks, *extra]
    err = _rejection(argv, capsys)
    assert f"{extra[0]} is only read by --loss-type dmd2 (got --loss-type {loss_type}); remove it" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [*BASE, "--loss-type", "dmd2", "--rollout-batch-size", "10"],
            "--loss-type dmd2 needs --teacher-load",
        ),
        (
            [*DMD2, "--dmd2-teacher-guidance-scale", "0.5"],
            "--dmd2-teacher-guidance-scale must be >= 1 (1 = no CFG), got 0.5",
        ),
        ([*DMD2, "--fsdp-flow-shift", "0"], "needs a visual --fsdp-flow-shift > 0 (e.g. 3.0), got 0.0"),
        ([*DMD2, "--fsdp-flow-shift", "-3"], "needs a visual --fsdp-flow-shift > 0 (e.g. 3.0), got -3.0"),
        (
            [*DMD2, "--diffusion-guidance-scale", "4.5"],
            "--loss-type dmd2 needs unguided student rollouts: set --diffusion-guidance-scale 1 (got 4.5)",
        ),
        (
            [*DMD2, "--num-steps-per-rollout", "2", "--global-batch-size", "5"],
            "--loss-type dmd2 takes one actor step per rollout: set --num-steps-per-rollout 1 (got 2)",
        ),
        ([*DMD2, "--train-only"], "--train-only has no rollout engine, which --loss-type dmd2 needs"),
        ([*DMD2, "--dmd2-critic-steps-per-rollout", "0"], "--dmd2-critic-steps-per-rollout must be >= 1, got 0"),
        (
            [*DMD2, "--dmd2-critic-steps-per-rollout", "3"],
            "--dmd2-critic-steps-per-rollout 3 must split each DP shard of 10 pairs",
        ),
        (
            # 2 ranks x 4 pairs; K = 4 leaves 1 pair per step, not a whole micro-batch of 2.
            [*DMD2[:-1], "8", "--actor-num-gpus-per-node", "2", "--micro-batch-size", "2"]
            + ["--dmd2-critic-steps-per-rollout", "4"],
            "--dmd2-critic-steps-per-rollout 4 must split each DP shard of 4 pairs into equal steps of whole "
            "micro-batches (--micro-batch-size 2)",
        ),
        (
            [*DMD2, "--dmd2-min-timestep-ratio", "0.5", "--dmd2-max-timestep-ratio", "0.5"],
            "need 0 <= --dmd2-min-timestep-ratio < --dmd2-max-timestep-ratio <= 1, got (0.5, 0.5)",
        ),
        (
            [*DMD2, "--dmd2-min-timestep-ratio", "-0.1"],
            "need 0 <= --dmd2-min-timestep-ratio < --dmd2-max-timestep-ratio <= 1, got (-0.1, 0.98)",
        ),
        (
            [*DMD2, "--dmd2-max-timestep-ratio", "1.5"],
            "need 0 <= --dmd2-min-timestep-ratio < --dmd2-max-timestep-ratio <= 1, got (0.02, 1.5)",
        ),
    ],
    ids=[
        "teacher-missing",
        "teacher-guidance-below-1",
        "flow-shift-zero",
        "flow-shift-negative",
        "guided-student-rollouts",
        "two-actor-steps",
        "train-only",
        "k-zero",
        "k-does-not-split-shard",
        "k-splits-into-partial-micro-batches",
        "timestep-ratios-equal",
        "timestep-ratio-below-0",
        "timestep-ratio-above-1",
    ],
)
def test_unsupported_dmd2_combination_rejected(argv, message, capsys):
    with pytest.raises(ArgumentValidationError) as exc_info:
        validate_args(_parsed_with_defaults(argv))
    assert message in str(exc_info.value)
    assert "\n" not in str(exc_info.value)
    assert message in _rejection(argv, capsys)
