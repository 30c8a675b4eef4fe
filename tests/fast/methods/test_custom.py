"""``--loss-type custom_loss`` (``miles.methods.custom``): the user's own hooks, nothing filled in."""

import pytest

from tests.support.arguments import BASE, CUSTOM_HOOKS
from tests.support.arguments import rejected as _rejected
from tests.support.arguments import validated as _validate


@pytest.mark.parametrize(
    "drop, message",
    [
        (
            "--custom-prepare-train-batch-path",
            "--loss-type custom_loss needs --custom-prepare-train-batch-path and --custom-loss-function-path",
        ),
        (
            "--custom-loss-function-path",
            "--loss-type custom_loss needs --custom-prepare-train-batch-path and --custom-loss-function-path",
        ),
        (
            "--custom-expand-samples-to-train-pairs-path",
            "--loss-type custom_loss needs --custom-expand-samples-to-train-pairs-path (the converter)",
        ),
    ],
)
def test_custom_loss_without_its_hooks_rejected(drop, message):
    index = CUSTOM_HOOKS.index(drop)
    hooks = CUSTOM_HOOKS[:index] + CUSTOM_HOOKS[index + 2 :]
    assert message in _rejected([*BASE, "--rollout-batch-size", "4", "--loss-type", "custom_loss", *hooks])
    args = _validate([*BASE, "--rollout-batch-size", "4", "--loss-type", "custom_loss", *CUSTOM_HOOKS])
    assert args.custom_loss_function_path == "my_project.hooks.loss"


def test_custom_loss_with_no_hooks_rejected():
    # The generic converter check runs before the method's own validation, so it names the converter first.
    message = _rejected([*BASE, "--rollout-batch-size", "4", "--loss-type", "custom_loss"])
    assert "--loss-type custom_loss needs --custom-expand-samples-to-train-pairs-path (the converter)" in message
    message = _rejected([*BASE, "--rollout-batch-size", "4", "--loss-type", "custom_loss", *CUSTOM_HOOKS[:2]])
    assert "--loss-type custom_loss needs --custom-prepare-train-batch-path" in message


def test_custom_loss_fills_nothing():
    args = _validate([*BASE, "--rollout-batch-size", "4", "--loss-type", "custom_loss", *CUSTOM_HOOKS])
    assert args.custom_prepare_train_batch_path == "my_project.hooks.prepare"
    assert args.custom_train_output_function_path is None and args.diffusion_step_strategy_path is None
    assert args.encode_negative_prompt is False  # a hook that needs it passes --encode-negative-prompt


def test_teacher_load_needs_a_custom_hook_under_custom_loss_too():
    argv = [*BASE, "--rollout-batch-size", "4", "--loss-type", "custom_loss", "--teacher-load", "/models/teacher"]
    assert _validate([*argv, *CUSTOM_HOOKS]).teacher_load == "/models/teacher"
