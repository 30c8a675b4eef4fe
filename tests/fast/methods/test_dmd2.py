"""``--loss-type dmd2`` (``miles.methods.dmd2``): its flags, defaults, validation and trainer groups (seeds
[DMD2 1/10], [DMD2 4/7] and [DMD2 5/7])."""

import copy

import pytest

from miles.config import CheckpointSpec, hook_name
from miles.driver.arguments import build_parser, parse_args, set_default_diffusion_args, validate_args
from miles.driver.export import export_schedule
from miles.driver.specs import build_run_spec
from miles.driver.validators import group_layout
from miles.methods import get_method
from miles.methods.dmd2 import DMD2_ACTOR_HOOKS, DMD2_CRITIC_HOOKS, DMD2Method, validate_dmd2_args
from miles.utils.validation import ArgumentValidationError

BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "3"]
# 10 pairs per rollout on one DP rank: K = 5 critic steps of 2 pairs each.
DMD2 = [*BASE, "--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--rollout-batch-size", "10"]

DMD2_CONVERTER = "miles.ray.data_conversion_hub.dmd2.expand_samples_to_train_pairs"
DMD2_PREPARE = "miles.backends.fsdp_utils.loss_hub.dmd2.prepare_generator_batch"
DMD2_LOSS = "miles.backends.fsdp_utils.loss_hub.dmd2.dmd2_loss_formula"
STOP_AT_RANDOM_STEP = "miles.rollout.step_strategy_hub.stop_at_random_step"
CRITIC_PREPARE = "miles.backends.fsdp_utils.loss_hub.dmd2.prepare_critic_batch"
CRITIC_SCORING = "miles.backends.fsdp_utils.loss_hub.dmd2.predict_teacher_and_critic_x0"
SFT_LOSS = "miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula"
# The critic-group tests also resume and save: the critic's directories are the <dir>_critic siblings.
DMD2_RUN = [
    *DMD2,
    "--lr",
    "2e-6",
    "--load",
    "/ckpt/run",
    "--save",
    "/ckpt/run/",
    "--diffusion-timesteps",
    "1000,750,500,250",
]


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
        [*DMD2, "--dmd2-scoring-sigma", "logit-normal", "--dmd2-scoring-logit-mean", "-1", "--ema-decay", "0.99"]
        + ["--ema-min-decay", "0.99", "--ema-update-after-step", "100"],
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
    run = build_run_spec(args)
    critic, actor = run.groups
    # The method module references the built-in hooks by import; their dotted paths are the ones above.
    assert hook_name(run.engine.converter) == DMD2_CONVERTER
    assert hook_name(run.engine.step_strategy) == STOP_AT_RANDOM_STEP
    assert actor.hooks == DMD2_ACTOR_HOOKS
    assert actor.hooks.names() == {"prepare": DMD2_PREPARE, "loss": DMD2_LOSS}
    assert critic.hooks == DMD2_CRITIC_HOOKS
    assert critic.hooks.names() == {"prepare": CRITIC_PREPARE, "loss": SFT_LOSS, "train_output": CRITIC_SCORING}
    assert isinstance(get_method(args), DMD2Method)
    # The method's hooks live in the groups' specs, never in the args: a path there is one the user typed.
    assert args.custom_expand_samples_to_train_pairs_path is None and args.diffusion_step_strategy_path is None
    assert args.custom_prepare_train_batch_path is None and args.custom_loss_function_path is None
    assert args.custom_train_output_function_path is None
    assert args.global_batch_size == 10 and args.train_output_before_step is None


OWN = "tests.support.rollout.stop_steps_from_args"  # any importable function stands for a user's hook here


@pytest.mark.parametrize(
    "flag, slot",
    [
        ("--custom-expand-samples-to-train-pairs-path", "converter"),
        ("--custom-prepare-train-batch-path", "prepare"),
        ("--custom-loss-function-path", "loss"),
        ("--diffusion-step-strategy-path", "step_strategy"),
    ],
)
def test_dmd2_never_fills_over_a_user_path(flag, slot):
    from tests.support.rollout import stop_steps_from_args

    run = build_run_spec(parse_args([*DMD2, flag, OWN]))
    actor = run.group("actor")
    filled = {
        "converter": (run.engine.converter, DMD2_CONVERTER),
        "prepare": (actor.hooks.prepare, DMD2_PREPARE),
        "loss": (actor.hooks.loss, DMD2_LOSS),
        "step_strategy": (run.engine.step_strategy, STOP_AT_RANDOM_STEP),
    }
    for other, (fn, path) in filled.items():
        assert fn is stop_steps_from_args if other == slot else hook_name(fn) == path
    # The critic's own hooks stay DMD2's whatever the user set for the actor.
    assert run.group("critic").hooks.names() == {
        "prepare": CRITIC_PREPARE,
        "loss": SFT_LOSS,
        "train_output": CRITIC_SCORING,
    }


