"""``--loss-type dmd2`` with a reward (``miles.methods.dmd2_reward``): its flags' one-line rejections, the bad hook
path named before Ray starts, and the frozen reward group the method adds only with a weight."""

import pytest

from miles.driver.arguments import parse_args
from miles.driver.preflight import validate_inputs
from miles.methods import compute_trainer_configs
from miles.methods.dmd2_reward import REWARD_GROUP_OVERRIDES, check_reward_family
from miles.utils.trainer_config import compute_trainer_args, trains
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
    plain = compute_trainer_configs(parse_args(DMD2))
    assert [config.role for config in plain] == ["critic", "actor"]
    args = parse_args([*DMD2, *REWARD])
    configs = compute_trainer_configs(args)
    assert [config.role for config in configs] == ["critic", "reward", "actor"]
    assert configs[0] == plain[0] and configs[2] == plain[1]
    reward = compute_trainer_args(args, configs[1])
    assert configs[1].overrides == REWARD_GROUP_OVERRIDES
    assert not trains(reward) and reward.save is None and reward.load is None and reward.teacher_load is None
    assert reward.custom_trainer_path == "miles.backends.fsdp_utils.frozen_trainer.FrozenGroupTrainer"
    assert all(trains(compute_trainer_args(args, config)) for config in (configs[0], configs[2]))


def test_a_family_without_a_differentiable_decoder_is_refused_in_one_line(tmp_path):
    # The family is read from model_index.json alone: a FLUX.1 pipeline's (its packed latents decode to uint8 only).
    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    args = parse_args([*DMD2, *REWARD])
    args.hf_checkpoint = str(tmp_path)
    with pytest.raises(ArgumentValidationError) as exc_info:
        check_reward_family(args)
    message = str(exc_info.value)
    assert "--dmd2-reward-weight" in message and "DifferentiablePixels" in message and "\n" not in message
