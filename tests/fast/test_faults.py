"""Faults of a real run: the driver killed (-9) during a save and between the groups' saves, a disk that fills
during a save, a student that turns NaN, SIGTERM, and no Ray process outliving a killed driver.

A crash costs at most the rollout in flight: the resume repeats the uninterrupted run's losses exactly, into the
same ``--output-dir`` without duplicate records, and no hand edit is ever needed. The killed drivers are separate
processes (``python -m tests.support.faults``) that join the session's Ray cluster; only the watchdog test starts a
cluster of its own, since that is what it checks. Every process a test starts is ended by its PID.
"""

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from miles.driver import run_dir
from miles.driver.watchdog import descendants, process_start_time
from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.inputs import checkpoint_layout, write_digit_records
from tests.support.trainer import make_pipeline

REPO = Path(__file__).resolve().parents[2]
PREFIX = "train_diffusion.py: error: "
MARKER = ".miles_stage_complete.json"  # what examples/digits/run_digits.py leaves in a finished stage


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    make_pipeline(root / "digits")
    write_digit_records(root / "train.jsonl", 16)
    write_digit_records(root / "prompts.jsonl", 8, images=False)
    return root


def _dmd2(root: Path, out: Path, save: Path, *extra: str) -> list[str]:
    return [
        "--loss-type", "dmd2", "--hf-checkpoint", str(root / "digits"), "--teacher-load", str(root / "digits"),
        "--prompt-data", str(root / "prompts.jsonl"), "--rollout-batch-size", "4", "--micro-batch-size", "2",
        "--dmd2-critic-steps-per-rollout", "2", "--num-rollout", "3", "--lr", "1e-3", "--critic-lr", "1e-3",
        "--num-cpus-per-rank", "1", "--save", str(save), "--save-interval", "1", "--output-dir", str(out), *extra,
    ]  # fmt: skip


def _sft(root: Path, out: Path, save: Path, *extra: str) -> list[str]:
    return [
        "--loss-type", "sft_loss", "--train-only", "--hf-checkpoint", str(root / "digits"),
        "--prompt-data", str(root / "train.jsonl"), "--rollout-batch-size", "8", "--micro-batch-size", "2",
        "--lr", "1e-3", "--num-cpus-per-rank", "1", "--save", str(save), "--save-interval", "1",
        "--output-dir", str(out), *extra,
    ]  # fmt: skip


def _train_figures(out: Path) -> dict[tuple[str, int, int], dict]:
    """Every train record keyed by (group, rollout, step), its train/* figures only; a duplicate key fails."""
    figures = {}
    for record in read_metrics(out):
        keys = {key: value for key, value in record.items() if key.startswith("train/")}
        if not keys:
            continue
        group = "critic" if any(key.startswith("train/critic-") for key in keys) else "actor"
        key = (group, record["rollout_id"], keys.get(f"train/{'critic-' if group == 'critic' else ''}step"))
        assert key not in figures, f"duplicate record {key} in {out}/metrics.jsonl"
        figures[key] = keys
    return figures


def _wait_for_free_cluster(ray, timeout: float = 90) -> None:
    """A dead driver's job ends its actors and placement groups; wait until the cluster has all its CPUs back, so
    that no worker of the killed run still writes while the resume starts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"the killed run's resources were not released: {ray.available_resources()}")


def _run_killed(kill_at: str, rollout_id: int, argv: list[str], ray) -> subprocess.CompletedProcess:
    """Run the command in a driver that kills itself (SIGKILL) at ``kill_at`` of ``rollout_id``."""
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.faults",
            kill_at,
            str(rollout_id),
            "--",
            *argv,
            "--ray-address",
            address,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, stderr[-3000:]
    _wait_for_free_cluster(ray)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def reference(root, ray_cluster):
    """The uninterrupted DMD2 run: 3 rollouts, a commit after each, the student exported from a pipeline that
    carries a recipe's hidden marker."""
    out = root / "reference"
    (root / "digits" / MARKER).write_text('{"finished": "yesterday"}\n')
    try:
        run_main(_dmd2(root, out, root / "reference_ckpt", "--save-hf", str(root / "reference_student")))
    finally:
        (root / "digits" / MARKER).unlink()
    return _train_figures(out)