def test_critic_load_and_lr_default_to_teacher_load_and_lr():
    args = parse_args([*DMD2, "--lr", "2e-6"])
    assert (args.critic_load, args.critic_lr) == ("/models/teacher", 2e-6)
    args = parse_args([*DMD2, "--lr", "2e-6", "--critic-load", "/models/critic_init", "--critic-lr", "8e-6"])
    assert (args.critic_load, args.critic_lr) == ("/models/critic_init", 8e-6)
    assert args.teacher_load == "/models/teacher" and args.lr == 2e-6


@pytest.mark.parametrize(
    "extra",
    [
        ["--critic-load", "/models/critic_init"],
        ["--critic-lr", "8e-6"],
        # Every flag of the method is rejected the same way, not only the critic's (miles.driver.arguments).
        ["--dmd2-critic-steps-per-rollout", "2"],
        ["--dmd2-teacher-guidance-scale", "3"],
        ["--dmd2-critic-scoring", "original"],
        ["--dmd2-min-timestep-ratio", "0.1"],
        ["--dmd2-max-timestep-ratio", "0.9"],
    ],
)
@pytest.mark.parametrize("loss_type", ["sft_loss", "custom_loss"])
def test_dmd2_flags_rejected_without_dmd2(extra, loss_type, capsys):
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
        # The generic check of every loss type (miles.driver.arguments), no longer a DMD2 message of its own.
        ([*DMD2, "--fsdp-flow-shift", "0"], "--fsdp-flow-shift must be > 0 (e.g. 3.0), got 0.0"),
        ([*DMD2, "--fsdp-flow-shift", "-3"], "--fsdp-flow-shift must be > 0 (e.g. 3.0), got -3.0"),
        (
            [*DMD2, "--diffusion-guidance-scale", "4.5"],
            "--loss-type dmd2 needs unguided student rollouts: set --diffusion-guidance-scale 1 (got 4.5)",
        ),
        (
            [*DMD2, "--num-steps-per-rollout", "2", "--global-batch-size", "5"],
            "--loss-type dmd2 takes one actor step per rollout: set --num-steps-per-rollout 1 (got 2)",
        ),
        (
            [*DMD2, "--train-only"],
            "--train-only has no rollouts, which --loss-type dmd2 trains on: remove --train-only",
        ),
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
        (
            [*DMD2, "--dmd2-scoring-shift", "0.5"],
            "--dmd2-scoring-shift is read by --dmd2-scoring-sigma shift only (got --dmd2-scoring-sigma grid)",
        ),
        (
            [*DMD2, "--dmd2-scoring-sigma", "logit-normal", "--dmd2-scoring-logit-std", "0"],
            "--dmd2-scoring-logit-std must be > 0, got 0.0",
        ),
        (
            [*DMD2, "--dmd2-gan-projection"],
            "--dmd2-gan-projection changes the GAN head: set --dmd2-gan-disc-weight > 0, or remove it",
        ),
        (
            [*DMD2, "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-real-data", "/data/real.jsonl"]
            + ["--dmd2-gan-mismatch-weight", "1", "--micro-batch-size", "1"],
            "--dmd2-gan-mismatch-weight shows each real with another real's prompt from its micro-batch: set "
            "--micro-batch-size >= 2 (got 1)",
        ),
        (
            [*DMD2, "--ema-decay", "0.99", "--ema-min-decay", "0.995"],
            "--ema-min-decay 0.995 must be <= --ema-decay 0.99 (the warm-up's floor)",
        ),
        (
            # Both ratios are in [0, 1] and ordered, but the shift-3 grid's lowest timestep is 2.994.
            [*DMD2, "--dmd2-min-timestep-ratio", "0", "--dmd2-max-timestep-ratio", "0.002"],
            "no timestep of the --fsdp-flow-shift 3.0 grid lies in [0, 2]; widen --dmd2-min-timestep-ratio / "
            "--dmd2-max-timestep-ratio",
        ),
        (
            [*DMD2, "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-real-data", "/data/real.jsonl"]
            + ["--dmd2-min-timestep-ratio", "0", "--dmd2-gan-max-timestep-ratio", "0.002"],
            "no timestep of the --fsdp-flow-shift 3.0 grid lies in [0, 2]; widen --dmd2-min-timestep-ratio / "
            "--dmd2-gan-max-timestep-ratio",
        ),
        (
            [*DMD2, "--dmd2-gan-max-timestep-ratio", "0.3"],
            "--dmd2-gan-max-timestep-ratio changes the GAN head: set --dmd2-gan-disc-weight > 0, or remove it",
        ),
        (
            [*DMD2, "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-real-data", "/data/real.jsonl"]
            + ["--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"],
            "--dmd2-gan-disc-weight > 0 with --context-parallel-size 2: the GAN head reads block features that "
            "context parallelism splits over the ranks; use --context-parallel-size 1",
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
        "scoring-shift-without-its-rule",
        "logit-std-zero",
        "projection-without-gan",
        "mismatch-in-micro-batches-of-one",
        "ema-floor-above-decay",
        "scoring-range-between-grid-points",
        "gan-range-between-grid-points",
        "gan-range-without-gan",
        "gan-under-context-parallelism",
    ],
)
def test_unsupported_dmd2_combination_rejected(argv, message, capsys):
    with pytest.raises(ArgumentValidationError) as exc_info:
        validate_args(_parsed_with_defaults(argv))
    assert message in str(exc_info.value)
    assert "\n" not in str(exc_info.value)
    assert message in _rejection(argv, capsys)


