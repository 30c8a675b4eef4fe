"""One job is one wandb run: a short DMD2 run with ``--use-wandb`` (offline) leaves exactly one run, holding the
train, perf, health and eval scalars and the eval media (the sample grid and the DMD2 debug grid), read back from
the run's own transaction log."""

import json

import pytest

from tests.support.driver import run_main
from tests.support.trainer import make_pipeline
from tests.support.wandb_log import history_rows


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_cluster):
    from miles.eval.digits.data import prompt_for_label

    root = tmp_path_factory.mktemp("wandb_run")
    pipeline = make_pipeline(root / "digits")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": prompt_for_label(d)}) + "\n" for d in range(4)))
    (root / "eval.jsonl").write_text(
        "".join(json.dumps({"prompt": prompt_for_label(d), "label": d}) + "\n" for d in range(10))
    )
    out = root / "run"
    argv = [
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", str(root / "prompts.jsonl"), "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--micro-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2", "--num-rollout", "2",
        "--eval-interval", "2", "--eval-prompt-data", str(root / "eval.jsonl"), "--eval-n-samples-per-prompt", "2",
        "--eval-function-path", "miles.eval.digits.digits_eval_hook", "--use-wandb", "--wandb-mode", "offline",
        "--output-dir", str(out),
    ]  # fmt: skip
    run_main(argv)
    return out


def test_the_job_leaves_exactly_one_wandb_run(run):
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    assert len(list(runs[0].glob("run-*.wandb"))) == 1


def test_the_run_holds_train_eval_and_health_scalars_and_the_eval_media(run):
    (log,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    rows = history_rows(log)
    keys = set().union(*rows)
    for key in ("train/loss", "train/critic-loss", "train/dmd2_grad_abs_mean", "perf/step_time", "eval/fd",
                "eval/accuracy", "health/diversity_ratio"):  # fmt: skip
        assert key in keys, key
    # The critic's K = 2 steps and the actor's one step of each rollout are rows keyed by the rollout id.
    assert sorted(r["rollout_id"] for r in rows if "train/critic-loss" in r) == [0, 0, 1, 1]
    media = {key.split("/_type")[0] for key in keys if key.endswith("/_type")}
    assert media == {"eval/samples", "eval/dmd2_debug"}
    for name in media:
        (row,) = [r for r in rows if f"{name}/path" in r]
        assert row[f"{name}/_type"] == "image-file" and row["rollout_id"] == 1
        assert (log.parent / "files" / row[f"{name}/path"]).is_file()
