"""Each trainer group's own copy of the args (seed [DMD2 1/10]); the groups of each loss type are tested in
tests/fast/methods."""

import argparse
import copy

import pytest

from miles.driver.arguments import parse_args
from miles.utils.trainer_config import TrainerConfig, compute_trainer_args, sibling_dir

BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "3"]


def _diff(before: argparse.Namespace, after: argparse.Namespace) -> dict:
    """name → (before, after) for every attribute that differs (or exists on one side only)."""
    old, new = vars(before), vars(after)
    return {name: (old.get(name), new.get(name)) for name in old.keys() | new.keys() if old.get(name) != new.get(name)}


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
    # Known means "on the parsed args" (every parser dest, plus what a caller set on them), not "a parser dest".
    args.my_hook_setting = 1
    assert compute_trainer_args(args, TrainerConfig("critic", {"my_hook_setting": 2})).my_hook_setting == 2
    assert args.my_hook_setting == 1


def test_sibling_dir():
    assert sibling_dir("/ckpt/run", "_critic") == "/ckpt/run_critic"
    assert sibling_dir("/ckpt/run/", "_critic") == "/ckpt/run_critic"
    assert sibling_dir("relative/run", "_critic") == "relative/run_critic"
    assert sibling_dir(None, "_critic") is None
