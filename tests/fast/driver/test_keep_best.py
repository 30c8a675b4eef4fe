"""``--keep-best`` without Ray: the flag's value, the best-so-far rule (strict, NaN never), its restore on a resume,
the missing-figure error, and pruning that spares the best rollout. End to end: tests/fast/test_keep_best_e2e.py."""

import math

import pytest

from miles.driver.keep_best import KeepBest, best_export_dir, parse_keep_best
from miles.driver.run_dir import complete_rollouts, prune
from miles.utils.validation import ArgumentValidationError, RunError
from tests.support.inputs import checkpoint_layout


def test_the_value_names_a_figure_and_a_direction():
    assert parse_keep_best("fd:min") == ("eval/fd", "min")
    assert parse_keep_best("eval/accuracy:max") == ("eval/accuracy", "max")
    assert parse_keep_best("disc:prompt_auc:max") == ("eval/disc:prompt_auc", "max")  # the last colon splits
    for spec, message in (
        ("fd", "--keep-best fd needs a direction: fd:min (lower is better: an FD, a loss) or fd:max"),
        ("fd:lowest", "--keep-best fd:lowest: the direction must be min or max, got 'lowest'"),
        (":min", "--keep-best :min names no evaluation figure"),
        ("f d:min", "--keep-best f d:min: 'f d' is not an evaluation figure's name (it holds a space)"),
    ):
        with pytest.raises(ArgumentValidationError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            parse_keep_best(spec)
    assert best_export_dir("out/student/") == best_export_dir("out/student").with_name("student-best")


def test_only_a_strictly_better_finite_value_is_a_new_best():
    best = KeepBest("eval/fd", "min")
    steps = [
        (0, 3.0, True),
        (1, math.nan, False),
        (2, 1.5, True),
        (3, 1.5, False),
        (4, math.inf, False),
        (5, 2.0, False),
    ]
    for rollout, value, new in steps:
        assert best.update({"eval/fd": value, "eval/accuracy": 0.5}, rollout) is new, rollout
    assert best.state() == {"metric": "eval/fd", "mode": "min", "value": 1.5, "rollout_id": 2}
    highest = KeepBest("eval/reward", "max")
    assert [highest.update({"eval/reward": v}, r) for r, v in enumerate((0.1, 0.3, 0.2, 0.4))] == [
        True,
        True,
        False,
        True,
    ]
    assert (highest.value, highest.rollout_id) == (0.4, 3)
    with pytest.raises(
        RunError,
        match=r"--keep-best fd:min: the evaluation after rollout 7 logged no eval/fd \(it logged eval/accuracy, eval/recall\)",
    ):
        best.update({"eval/accuracy": 0.9, "eval/recall": 0.5, "health/eval_diversity": 0.1}, 7)


def test_a_resume_takes_the_better_of_the_record_and_the_export_of_the_same_figure():
    record = {"metric": "eval/fd", "mode": "min", "value": 1.2, "rollout_id": 99}
    export = {"metric": "eval/fd", "mode": "min", "value": 1.1, "rollout_id": 149}  # exported, then a crash
    best = KeepBest("eval/fd", "min")
    assert best.restore(record, export) == ["--keep-best: the best eval/fd so far is 1.1 after rollout 149"]
    assert (best.value, best.rollout_id) == (1.1, 149)
    other = KeepBest("eval/fd", "max")
    assert other.restore(record, None) == ["--keep-best fd:max starts afresh: the saved best tracks eval/fd (min)"]
    assert other.rollout_id is None and other.summary("ckpt", None).startswith("--keep-best: no evaluation gave")


def test_pruning_spares_the_best_rollout_while_it_is_the_best(tmp_path):
    save = tmp_path / "ckpt"
    for rollout in range(5):
        checkpoint_layout(save, rollout)
    assert prune([save], 4, keep_last=2, keep_every=None, keep=(1,)) == [save / "rollout_0", save / "rollout_2"]
    assert complete_rollouts(save) == [1, 3, 4]
    checkpoint_layout(save, 5)
    # A newer best (rollout 4): rollout 1 is prunable again.
    prune([save], 5, keep_last=2, keep_every=None, keep=(4,))
    assert complete_rollouts(save) == [4, 5]


def test_the_dry_run_says_where_the_best_rollout_is_kept(tmp_path, caplog):
    import json

    from miles.driver.arguments import parse_args
    from miles.driver.plan import log_eval_plan

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(4)))
    args = parse_args(["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(prompts), "--num-rollout", "4",
                       "--rollout-batch-size", "4", "--eval-interval", "2", "--keep-best", "accuracy:max",
                       "--save", str(tmp_path / "ckpt"), "--save-hf", str(tmp_path / "student")])  # fmt: skip
    with caplog.at_level("INFO", logger="miles.driver.plan"):
        log_eval_plan(args)
    assert (
        f"keep best: the rollout of the highest eval/accuracy, its checkpoint spared in {tmp_path / 'ckpt'} and its "
        f"student exported to {tmp_path / 'student-best'}"
    ) in [record.getMessage() for record in caplog.records]
