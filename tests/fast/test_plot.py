"""Training plots from a run's metrics.jsonl: which figures exist, that they are real PNGs, de-duplication of a
resumed run, the time breakdown's numbers and the CLI's exit codes.

The metrics files are written by the real ``MetricsTracker`` (so NaN goes through its "nan" encoding), with the
keys and cadence of a real run: per-step train records from the actor and critic groups, per-rollout perf, eval
and health records from the driver.
"""

import logging
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from miles.plot import (
    REST_DRIVER_AND_RAY,
    REST_OF_ROLLOUT,
    collect_series,
    plot_run,
    running_mean,
    time_breakdown,
)
from miles.utils.misc import make_generator
from miles.utils.tracking import MetricsTracker, read_metrics

CRITIC_STEPS = 5  # critic optimizer steps per rollout (actor: one)
NAN_ROLLOUT = 7


def _noise(*ids) -> float:
    return float(torch.rand((), generator=make_generator("test_plot", *ids)))


def _log_rollout(trackers, rollout_id, *, pass_id, dmd2, worker_timers=True, with_step=True):
    """One rollout's records, as the trainer groups and the driver write them."""
    actor, driver = trackers["actor"], trackers["driver"]
    decay = math.exp(-rollout_id / 15)
    if dmd2:
        critic = trackers["critic"]
        for k in range(CRITIC_STEPS):
            step = rollout_id * CRITIC_STEPS + k + 1
            metrics = {
                "train/critic-loss": 2.0 * decay + 0.2 * _noise("critic", pass_id, step),
                "train/critic-grad_norm": 1.5 + _noise("critic-gn", pass_id, step),
                "train/critic-lr": 4e-4,
                "train/critic-step": float(step),
            }
            critic.log({"step": step, **metrics} if with_step else metrics, rollout_id)
    step = rollout_id + 1
    loss = 0.05 * decay + 0.01 * _noise("loss", pass_id, step)
    metrics = {"train/loss": loss, "train/grad_norm": 0.3 * decay + 0.05, "train/lr": 1e-4 * min(1.0, step / 10)}
    metrics["train/step"] = float(step)
    if dmd2:
        metrics.update(
            {
                "train/dmd2_loss": float("nan") if rollout_id == NAN_ROLLOUT else loss,
                "train/dmd2_grad_abs_mean": 0.1 * decay + 1e-3,
                "train/dmd2_nonfinite_frac": 0.0,
                "train/x0_mean_abs_diff": 1e-7 * (1 + rollout_id) ** 3,
                "train/x0_max_abs_diff": 1e-6 * (1 + rollout_id) ** 3,
                "train/x0_rel_max": 1e-7 * (1 + rollout_id) ** 2,
            }
        )
    actor.log({"step": step, **metrics} if with_step else metrics, rollout_id)

    if dmd2 and rollout_id % 10 == 9:
        driver.log(
            {"eval/fd": 20 * decay + 1, "eval/accuracy": 1 - 0.8 * decay, "eval/recall": 0.6 - 0.5 * decay},
            rollout_id,
            images={"eval/samples": f"eval/rollout_{rollout_id}.png"},
        )
    perf = {"perf/rollout_time": 0.4, "perf/actor_train_time": 1.0, "perf/step_time": 3.0 + pass_id}
    if worker_timers:
        perf.update({"perf/actor-wake_time": 0.2, "perf/actor-generate_time": 0.3, "perf/actor-train_steps_time": 0.8})
        perf["perf/actor-sleep_time"] = 0.1
        if dmd2:
            perf.update({"perf/critic-train_steps_time": 0.9, "perf/critic-train_output_time": 0.25})
    driver.log(perf, rollout_id)
    if dmd2:
        driver.log({"health/diversity_ratio": 1.0 - 0.02 * rollout_id, "health/saturated_frac": 0.01}, rollout_id)