def test_scoring_ranges_that_only_the_gan_or_the_grid_would_limit_are_accepted():
    # Without a GAN head its noise range (default top 0.98) does not bound the scoring range; a continuous scoring
    # rule samples a range that holds no grid point.
    for extra in (
        ["--dmd2-min-timestep-ratio", "0.985", "--dmd2-max-timestep-ratio", "0.999"],
        ["--dmd2-min-timestep-ratio", "0.0005", "--dmd2-max-timestep-ratio", "0.002", "--dmd2-scoring-sigma", "shift"],
    ):
        validate_args(_parsed_with_defaults([*DMD2, *extra]))


def test_validate_dmd2_args_is_the_methods_validator():
    """The seed's name stays: ``validate_dmd2_args`` is what ``--loss-type dmd2`` runs after the generic checks."""
    validate_dmd2_args(parse_args(DMD2))
    args = _parsed_with_defaults([*DMD2, "--dmd2-critic-steps-per-rollout", "3"])
    with pytest.raises(ArgumentValidationError, match="--dmd2-critic-steps-per-rollout 3 must split"):
        validate_dmd2_args(args)
    with pytest.raises(ArgumentValidationError, match="--dmd2-critic-steps-per-rollout 3 must split"):
        get_method(args).validate(args)


@pytest.mark.parametrize("scale, encode", [("1", False), ("1.5", True), ("4.5", True)])
def test_teacher_cfg_asks_the_engine_for_the_negative_cond(scale, encode):
    """The student samples unguided, but the teacher's CFG in scoring needs every sample's negative cond: the method
    sets ``--encode-negative-prompt`` (the engine no longer reads ``--loss-type``)."""
    args = parse_args([*DMD2, "--dmd2-teacher-guidance-scale", scale])
    assert args.encode_negative_prompt is encode and args.diffusion_guidance_scale == 1.0
    assert parse_args([*DMD2, "--encode-negative-prompt"]).encode_negative_prompt is True


def test_export_records_the_teacher_scale_it_was_distilled_from():
    args = parse_args([*DMD2, "--dmd2-teacher-guidance-scale", "4.5", "--diffusion-timesteps", "1000,500"])
    assert export_schedule(args) == {
        "num_steps": 2,
        "shift": 3.0,
        "step_rule": "dmd2",
        "timesteps": [1000.0, 500.0],
        "guidance_scale": 1.0,
        "distilled_guidance_scale": 4.5,
    }


# -- trainer groups --------------------------------------------------------------------------------------------------
def test_dmd2_critic_first_from_critic_load_at_critic_lr():
    args = parse_args([*DMD2_RUN, "--critic-load", "/models/critic_init", "--critic-lr", "8e-6"])
    snapshot = copy.deepcopy(vars(args))
    critic, actor = group_layout(args)
    assert [critic.role, actor.role] == ["critic", "actor"]
    assert (critic.init, critic.teacher) == ("/models/critic_init", "/models/teacher")
    assert (critic.optimizer.lr, actor.optimizer.lr) == (8e-6, 2e-6)
    assert critic.checkpoint == CheckpointSpec(load="/ckpt/run_critic", save="/ckpt/run_critic")
    assert actor.checkpoint == CheckpointSpec(load="/ckpt/run", save="/ckpt/run/")
    assert (critic.steps_per_rollout, actor.steps_per_rollout) == (5, 1)
    assert critic.hooks.names() == {"prepare": CRITIC_PREPARE, "loss": SFT_LOSS, "train_output": CRITIC_SCORING}
    assert critic.train_output_before_step is None and critic.ema is None
    # The critic's schedule spans its own steps: K per rollout.
    assert (critic.schedule.total_steps, actor.schedule.total_steps) == (3 * 5, 3 * 1)
    # Everything else is the student's: micro-batch, dtype, seed, the optimizer's other settings.
    assert (critic.micro_batch_size, critic.dtype, critic.seed) == (actor.micro_batch_size, actor.dtype, actor.seed)
    assert critic.optimizer.betas == actor.optimizer.betas and critic.schedule.decay_style == "constant"
    assert vars(args) == snapshot


