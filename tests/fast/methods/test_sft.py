"""``--loss-type sft_loss`` (``miles.methods.sft``): its hooks, what it asks the engine to encode, its teacher rule."""

import pytest

from miles.config import hook_name
from miles.driver.arguments import parse_args
from miles.driver.export import engine_schedule, export_schedule
from miles.driver.specs import build_run_spec
from tests.support.arguments import BASE
from tests.support.arguments import rejected as _rejected
from tests.support.arguments import validated as _validate

SFT_CONVERTER = "miles.ray.data_conversion_hub.sft.expand_samples_to_train_pairs"
SFT_PREPARE = "miles.backends.fsdp_utils.loss_hub.sft.prepare_sft_batch"
SFT_LOSS = "miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula"


def test_sft_loss_fills_its_hooks_and_no_step_strategy():
    args = parse_args([*BASE, "--rollout-batch-size", "4"])
    run = build_run_spec(args)
    (actor,) = run.groups
    # The method module references the built-in hooks by import; their dotted paths are the ones above.
    assert hook_name(run.engine.converter) == SFT_CONVERTER
    assert actor.hooks.names() == {"prepare": SFT_PREPARE, "loss": SFT_LOSS}
    assert run.engine.step_strategy is None
    assert args.critic_load is None and args.critic_lr is None
    # A user's hook wins; the method's fills the rest. The args hold only what the user typed.
    own = "tests.support.trainer.echo_output"
    args = parse_args([*BASE, "--rollout-batch-size", "4", "--custom-loss-function-path", own])
    (actor,) = build_run_spec(args).groups
    assert actor.hooks.names() == {"prepare": SFT_PREPARE, "loss": own}
    assert args.custom_loss_function_path == own and args.custom_prepare_train_batch_path is None


def test_sft_conditioning_dropout_asks_the_engine_for_the_negative_cond():
    """``--sft-uncond-prob > 0`` trains on the negative prompt's cond, so the method sets
    ``--encode-negative-prompt`` (formerly the engine's ``needs_negative`` read the SFT flag itself)."""
    assert parse_args([*BASE, "--rollout-batch-size", "4"]).encode_negative_prompt is False
    assert parse_args([*BASE, "--rollout-batch-size", "4", "--sft-uncond-prob", "0.1"]).encode_negative_prompt is True


def test_uncond_dropout_is_sft_only():
    dmd2 = ["--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--rollout-batch-size", "5"]
    assert "--sft-uncond-prob" in _rejected([*BASE, *dmd2, "--sft-uncond-prob", "0.1"])
    assert _validate([*BASE, "--rollout-batch-size", "2", "--sft-uncond-prob", "0.1"]).sft_uncond_prob == 0.1
    assert "--sft-uncond-prob must be in [0, 1), got 1.0" in _rejected(
        [*BASE, "--rollout-batch-size", "2", "--sft-uncond-prob", "1"]
    )


def test_teacher_load_without_consumer_rejected():
    message = _rejected([*BASE, "--rollout-batch-size", "4", "--teacher-load", "/models/teacher"])
    assert message.startswith("--teacher-load has no consumer")
    for flag in ("--custom-prepare-train-batch-path", "--custom-loss-function-path"):
        assert flag in message


@pytest.mark.parametrize(
    "flag",
    ["--custom-prepare-train-batch-path", "--custom-loss-function-path", "--custom-train-output-function-path"],
)
def test_teacher_load_accepted_with_each_custom_hook_alone(flag):
    args = _validate([*BASE, "--rollout-batch-size", "4", "--teacher-load", "/models/teacher", flag, "my.hooks.fn"])
    assert args.teacher_load == "/models/teacher"


def test_export_keeps_the_source_scheduler():
    """An SFT model samples like its source (a teacher), so its export records no schedule of its own."""
    args = parse_args([*BASE, "--rollout-batch-size", "4", "--diffusion-step-rule", "euler"])
    assert export_schedule(args) is None
    assert engine_schedule(args) == {
        "num_steps": 4,
        "shift": 3.0,
        "step_rule": "euler",
        "timesteps": None,
        "guidance_scale": 1.0,
    }