def _write_run(run_dir: Path, *, dmd2: bool, **kw) -> Path:
    """40 rollouts; the first job crashes after rollout 24 and a resumed job repeats rollouts 20..39."""
    args = SimpleNamespace(output_dir=str(run_dir), use_wandb=False)
    roles = ("driver", "actor", "critic") if dmd2 else ("driver", "actor")
    for pass_id, rollouts in enumerate((range(25), range(20, 40))):
        trackers = {role: MetricsTracker(args, job=role) for role in roles}
        for rollout_id in rollouts:
            _log_rollout(trackers, rollout_id, pass_id=pass_id, dmd2=dmd2, **kw)
    return run_dir


@pytest.fixture
def dmd2_run(tmp_path):
    return _write_run(tmp_path / "dmd2-run", dmd2=True)


@pytest.fixture
def sft_run(tmp_path):
    return _write_run(tmp_path / "sft-run", dmd2=False)


def _assert_pngs(paths, out_dir, names):
    assert [path.name for path in paths] == names
    assert sorted(path.name for path in out_dir.iterdir()) == sorted(names)  # absent groups: no file at all
    for path in paths:
        assert path.parent == out_dir and path.stat().st_size > 10_000, path
        with Image.open(path) as image:
            assert image.format == "PNG"
            width, height = image.size
            assert 400 <= width <= 4000 and 300 <= height <= 4000, (path.name, image.size)
            image.load()  # decodes the whole file: a truncated PNG raises here


def test_dmd2_run_writes_every_figure(dmd2_run, caplog):
    with caplog.at_level(logging.INFO, logger="miles.plot"):
        paths = plot_run(dmd2_run)
    names = [
        "losses.png",
        "grad_norms.png",
        "learning_rates.png",
        "dmd2.png",
        "eval.png",
        "time_breakdown.png",
        "health.png",
    ]
    _assert_pngs(paths, dmd2_run / "plots", names)
    lines = [record.getMessage() for record in caplog.records if record.name == "miles.plot"]
    assert len(lines) == 1 and all(name in lines[0] for name in names)


def test_sft_run_skips_absent_groups(sft_run, tmp_path):
    out = tmp_path / "elsewhere"
    paths = plot_run(sft_run, out_dir=out)
    _assert_pngs(paths, out, ["losses.png", "grad_norms.png", "learning_rates.png", "time_breakdown.png"])
    assert not (sft_run / "plots").exists()


def test_resumed_rollouts_keep_the_last_value(dmd2_run):
    records = read_metrics(dmd2_run)
    assert any(record.get("train/dmd2_loss") == "nan" for record in records)  # the tracker's encoding
    series = collect_series(records)

    loss = series["train/loss"]
    assert loss.x_label == "optimizer step (actor)"
    np.testing.assert_array_equal(loss.x, np.arange(1, 41))  # rollouts 20..24 logged twice, drawn once
    for rollout_id in (3, 22, 39):
        step = rollout_id + 1
        pass_id = 0 if rollout_id < 20 else 1  # the resumed job's value replaces the crashed job's
        expected = 0.05 * math.exp(-rollout_id / 15) + 0.01 * _noise("loss", pass_id, step)
        assert loss.y[rollout_id] == pytest.approx(expected, rel=1e-12)

    critic = series["train/critic-loss"]
    assert critic.x_label == "optimizer step (critic)"
    np.testing.assert_array_equal(critic.x, np.arange(1, 40 * CRITIC_STEPS + 1))

    dmd2_loss = series["train/dmd2_loss"]
    assert np.flatnonzero(~np.isfinite(dmd2_loss.y)).tolist() == [NAN_ROLLOUT]

    fd = series["eval/fd"]
    assert fd.x_label == "rollout" and fd.x.tolist() == [9, 19, 29, 39]
    assert "eval/samples" not in series  # a path, not a number
    assert "train/step" not in series and "train/critic-step" not in series  # counters are the x axis
    np.testing.assert_array_equal(series["perf/step_time"].y, [3.0] * 20 + [4.0] * 20)


