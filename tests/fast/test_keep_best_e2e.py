"""``--keep-best``, DMD's regression loss and the evaluation's collapse figures end to end through
``train_diffusion.main`` on the tiny digits pipeline: one DMD2 run of 4 rollouts with the regression term on cached
teacher pairs, an evaluation after every rollout whose scripted ``score`` is best after rollout 1
(``tests.support.trainer.SCRIPTED_SCORES``: 3, 1, 2, 4), ``--save-keep-last 1`` and ``--save-hf``. 1 DP rank on CPU,
inside the session's Ray cluster; a 2-rollout run gives the weights rollout 1 ended with, and a resume from
rollout 1 checks that the best survives it.
"""

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from miles.eval.digits.data import prompt_for_label
from miles.plot import collect_series, plot_run
from miles.rollout.regression_pairs import write_regression_pairs
from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.trainer import make_pipeline

KEEP = ["--keep-best", "score:min", "--eval-interval", "1", "--eval-function-path",
        "tests.support.trainer.scripted_eval_hook"]  # fmt: skip


def _argv(root: Path, out: Path, num_rollout: int, *extra: str) -> list[str]:
    return [
        "--loss-type", "dmd2", "--hf-checkpoint", str(root / "digits"), "--teacher-load", str(root / "digits"),
        "--prompt-data", str(root / "prompts.jsonl"), "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "2",
        "--micro-batch-size", "1", "--dmd2-critic-steps-per-rollout", "2", "--num-rollout", str(num_rollout),
        "--lr", "1e-3", "--dmd2-regression-weight", "0.25", "--dmd2-regression-pairs", str(root / "pairs" / "pairs.jsonl"),
        "--output-dir", str(out), *extra,
    ]  # fmt: skip


def _weights(export: Path) -> dict:
    return load_file(str(export / "transformer" / "diffusion_pytorch_model.safetensors"))


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("keep_best_e2e")
    make_pipeline(root / "digits")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": prompt_for_label(d)}) + "\n" for d in range(10)))
    write_regression_pairs(root / "digits", root / "prompts.jsonl", root / "pairs", num_pairs=6, num_steps=2)
    eval_prompts = root / "eval_prompts.jsonl"
    eval_prompts.write_text("".join(json.dumps({"prompt": prompt_for_label(d)}) + "\n" for d in (1, 7)))
    save, export, out = root / "ckpt", root / "student", root / "full"
    keep = [*KEEP, "--eval-prompt-data", str(eval_prompts), "--eval-n-samples-per-prompt", "3"]
    run_main(_argv(root, out, 4, *keep, "--save", str(save), "--save-keep-last", "1", "--save-hf", str(export)))
    # The same training stopped after rollout 1: the weights the best export must hold.
    run_main(_argv(root, root / "two", 2, "--save-hf", str(root / "two-export")))
    return {"root": root, "save": save, "export": export, "out": out, "keep": keep, "records": read_metrics(out)}


def test_the_best_rollout_is_kept_beside_the_last_and_exported(run):
    save, export = run["save"], run["export"]
    # Rollout 1 scored best: its checkpoint outlives --save-keep-last 1 beside the last one's.
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("rollout_")) == ["rollout_1", "rollout_3"]
    assert sorted(p.name for p in (save.parent / "ckpt_critic").iterdir() if p.name.startswith("rollout_")) == [
        "rollout_1", "rollout_3"]  # fmt: skip
    record = json.loads((save / "rollout_3" / "run.json").read_text())
    assert record["keep_best"] == {"metric": "eval/score", "mode": "min", "value": 1.0, "rollout_id": 1}
    assert json.loads((save / "rollout_1" / "run.json").read_text())["keep_best"]["rollout_id"] == 1
    best = export.with_name("student-best")
    assert json.loads((best / "keep_best.json").read_text()) == record["keep_best"]
    # The best export holds rollout 1's student (rollout 2's worse score did not replace it), the last export
    # rollout 3's.
    two = _weights(run["root"] / "two-export")
    assert all((_weights(best)[key] == value).all() for key, value in two.items())
    assert any((_weights(export)[key] != value).any() for key, value in two.items())
    assert (best / "model_index.json").is_file() and not (best / "lora").exists()


def test_metrics_name_each_new_best_and_the_run_ends_naming_it(run):
    bests = [(r["rollout_id"], r["best/score"]) for r in run["records"] if "best/rollout_id" in r]
    assert bests == [(0, 3.0), (1, 1.0)]
    assert [r["eval/score"] for r in run["records"] if "eval/score" in r] == [3.0, 1.0, 2.0, 4.0]


def test_the_regression_term_is_logged_and_added_to_the_students_loss(run):
    actor = [r for r in run["records"] if "train/loss" in r]
    assert len(actor) == 4
    for record in actor:
        assert math.isfinite(record["train/dmd2_regression_loss"]) and record["train/dmd2_regression_loss"] > 0
        assert record["train/loss"] == pytest.approx(
            record["train/dmd2_loss"] + 0.25 * record["train/dmd2_regression_loss"], rel=1e-5
        )


def test_every_evaluation_logs_and_plots_the_collapse_figures(run):
    evals = [r for r in run["records"] if "eval/score" in r]
    for record in evals:
        assert 0 < record["health/eval_diversity"] < 1 and 0 <= record["health/eval_saturated_frac"] <= 1
    series = collect_series(run["records"])
    assert series["health/eval_diversity"].x.tolist() == [0.0, 1.0, 2.0, 3.0]
    paths = plot_run(run["out"], run["root"] / "plots")
    assert run["root"] / "plots" / "health.png" in paths


def test_a_resume_continues_from_the_best_and_does_not_replace_it_with_a_worse_rollout(run, caplog):
    root, save, export = run["root"], run["save"], run["export"]
    best = export.with_name("student-best")
    before = _hashes(best)
    # As if the run had died during rollout 2: the commit names rollout 1, and no last export was written.
    (save / "latest").write_text("1\n")
    shutil.rmtree(export)
    out = root / "resumed"
    argv = _argv(root, out, 4, *run["keep"], "--save", str(save), "--save-keep-last", "1", "--save-hf", str(export))
    with caplog.at_level("INFO", logger="train_diffusion"):
        run_main([*argv, "--load", str(save)])
    lines = [r.getMessage() for r in caplog.records if r.name == "train_diffusion"]
    assert "--keep-best: the best eval/score so far is 1 after rollout 1" in lines
    assert f"best eval/score 1 (min) after rollout 1: checkpoint {save / 'rollout_1'}, export {best}" in lines
    resumed = read_metrics(out)
    assert [r["eval/score"] for r in resumed if "eval/score" in r] == [2.0, 4.0]
    assert not any("best/rollout_id" in r for r in resumed)  # rollout 2's 2.0 is no new best after the resume
    assert _hashes(best) == before
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("rollout_")) == ["rollout_1", "rollout_3"]
