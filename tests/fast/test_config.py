"""The run's specs (``miles.config``), built once by the driver (``miles.driver.specs``): frozen, picklable to the
Ray workers (hooks and the family travel by reference), the hooks imported once and named as the user wrote them."""

import copy
import dataclasses
import pickle

import pytest

from miles.config import CheckpointSpec, GroupHooks, GroupSpec, hook_name
from miles.driver.arguments import parse_args
from miles.driver.specs import build_run_spec, resolve_hooks
from miles.utils.paths import sibling_dir
from miles.utils.validation import ArgumentValidationError

BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "3"]
DMD2 = [*BASE, "--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--rollout-batch-size", "4"]
DMD2 += ["--dmd2-critic-steps-per-rollout", "2", "--save", "/ckpt/run"]
PHASE2 = ["--dmd2-gan-disc-weight", "0.01", "--dmd2-gan-real-data", "/data/real.jsonl", "--ema-decay", "0.99"]
REWARD = ["--dmd2-reward-weight", "0.5", "--dmd2-reward-function-path", "miles.eval.digits.reward.digit_log_prob"]


def test_a_dmd2_run_spec_is_frozen_pickles_by_reference_and_leaves_the_args_as_they_were():
    args = parse_args(
        [*DMD2, *PHASE2, *REWARD, "--custom-train-input-function-path", "tests.support.trainer.echo_output"]
    )
    snapshot = copy.deepcopy(vars(args))
    run = build_run_spec(args)
    assert vars(args) == snapshot
    assert run.roles == ["critic", "reward", "actor"] and run.dp_size == 1
    # What a Ray worker receives: the same specs, every hook the same function object (pickled by reference).
    again = pickle.loads(pickle.dumps(run))
    assert again.engine == run.engine and again.group("critic") == run.group("critic")
    assert again.group("actor") == run.group("actor")
    shipped, bound = again.group("reward").hooks.train_output, run.group("reward").hooks.train_output
    assert shipped.func is bound.func and shipped.keywords == bound.keywords  # a partial compares by its parts
    assert again.group("critic").hooks.build_modules is run.group("critic").hooks.build_modules
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.group("actor").optimizer.lr = 1.0
    with pytest.raises(KeyError, match=r"no 'teacher' group \(its groups: \['critic', 'reward', 'actor'\]\)"):
        run.group("teacher")
    # The user's train-input hook runs in every group; the GAN head is the critic's; the EMA is the student's.
    assert {hook_name(group.hooks.train_input) for group in run.groups} == {"tests.support.trainer.echo_output"}
    assert (
        hook_name(run.group("critic").hooks.build_modules)
        == "miles.backends.fsdp_utils.loss_hub.gan.build_discriminator"
    )
    assert run.group("actor").ema.decay == 0.99 and run.group("critic").ema is None
    assert run.group("critic").checkpoint == CheckpointSpec(save=sibling_dir("/ckpt/run", "_critic"))
    assert run.group("reward").checkpoint == CheckpointSpec() and not run.group("reward").trains


def test_each_hook_path_is_imported_once_and_a_bad_one_is_one_line_naming_the_flag():
    args = parse_args([*BASE, "--rollout-batch-size", "4", "--custom-loss-function-path", "my_pkg.nope.loss"])
    with pytest.raises(ArgumentValidationError) as info:
        resolve_hooks(args)
    message = str(info.value)
    assert message.startswith("--custom-loss-function-path: hook path 'my_pkg.nope.loss': cannot import module")
    assert "\n" not in message
    args.custom_loss_function_path = "tests.support.trainer.echo_output"
    hooks = resolve_hooks(args)
    assert hook_name(hooks.group.loss) == "tests.support.trainer.echo_output" and hooks.group.prepare is None
    assert hooks.converter is None and hooks.eval is None and hooks.method == {}


def test_a_users_hook_wins_over_the_methods_and_the_labels_of_a_groups_paths_are_its_own():
    user = GroupHooks(loss=len)
    assert user.over(GroupHooks(prepare=sorted, loss=max)) == GroupHooks(prepare=sorted, loss=len)
    critic = build_run_spec(parse_args([*DMD2, "--critic-load", "/models/critic"])).group("critic")
    assert critic.path_label("init") == "--critic-load" and critic.path_label("teacher") == "--teacher-load"
    assert critic.path_label("save") == "the critic group's --save"
    default = build_run_spec(parse_args(DMD2)).group("critic")
    assert default.path_label("init") == "--teacher-load"  # the critic's init defaults to the teacher
    actor = GroupSpec(role="actor", hooks=GroupHooks(), init="/models/student")
    assert [actor.path_label(name) for name in ("init", "load")] == ["--hf-checkpoint", "--load"]


def test_sibling_dir():
    assert sibling_dir("/ckpt/run", "_critic") == "/ckpt/run_critic"
    assert sibling_dir("/ckpt/run/", "_critic") == "/ckpt/run_critic"
    assert sibling_dir("relative/run", "_critic") == "relative/run_critic"
    assert sibling_dir(None, "_critic") is None