def test_records_without_step_counters_replace_a_repeated_rollout(tmp_path):
    run = _write_run(tmp_path / "legacy", dmd2=True, with_step=False)
    records = read_metrics(run)
    for record in records:  # strip the counters too: positions come from the order within each rollout
        record.pop("train/step", None)
        record.pop("train/critic-step", None)
    critic = collect_series(records)["train/critic-loss"]
    assert critic.x_label == "rollout"
    np.testing.assert_allclose(critic.x, np.arange(40 * CRITIC_STEPS) / CRITIC_STEPS)
    rollout_id, k = 22, 3
    step = rollout_id * CRITIC_STEPS + k + 1
    expected = 2.0 * math.exp(-rollout_id / 15) + 0.2 * _noise("critic", 1, step)
    assert critic.y[rollout_id * CRITIC_STEPS + k] == pytest.approx(expected, rel=1e-12)


def test_time_breakdown_stacks_worker_phases_and_the_rest(dmd2_run, sft_run):
    rollouts, stack = time_breakdown(collect_series(read_metrics(dmd2_run)))
    np.testing.assert_array_equal(rollouts, np.arange(40))
    assert list(stack) == [
        "actor wake",
        "actor generate",
        "actor train steps",
        "actor sleep",
        "critic train steps",
        "critic train output",
        REST_DRIVER_AND_RAY,
    ]
    in_worker = 0.2 + 0.3 + 0.8 + 0.1 + 0.9 + 0.25
    np.testing.assert_allclose(stack[REST_DRIVER_AND_RAY], [3.0 - in_worker] * 20 + [4.0 - in_worker] * 20)
    np.testing.assert_allclose(sum(stack.values()), [3.0] * 20 + [4.0] * 20)  # the stack is the whole rollout

    # Without in-worker timers the driver's own consecutive timers are stacked instead.
    legacy = _write_run(sft_run.parent / "no-worker-timers", dmd2=False, worker_timers=False)
    _, stack = time_breakdown(collect_series(read_metrics(legacy)))
    assert list(stack) == ["rollout", "actor train", REST_OF_ROLLOUT]
    np.testing.assert_allclose(stack[REST_OF_ROLLOUT], [1.6] * 20 + [2.6] * 20)


def test_running_mean_ignores_non_finite_values():
    values = np.array([1.0, 2.0, math.nan, 4.0, 5.0, math.inf])
    np.testing.assert_allclose(running_mean(values, 3), [1.5, 1.5, 3.0, 4.5, 4.5, 5.0])
    assert math.isnan(running_mean(np.array([math.nan, math.nan]), 1)[0])


def test_a_file_without_plottable_keys_writes_nothing(tmp_path):
    MetricsTracker(SimpleNamespace(output_dir=str(tmp_path), use_wandb=False), job="driver").log(
        {"eval/samples_dir": "eval/"}, 0
    )
    (tmp_path / "metrics.jsonl").open("a").write('{"job": "actor", "rollout_id": 1, "train/lo')  # a cut line
    assert plot_run(tmp_path) == []
    assert not (tmp_path / "plots").exists()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "miles.plot", *map(str, args)], capture_output=True, text=True)


def test_cli(dmd2_run, tmp_path):
    out = tmp_path / "cli-plots"
    done = _cli(dmd2_run, "--out", out)
    assert done.returncode == 0, done.stderr
    assert (out / "losses.png").is_file() and (out / "health.png").is_file()

    missing = _cli(tmp_path / "no-such-run")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.splitlines() == [
        f"miles.plot: error: run directory {tmp_path / 'no-such-run'} does not exist"
    ]

    empty = tmp_path / "empty-run"
    empty.mkdir()
    no_metrics = _cli(empty)
    assert no_metrics.returncode == 2 and len(no_metrics.stderr.splitlines()) == 1
    assert "has no metrics.jsonl" in no_metrics.stderr
