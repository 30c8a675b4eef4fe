"""DMD2 + reward (DMDR) end to end through ``train_diffusion.main``: the frozen reward group sits between the critic
and the actor on the tiny digits pipeline, ships each pair's reward gradient (the digits logistic-regression reward),
and the student takes it; the reward group saves nothing, and a resume from a mid-run commit repeats the figures
exactly. 1 DP rank on CPU (each group one process: the resume doubles the start-up), three colocated groups,
inside the session's Ray cluster."""

import json
import math

import pytest

from miles.eval.digits.data import prompt_for_label
from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.trainer import make_pipeline

REWARD = "miles.eval.digits.reward.digit_log_prob"
REWARD_ACTOR = ["train/dmd2_reward", "train/dmd2_reward_dm_grad_ratio"]


def _argv(root, out, *extra):
    return [
        "--loss-type", "dmd2", "--hf-checkpoint", str(root / "digits"), "--teacher-load", str(root / "digits"),
        "--prompt-data", str(root / "prompts.jsonl"), "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "4",
        "--micro-batch-size", "1", "--dmd2-critic-steps-per-rollout", "2", "--num-rollout", "2", "--lr", "1e-3",
        "--dmd2-reward-weight", "0.05", "--dmd2-reward-function-path", REWARD, "--output-dir", str(out), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("reward_e2e")
    make_pipeline(root / "digits")
    prompts = "".join(json.dumps({"prompt": prompt_for_label(d)}) + "\n" for d in range(10))
    (root / "prompts.jsonl").write_text(prompts)
    save, out = root / "ckpt", root / "full"
    run_main(_argv(root, out, "--save", str(save), "--save-interval", "1"))
    return {"root": root, "save": save, "records": read_metrics(out)}


def test_the_student_takes_the_reward_groups_gradient_and_the_reward_group_saves_nothing(run):
    actor = [r for r in run["records"] if "train/loss" in r]
    assert len(actor) == 2
    for record in actor:
        assert all(math.isfinite(record[key]) for key in REWARD_ACTOR)
        assert record["train/dmd2_reward"] < 0  # a log-probability
        assert record["train/dmd2_reward_dm_grad_ratio"] > 0
    assert any("perf/reward-train_output_time" in r for r in run["records"])
    assert not any(key.startswith("train/reward-") for r in run["records"] for key in r)  # no optimizer, no loss
    save = run["save"]
    assert (save / "rollout_1").is_dir() and (save.parent / "ckpt_critic" / "rollout_1").is_dir()
    assert not (save.parent / "ckpt_reward").exists()


def test_resume_with_the_reward_group_repeats_the_figures_exactly(run):
    root, save = run["root"], run["save"]
    (save / "latest").write_text("0\n")  # as if the run had died during rollout 1
    out = root / "resumed"
    run_main(_argv(root, out, "--save", str(save), "--load", str(save)))
    resumed = read_metrics(out)
    for key in ["train/loss", "train/critic-loss", *REWARD_ACTOR]:
        full = [r[key] for r in run["records"] if key in r and r["rollout_id"] == 1]
        again = [r[key] for r in resumed if key in r and r["rollout_id"] == 1]
        assert full and again == full, key
