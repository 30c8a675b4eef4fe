"""MetricsTracker: JSONL records in the run directory, image paths as wandb media, and an offline wandb run when
asked."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from miles.eval.grids import save_image_grid
from miles.utils.tracking import METRICS_FILE, MetricsTracker, read_metrics


def test_jsonl_records_from_two_writers(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path / "run"), use_wandb=False)
    actor, driver = MetricsTracker(args, job="actor"), MetricsTracker(args, job="driver")
    actor.log({"train/loss": torch.tensor(0.25), "train/lr": 1e-3}, rollout_id=0)
    driver.log({"perf/step_time": 1.5, "bad": float("nan")}, rollout_id=0)
    actor.log({"train/loss": 0.125}, rollout_id=1)
    records = read_metrics(args.output_dir)
    assert [(r["job"], r["rollout_id"]) for r in records] == [("actor", 0), ("driver", 0), ("actor", 1)]
    assert records[0]["train/loss"] == 0.25 and records[0]["train/lr"] == 1e-3
    assert records[1]["bad"] == "nan"  # still valid JSON
    assert (tmp_path / "run" / METRICS_FILE).read_text().count("\n") == 3
    assert read_metrics(tmp_path / "missing") == []


def test_wandb_runs_offline_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = SimpleNamespace(
        output_dir=str(tmp_path), use_wandb=True, wandb_project="miles-test", wandb_mode="offline", wandb_run_name=None
    )
    tracker = MetricsTracker(args, job="critic")
    try:
        assert tracker._wandb_run.settings.mode == "offline"
        tracker.log({"train/critic-loss": 0.5}, rollout_id=3)
    finally:
        tracker.finish()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert read_metrics(tmp_path)[0]["train/critic-loss"] == 0.5


def test_tracker_records_image_paths_and_sends_them_to_wandb_as_media(tmp_path, monkeypatch):
    png = save_image_grid(np.full((1, 8, 8), 128, dtype=np.uint8), tmp_path / "grid.png")
    args = SimpleNamespace(output_dir=str(tmp_path / "run"), use_wandb=False)
    MetricsTracker(args, job="driver").log({"eval/accuracy": 0.5}, 7, images={"eval/samples": Path(png)})
    [record] = read_metrics(args.output_dir)
    assert (record["rollout_id"], record["eval/accuracy"], record["eval/samples"]) == (7, 0.5, png)

    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb_args = SimpleNamespace(
        output_dir=str(tmp_path / "wb"),
        use_wandb=True,
        wandb_project="miles-test",
        wandb_mode=None,
        wandb_run_name=None,
    )
    tracker = MetricsTracker(wandb_args, job="driver")
    try:
        tracker.log({"eval/accuracy": 0.25}, 2, images={"eval/samples": png})
        run_dir = Path(tracker._wandb_run.dir)
    finally:
        tracker.finish()
    assert read_metrics(wandb_args.output_dir)[0]["eval/samples"] == png
    # wandb copies logged images into the run's media folder.
    assert list((run_dir / "media" / "images").glob("eval/samples_*.png"))