def test_dmd2_critic_defaults_to_teacher_and_actor_lr_without_checkpoint_dirs():
    argv = [*BASE, "--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--rollout-batch-size", "6"]
    args = parse_args([*argv, "--dmd2-critic-steps-per-rollout", "3"])
    critic = group_layout(args)[0]
    assert critic.init == "/models/teacher"
    assert critic.optimizer.lr == args.lr == 1e-5
    assert critic.checkpoint == CheckpointSpec()
    assert critic.steps_per_rollout == 3


@pytest.mark.parametrize("k", [1, 2, 5, 10])
def test_dmd2_critic_scoring_original_scores_before_the_last_critic_step(k):
    args = parse_args([*DMD2_RUN, "--dmd2-critic-steps-per-rollout", str(k), "--dmd2-critic-scoring", "original"])
    critic = group_layout(args)[0]
    assert critic.steps_per_rollout == k
    assert critic.train_output_before_step == k - 1


def test_dmd2_actor_group_is_the_student_without_the_teacher():
    args = parse_args(DMD2_RUN)
    snapshot = copy.deepcopy(vars(args))
    actor = group_layout(args)[1]
    assert actor.role == "actor" and actor.init == "/models/student" and actor.teacher is None
    assert actor.hooks == DMD2_ACTOR_HOOKS and actor.steps_per_rollout == 1 and actor.optimizer.lr == 2e-6
    assert vars(args) == snapshot


def test_critic_lora_flags_default_to_the_students_and_map_onto_the_critic_group():
    from miles.models.lora import DEFAULT_LORA_TARGET_MODULES, LoraSettings

    args = parse_args([*DMD2, "--lora-rank", "8", "--lora-alpha", "16", "--lora-target-modules", "to_q,to_v"])
    critic, actor = group_layout(args)
    assert actor.lora == critic.lora == LoraSettings(8, 16.0, ("to_q", "to_v"), 0.0)
    args = parse_args([*DMD2, "--lora-rank", "8", "--critic-lora-rank", "4", "--critic-lora-dropout", "0.1"])
    critic, actor = group_layout(args)
    assert critic.lora == LoraSettings(4, 4.0, DEFAULT_LORA_TARGET_MODULES, 0.1)
    assert actor.lora == LoraSettings(8, 8.0, DEFAULT_LORA_TARGET_MODULES, 0.0)
    args = parse_args([*DMD2, "--lora-rank", "8", "--critic-lora-rank", "0"])
    assert group_layout(args)[0].lora is None  # a full-weight critic beside a LoRA student


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--critic-lora-rank", "-1"], "--critic-lora-rank must be >= 0 (0 trains full weights), got -1"),
        (["--critic-lora-rank", "4", "--critic-lora-alpha", "0"], "--critic-lora-alpha must be > 0"),
        (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be"),
        (["--lora-alpha", "8"], "--lora-alpha is read with --lora-rank > 0 only"),
        (
            ["--critic-lora-rank", "4", "--critic-load", "/models/critic_init"],
            "--critic-lora-rank puts the critic's adapter on the teacher's weights (one base in the critic group): "
            "--critic-load /models/critic_init must be --teacher-load /models/teacher",
        ),
        (["--save-hf-lora"], "--save-hf-lora writes the student's adapter beside --save-hf"),
        (["--critic-lora-alpha", "8"], "--critic-lora-alpha is read with a critic LoRA only"),
        (
            ["--lora-rank", "8", "--critic-lora-rank", "0", "--critic-lora-dropout", "0.1"],
            "--critic-lora-dropout is read with a critic LoRA only",
        ),
    ],
    ids=[
        "rank-negative",
        "alpha-zero",
        "dropout-one",
        "alpha-without-rank",
        "critic-base-not-teacher",
        "no-lora",
        "critic-alpha-without-rank",
        "critic-dropout-full-weight-critic",
    ],
)
def test_bad_lora_flags_rejected_in_one_line(extra, message, capsys):
    assert message in _rejection([*DMD2, *extra], capsys)


def test_the_discriminator_evaluation_pairs_each_real_with_the_next_other_prompt():
    from miles.methods.dmd2_disc_eval import wrong_prompts

    assert wrong_prompts(["a 1", "a 1", "a 2", "a 3"]) == ["a 2", "a 2", "a 3", "a 1"]
    with pytest.raises(ValueError, match="holds a single prompt"):
        wrong_prompts(["a 1", "a 1"])