def test_the_export_carries_no_hidden_file_of_its_source(root, reference):
    export = root / "reference_student"
    assert (export / "model_index.json").is_file() and (export / "transformer").is_dir()
    assert not [str(p) for p in export.rglob(".*")]  # the source's marker stayed behind
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no temporary export left


def test_a_driver_killed_during_a_save_and_between_the_groups_saves_resumes_to_the_uninterrupted_losses(
    root, ray_cluster, reference
):
    out, save = root / "killed", root / "killed_ckpt"
    critic_save = Path(f"{save}_critic")
    argv = _dmd2(root, out, save)
    # 1. Killed while the actor group writes its checkpoint of rollout 1 (the group awake after the rollout saves
    # first: the critic's is not started).
    _run_killed("during-save", 1, argv, ray_cluster)
    assert run_dir.read_latest(save) == 0  # rollout 1 was in flight, whatever the workers had written
    # 2. The same command with --load (no hand edit, no flag to add), killed after the actor saved rollout 2 and
    # before the critic started to.
    _run_killed("between-saves", 2, [*argv, "--load", str(save)], ray_cluster)
    assert run_dir.read_latest(save) == 1
    assert run_dir.complete_rollouts(save) == [0, 1, 2] and run_dir.complete_rollouts(critic_save) == [0, 1]
    # 3. Resumed again, it finishes.
    run_main([*argv, "--load", str(save)])
    assert run_dir.read_latest(save) == 2
    for directory in (save, critic_save):
        assert run_dir.complete_rollouts(directory) == [0, 1, 2]
        assert not [p.name for p in directory.iterdir() if p.name.startswith(".")]
    resumed = _train_figures(out)  # three attempts in one --output-dir, no (group, rollout, step) twice
    assert sorted(resumed) == sorted(reference)
    for key, figures in reference.items():
        assert resumed[key] == figures, key


def test_a_resume_says_where_it_continues_applies_changed_settings_and_continues_the_wandb_run(
    root, ray_cluster, caplog
):
    from miles.driver.resume import read_run_record

    out, save = root / "resume", root / "resume_ckpt"
    argv = _sft(root, out, save, "--num-rollout", "2", "--use-wandb", "--wandb-mode", "offline")
    run_main(argv)
    with caplog.at_level(logging.INFO, logger="train_diffusion"):
        run_main([*argv, "--load", str(save), "--num-rollout", "3", "--lr", "2e-3", "--weight-decay", "0.01"])
    lines = [record.getMessage() for record in caplog.records if record.name == "train_diffusion"]
    assert f"resumed at rollout 2 (actor) from --load {save}" in lines
    assert (
        "resume changes --lr 0.001 -> 0.002, --weight-decay 0.0 -> 0.01, --num-rollout 2 -> 3; the new values apply "
        "from rollout 2"
    ) in lines
    # The checkpoint's lr was 1e-3; the resumed step trains at the command's.
    lrs = {record["rollout_id"]: record["train/lr"] for record in read_metrics(out) if "train/lr" in record}
    assert lrs == {0: 1e-3, 1: 1e-3, 2: 2e-3}
    # Both attempts logged to one wandb run: its id is kept with the checkpoint.
    runs = sorted((out / "wandb").glob("offline-run-*"))
    ids = {run.name.rsplit("-", 1)[-1] for run in runs}
    assert len(runs) == 2 and len(ids) == 1, runs
    record = read_run_record(save, 2)
    assert record["wandb_run_id"] == ids.pop() and record["method"] == "sft_loss"
    assert record["settings"]["lr"] == 2e-3 and record["settings"]["weight_decay"] == 0.01


