"""``--loss-type dmd2`` with a reward (``miles.methods.dmd2_reward``): its flags' one-line rejections, the bad hook
path named before Ray starts, and the frozen reward group the method adds only with a weight."""

import pytest

from miles.config import CheckpointSpec
from miles.driver.arguments import parse_args
from miles.driver.preflight import validate_inputs
from miles.driver.specs import build_run_spec
from miles.eval.digits.reward import digit_log_prob
from miles.methods.dmd2_reward import check_reward_family
from miles.utils.validation import ArgumentValidationError

BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "3"]
DMD2 = [*BASE, "--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--rollout-batch-size", "10"]
DMD2 += ["--save", "/ckpt/run"]
REWARD = ["--dmd2-reward-weight", "0.01", "--dmd2-reward-function-path", "miles.eval.digits.reward.digit_log_prob"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dmd2-reward-weight", "0.01"], "--dmd2-reward-weight > 0 needs --dmd2-reward-function-path"),
        (REWARD[2:], "--dmd2-reward-function-path is read by the reward group only: set --dmd2-reward-weight > 0"),
        (["--dmd2-reward-weight", "-1", *REWARD[2:]], "--dmd2-reward-weight must be >= 0"),
    ],
    ids=["weight-without-hook", "hook-without-weight", "negative-weight"],
)
def test_bad_reward_flags_exit_2_in_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*DMD2, *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_bad_reward_hook_path_is_named_before_ray_starts():
    args = parse_args([*DMD2, "--dmd2-reward-weight", "0.01", "--dmd2-reward-function-path", "my_rewards.nope.fn"])
    with pytest.raises(ArgumentValidationError) as exc_info:
        validate_inputs(args, check_paths=False)
    message = str(exc_info.value)
    assert "--dmd2-reward-function-path" in message and "'my_rewards.nope.fn'" in message and "\n" not in message


def test_weight_0_keeps_todays_two_groups_and_a_weight_adds_the_frozen_reward_group_before_the_actor():
    from miles.backends.fsdp_utils.loss_hub.reward import reward_gradient

    plain = build_run_spec(parse_args(DMD2)).groups
    assert [group.role for group in plain] == ["critic", "actor"]
    groups = build_run_spec(parse_args([*DMD2, *REWARD])).groups
    assert [group.role for group in groups] == ["critic", "reward", "actor"]
    assert groups[0] == plain[0] and groups[2] == plain[1]
    reward = groups[1]
    # Frozen: no model source, no steps, no checkpoint, no teacher; the spec says so, no sentinel count does.
    assert not reward.trains and reward.init is None and reward.teacher is None and reward.optimizer is None
    assert reward.checkpoint == CheckpointSpec() and reward.steps_per_rollout == 0
    # Its train output is the reward gradient with the user's reward function, imported once by the driver.
    assert reward.hooks.train_output.func is reward_gradient
    assert reward.hooks.train_output.keywords == {"reward": digit_log_prob}
    assert reward.hooks.prepare is None and reward.hooks.loss is None and reward.hooks.trainer is None
    assert all(group.trains for group in (groups[0], groups[2]))


def test_a_family_without_a_differentiable_decoder_is_refused_in_one_line(tmp_path):
    # The family is read from model_index.json alone: a FLUX.1 pipeline's (its packed latents decode to uint8 only).
    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    args = parse_args([*DMD2, *REWARD])
    args.hf_checkpoint = str(tmp_path)
    with pytest.raises(ArgumentValidationError) as exc_info:
        check_reward_family(args)
    message = str(exc_info.value)
    assert "--dmd2-reward-weight" in message and "DifferentiablePixels" in message and "\n" not in message
