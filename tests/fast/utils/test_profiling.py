"""``--profile-rollouts``: the range flag, and a ``GroupTrainer`` at world size 1 (no Ray) that traces only the
chosen rollout and trains exactly as an untraced one. The per-rank traces of a Ray run are checked in
``tests/fast/test_dmd2_e2e.py``."""

import argparse
import json

import pytest
import torch

from miles.driver.arguments import parse_args
from miles.models import get_model_family
from miles.utils.collectives import LocalCollectives
from miles.utils.profiling import rollout_range
from tests.support.trainer import digits_pairs, make_args, make_pipeline, make_trainer


@pytest.mark.parametrize("text, expected", [("0", (0, 1)), ("5", (5, 6)), ("5:8", (5, 8))])
def test_a_rollout_range_is_a_python_slice(text, expected):
    assert rollout_range(text) == expected


@pytest.mark.parametrize("text", ["", "a", "3:", "-1", "4:4", "5:2", "1:2:3"])
def test_a_bad_rollout_range_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        rollout_range(text)


def test_a_bad_flag_exits_with_one_line_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--profile-rollouts", "5:2"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().startswith("train_diffusion.py: error: argument --profile-rollouts")


def test_profile_flags_that_cannot_trace_anything_are_refused(tmp_path, capsys):
    base = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/p.jsonl", "--num-rollout", "4"]
    base += ["--rollout-batch-size", "4"]
    assert parse_args([*base, "--profile-rollouts", "3:9"]).profile_rollouts == (3, 9)  # cut at the last rollout
    for extra, message in (
        (
            ["--profile-rollouts", "4:6"],
            "--profile-rollouts 4:6 starts after the run's last rollout (--num-rollout 4)",
        ),
        (["--profile-dir", str(tmp_path)], "--profile-dir names where --profile-rollouts writes its traces"),
        (["--profile-rollouts", "1", "--profile-dir", ""], "--profile-dir names where --profile-rollouts writes"),
    ):
        with pytest.raises(SystemExit):
            parse_args([*base, *extra])
        assert capsys.readouterr().err.strip().startswith(f"train_diffusion.py: error: {message}")


def test_the_trainer_traces_only_the_chosen_rollout_and_trains_the_same(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    losses = {}
    for name, rollouts in (("plain", None), ("traced", (1, 2))):
        args = make_args(pipeline, tmp_path / name, num_steps_per_rollout=2, profile_rollouts=rollouts)
        torch.manual_seed(args.seed)
        trainer = make_trainer(args, family=family, collectives=LocalCollectives())
        losses[name] = [
            record["train/loss"]
            for rollout_id in range(3)
            for record in trainer.train(rollout_id, digits_pairs(family, rollout_id, 8), {})[1]
        ]
    assert losses["traced"] == losses["plain"]
    assert not (tmp_path / "plain" / "out" / "profiles").exists()
    traced = tmp_path / "traced" / "out" / "profiles"
    assert [path.relative_to(traced).as_posix() for path in sorted(traced.rglob("*"))] == [
        "rollout_000001",
        "rollout_000001/actor-rank0-train.json",
        "rollout_000001/actor-rank0-train.txt",
    ]
    events = json.loads((traced / "rollout_000001" / "actor-rank0-train.json").read_text())["traceEvents"]
    spans = [event["name"] for event in events if event.get("cat") == "user_annotation"]
    assert spans.count("train_steps") == 2 and "train_output" not in spans  # two windows; no train-output hook
