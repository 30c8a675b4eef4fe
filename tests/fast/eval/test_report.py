"""Summary table, JSON file and wandb logging of result dicts."""

import json

import numpy as np
import pytest

from miles.eval.report import aggregate_seeds, format_summary_table, log_to_wandb, write_summary

RESULTS = [
    {
        "name": "teacher-28",
        "model": "teacher",
        "sampler": "euler",
        "steps": 28,
        "guidance_scale": 3.0,
        "n_samples": 500,
        "seed": 7,
        "n_reference": 359,
        "accuracy": 0.987,
        "fd": 0.5612,
        "precision": 0.9,
        "recall": np.float64(0.75),
        "spread_ratio": 0.83,
        "classifier_heldout_accuracy": 0.98,
        "per_class_accuracy": [1.0] * 9 + [None],
    },
    {
        "name": "student-4",
        "model": "student",
        "sampler": "dmd2",
        "steps": 4,
        "guidance_scale": 1,
        "n_samples": 500,
        "seed": 7,
        "n_reference": 359,
        "accuracy": 0.95,
        "fd": float("nan"),
        "recall": 0.5,
        "spread_ratio": 1.02,
        "classifier_heldout_accuracy": 0.98,
    },
]


def test_write_summary(tmp_path):
    results = RESULTS
    notes = ["How to read the figures.", "A second paragraph."]
    md_path, json_path = write_summary(results, tmp_path / "eval", title="Run 3", notes=notes)
    markdown = open(md_path).read()
    assert markdown.startswith("# Run 3\n\nHow to read the figures.\n\nA second paragraph.\n\n| name |")
    assert (
        "| name | model | sampler | steps | CFG | n | seed | accuracy | FD ↓ | precision | recall | spread |"
        in markdown
    )
    assert "| teacher-28 | teacher | euler | 28 | 3 | 500 | 7 | 98.7% | 0.561 | 0.900 | 0.750 | 0.83 |" in markdown
    assert "| student-4 | student | dmd2 | 4 | 1 | 500 | 7 | 95.0% | nan | – | 0.500 | 1.02 |" in markdown
    data = json.loads(open(json_path).read())
    assert data["title"] == "Run 3"
    assert data["results"][0]["recall"] == 0.75 and data["results"][1]["fd"] is None
    assert format_summary_table([]).count("\n") == 1
    # Without notes the table follows the heading directly.
    md_path, _ = write_summary(results[:1], tmp_path / "plain", stem="s")
    assert open(md_path).read().startswith("# Evaluation\n\n| name |") and md_path.endswith("s.md")


def test_summary_table_with_a_callers_own_columns():
    columns = [("name", "name", str), ("CLIP score ↑", "clip_score", lambda v: f"{float(v):.2f}")]
    table = format_summary_table([{"name": "a", "clip_score": 0.31234}, {"name": "b"}], columns)
    assert table.splitlines() == ["| name | CLIP score ↑ |", "|---|---|", "| a | 0.31 |", "| b | – |"]


def test_log_to_wandb_without_run_is_a_no_op():
    import wandb

    assert wandb.run is None
    assert log_to_wandb([{"name": "x", "fd": 1.0}], {"grid": np.zeros((4, 4), dtype=np.uint8)}, step=3) is False


def test_log_to_wandb_offline_run(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="miles-test")
    try:
        grid = np.zeros((20, 30), dtype=np.uint8)
        result = {"name": "student-4", "accuracy": 0.9, "fd": 0.5, "recall": 0.7, "n_samples": 10, "seed": 1}
        assert log_to_wandb([result], {"grid-student-4": grid}, step=2) is True
    finally:
        run.finish()
    media = list(tmp_path.glob("wandb/offline-run-*/files/media/images/eval_media/grid-student-4_*.png"))
    assert len(media) == 1


def test_aggregate_seeds_gives_means_and_sample_std_and_the_table_shows_both():
    rows = [dict(RESULTS[0], seed=seed, fd=fd, accuracy=acc) for seed, fd, acc in [(0, 1.0, 0.9), (1, 1.2, 0.92)]]
    rows[1]["precision"] = None
    merged = aggregate_seeds(rows)
    assert merged["seed"] == [0, 1] and merged["per_seed"] == rows and merged["n_samples"] == 500
    assert merged["fd"] == pytest.approx(1.1) and merged["fd_std"] == pytest.approx(np.std([1.0, 1.2], ddof=1))
    assert merged["accuracy"] == pytest.approx(0.91) and np.isnan(merged["precision"])
    line = format_summary_table([merged]).splitlines()[2]
    assert line.startswith("| teacher-28 | teacher | euler | 28 | 3 | 500 | 0,1 | 91.0% ± 1.4% | 1.100 ± 0.141 |")
    single = aggregate_seeds(rows[:1])
    assert np.isnan(single["fd_std"]) and "| 1.000 |" in format_summary_table([single])
    with pytest.raises(ValueError, match="one configuration's rows"):
        aggregate_seeds([rows[0], dict(rows[1], name="other")])