def test_a_full_disk_reported_in_a_writers_own_words_still_says_no_space_left(tmp_path, monkeypatch):
    """torch's writer reports a full disk as "unexpected pos"; the driver's line says "No space left on device",
    judged by the free space before the partial checkpoint is removed (a real full disk cannot be made here: the
    free space is what ``shutil.disk_usage`` reports while the partial checkpoint exists)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from miles.backends.fsdp_utils import checkpoint
    from miles.utils.validation import CheckpointWriteError

    save = tmp_path / "ckpt"
    real_usage = shutil.disk_usage

    def usage(path):
        partial = any(save.glob(".tmp_rollout_*"))
        return real_usage(path)._replace(free=0) if partial else real_usage(path)

    def failing_save(state, checkpoint_id, **_):
        # What DCP raises: every rank's error wrapped in a CheckpointException.
        Path(checkpoint_id).mkdir(parents=True)
        raise CheckpointException("save failed", {0: (RuntimeError("unexpected pos 4096 vs 8192"), None)})

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", usage)
    monkeypatch.setattr(checkpoint.dcp, "save", failing_save)
    with pytest.raises(CheckpointWriteError) as exc_info:
        checkpoint_layout(save, 0)
    assert str(exc_info.value) == (
        f"could not save the actor checkpoint of rollout 0 to {save}: No space left on device (unexpected pos 4096 vs "
        "8192); no complete checkpoint was touched"
    )
    assert not list(save.iterdir())


def test_a_disk_that_fills_during_a_save_stops_with_no_space_left_and_keeps_the_last_checkpoint(
    root, ray_cluster, capsys
):
    out, save = root / "enospc", root / "enospc_ckpt"
    # From rollout 1 on, the worker's writes under --save hit a 4 KiB quota (a simulated full disk: ENOSPC).
    argv = _sft(root, out, save, "--num-rollout", "3",
                "--custom-train-output-function-path", "tests.support.faults.fill_disk_after_rollout_0")  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 1
    (line,) = [line for line in err.splitlines() if line.startswith(PREFIX)]
    assert line.startswith(
        f"{PREFIX}actor rank 0 failed in save (rollout 1): OSError: could not save the actor checkpoint of rollout 1 "
        f"to {save}: No space left on device"
    ), line
    assert "Traceback" not in err
    assert run_dir.read_latest(save) == 0
    assert sorted(p.name for p in save.iterdir()) == ["latest", "rollout_0"]  # no partial .tmp_rollout_1
    _assert_loads_finite(root, save, 0)


def test_a_nan_student_stops_the_run_at_the_guard_and_the_last_good_checkpoint_stays(root, ray_cluster, capsys):
    out, save = root / "nan", root / "nan_ckpt"
    # An earlier run's checkpoints and the user's own file in --save: --overwrite-save removes only the former.
    checkpoint_layout(save, 7)
    (save / "notes.txt").write_text("mine\n")
    # From rollout 2 on, one weight of the student is NaN; two skipped steps in a row stop the run.
    argv = _sft(root, out, save, "--num-rollout", "4", "--num-steps-per-rollout", "2", "--max-skipped-steps", "2",
                "--custom-prepare-train-batch-path", "tests.support.faults.nan_weight_at_rollout_2",
                "--overwrite-save")  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 1
    (line,) = [line for line in err.splitlines() if line.startswith(PREFIX)]
    assert line == (
        f"{PREFIX}actor rank 0 failed in train (rollout 2): FloatingPointError: actor group, rollout 2: 2 optimizer "
        "steps in a row had a non-finite gradient norm (first non-finite figure train/loss=nan); stopping so that "
        "no NaN reaches the weights (--max-skipped-steps)"
    ), line
    assert "Traceback" not in err
    records = [r for r in read_metrics(out) if "train/loss" in r]
    assert [r["rollout_id"] for r in records] == [0, 0, 1, 1]  # rollout 2 never logged: it stopped inside
    assert all(math.isfinite(r["train/loss"]) and r["train/skipped_steps"] == 0 for r in records)
    assert run_dir.read_latest(save) == 1 and run_dir.complete_rollouts(save) == [0, 1]
    assert sorted(p.name for p in save.iterdir()) == ["latest", "notes.txt", "rollout_0", "rollout_1"]
    _assert_loads_finite(root, save, 1)


def _assert_loads_finite(root: Path, save: Path, rollout_id: int) -> None:
    """The committed checkpoint (written by 2 ranks) loads into a fresh 1-rank trainer without a process group and
    its weights are finite."""
    from tests.support.trainer import make_args, make_trainer

    assert run_dir.resume_rollout([save]) == rollout_id
    trainer = make_trainer(make_args(root / "digits", root, prompt_data=str(root / "train.jsonl")))
    model = trainer.models.denoiser
    before = [p.detach().clone() for p in model.parameters()]
    trainer.load(str(save), rollout_id)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the trained weights, not init


def test_sigterm_ends_the_run_with_exit_code_143(root, ray_cluster):
    out, save = root / "sigterm", root / "sigterm_ckpt"
    address = ray_cluster.get_runtime_context().gcs_address
    argv = _sft(root, out, save, "--num-rollout", "200", "--save-interval", "100", "--ray-address", address)
    proc = subprocess.Popen([sys.executable, "train_diffusion.py", *argv], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        # Signal once it trains (its first rollout logged).
        _wait_until(lambda: any("train/loss" in r for r in read_metrics(out)), proc, timeout=120)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr[-3000:]
    assert "interrupted by SIGTERM" in stderr and "Traceback" not in stderr
    _wait_for_free_cluster(ray_cluster)


def _wait_until(condition, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended early ({proc.returncode})"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_no_ray_process_outlives_a_driver_killed_with_sigkill(root, tmp_path):
    """A driver that started its own Ray cluster is killed with -9 mid-run; its watchdog ends every process of
    that cluster (gcs, raylet, agents, workers) within seconds."""
    out = tmp_path / "out"
    argv = _sft(root, out, tmp_path / "ckpt", "--num-rollout", "500", "--save-interval", "1000")
    # Ray's sockets live under its temp dir, whose path must stay short (a Unix socket path has ~107 bytes).
    ray_tmp = tempfile.mkdtemp(prefix="ray_", dir="/tmp")
    log = open(tmp_path / "driver.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "train_diffusion.py", *argv], cwd=REPO, env={**os.environ, "RAY_TMPDIR": ray_tmp},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    started: dict[int, int] = {}
    try:
        ready = lambda: any("train/loss" in r for r in read_metrics(out))  # noqa: E731
        try:
            _wait_until(ready, proc, timeout=240)
        except AssertionError:
            raise AssertionError((tmp_path / "driver.log").read_text()[-3000:]) from None
        # Every process the driver started, with its start time (a pid reused later is someone else's).
        for pid in descendants({proc.pid}):
            start = process_start_time(pid)
            if start is not None:
                started[pid] = start
        names = {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace") for pid in started}
        assert any("raylet" in name for name in names) and any("gcs_server" in name for name in names), names
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        alive = dict(started)
        while alive and time.monotonic() < deadline:
            alive = {pid: start for pid, start in alive.items() if process_start_time(pid) == start}
            time.sleep(0.2)
        commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in alive}
        assert not alive, f"outlived the driver: {commands}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid, start in started.items():
            if process_start_time(pid) == start:
                os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_a_resume_into_the_same_output_dir_moves_aside_the_records_it_logs_again(tmp_path):
    from miles.utils.tracking import drop_records_from, move_aside_earlier_metrics

    lines = [{"job": "driver", "rollout_id": r, "train/loss": float(r)} for r in (0, 1, 1, 2, 3)]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (tmp_path / "metrics.jsonl").write_text(text + '{"job": "dri')
    moved, aside = drop_records_from(tmp_path, 2)  # rollouts 2 and 3, and the line a crash cut short
    assert moved == 3 and aside == tmp_path / "metrics.before-resume-2.jsonl"
    assert [r["rollout_id"] for r in read_metrics(tmp_path)] == [0, 1, 1]
    # Nothing is lost: the moved lines, in order, are beside it.
    assert aside.read_text() == "".join(json.dumps(line) + "\n" for line in lines[3:]) + '{"job": "dri\n'
    assert not list(tmp_path.glob(".*"))
    # A second resume at the same rollout does not overwrite the first one's file.
    (tmp_path / "metrics.jsonl").write_text(text)
    assert drop_records_from(tmp_path, 2)[1] == tmp_path / "metrics.before-resume-2.1.jsonl"
    # A run that does not resume starts its own file; the earlier one keeps every line under a new name.
    assert move_aside_earlier_metrics(tmp_path) == tmp_path / "metrics.earlier.jsonl"
    assert not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "metrics.earlier.jsonl").read_text() == "".join(json.dumps(line) + "\n" for line in lines[:3])
    assert move_aside_earlier_metrics(tmp_path) is None
