"""The sync driver: dry run, the hand-off between trainer groups, and SFT on real digits through the CLI."""

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

import train_diffusion
from miles.eval.digits.data import write_digits_jsonl
from miles.ray.actor_group import RayTrainGroup
from miles.ray.placement_group import bundle_cpus, create_placement_groups, create_rollout_manager, trainer_resources
from miles.utils.tracking import MetricsTracker, read_metrics
from tests.support.ray import REPO
from tests.support.trainer import make_args, make_pipeline, run_spec


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return Path(write_digits_jsonl(tmp_path_factory.mktemp("data"), prompt_repeats=1)["train"])


def _cli(pipeline, data, run_dir, *extra):
    return [
        "--loss-type", "sft_loss", "--train-only", "--hf-checkpoint", str(pipeline), "--prompt-data", str(data),
        "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "8", "--micro-batch-size", "2", "--lr", "1e-3",
        "--output-dir", str(run_dir), *extra,
    ]  # fmt: skip


def test_dry_run_logs_groups_placement_and_schedule_without_ray(pipeline, data, tmp_path, caplog):
    was_initialized = ray.is_initialized()
    pgs_before = ray.util.placement_group_table() if was_initialized else None
    argv = _cli(pipeline, data, tmp_path / "run", "--num-rollout", "5", "--save", str(tmp_path / "ckpt"))
    with caplog.at_level(logging.INFO):
        train_diffusion.main([*argv, "--save-interval", "2", "--dry-run"])
    text = caplog.text
    # Nothing started: no Ray of its own, nothing placed on the session's cluster if one is up.
    assert ray.is_initialized() is was_initialized
    if was_initialized:
        assert ray.util.placement_group_table() == pgs_before
    assert "placement: 2 bundles of {CPU: c}" in text or "placement: 2 bundles of {GPU: 1, CPU: c}" in text
    assert "rollout: none (--train-only): each actor rank reads its share of the data" in text
    assert f"  actor  {pipeline}  -        0.001  1              {tmp_path / 'ckpt'}  -" in text
    assert "  group actor:\n" in text  # its hooks by name, the method's where the command names none
    assert "    --custom-loss-function-path        miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula" in text
    assert "eval: none (no --eval-interval)" in text and "time estimate (an estimate, not a measurement" in text
    assert "work per DP rank per rollout (DP size 2, 4 pairs per rank)" in text
    assert "schedule: rollouts 0..4" in text and "saves after rollouts [1, 3, 4]" in text
    assert not (tmp_path / "run").exists()


def test_a_hook_module_of_the_working_directory_imports(pipeline, data, tmp_path):
    """``python train_diffusion.py`` puts only the script's directory on sys.path; the driver adds the one the command
    runs in, so a user's ``my_hooks.py`` there is a hook path without PYTHONPATH."""
    from tests.support.cli import run_commands

    (tmp_path / "my_hooks.py").write_text("def loss(ctx, pairs, prepared, *, new_pred, metrics):\n    return 0\n")
    argv = _cli(pipeline, data, tmp_path / "run", "--num-rollout", "1", "--custom-loss-function-path",
                "my_hooks.loss", "--dry-run")  # fmt: skip
    here, elsewhere = run_commands([{"argv": argv, "cwd": str(tmp_path)}, {"argv": argv, "cwd": str(REPO)}])
    assert here["returncode"] == 0, here["stderr"][-2000:]
    assert elsewhere["returncode"] == 2 and "cannot import module 'my_hooks'" in elsewhere["stderr"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--hf-checkpoint", "{tmp}/nope"], "--hf-checkpoint {tmp}/nope: no such directory"),
        (["--prompt-data", "{tmp}/nope.jsonl"], "--prompt-data {tmp}/nope.jsonl does not exist"),
        (["--eval-interval", "1", "--eval-function-path", "miles.eval.digits.no_hook"], "--eval-function-path: hook"),
        (["--custom-train-input-function-path", "no_such_module.fn"], "--custom-train-input-function-path: hook"),
        (["--load", "{tmp}/ckpt"], "--load {tmp}/ckpt: no such directory"),
    ],
)
def test_bad_paths_and_hooks_fail_before_ray_on_one_line_with_exit_2(pipeline, data, tmp_path, extra, message):
    # Without the pre-flight checks these failed inside a Ray worker, or (the eval hook) only after the training.
    argv = [part.format(tmp=tmp_path) for part in _cli(pipeline, data, tmp_path / "run", "--num-rollout", "1", *extra)]
    proc = subprocess.run(
        [sys.executable, str(REPO / "train_diffusion.py"), *argv],
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("train_diffusion.py: error: " + message.format(tmp=tmp_path)), lines[0]
    assert not (tmp_path / "run").exists()


def test_driver_hands_each_group_the_earlier_groups_outputs_of_the_same_rollout(ray_cluster, pipeline, data, tmp_path):
    """A group "first" trains before the actor (as DMD2's critic does): rank i of the actor gets rank i's output of
    "first" from the same rollout."""
    args = make_args(pipeline, tmp_path, prompt_data=str(data), num_rollout=2)
    first_args = make_args(
        pipeline,
        tmp_path,
        prompt_data=str(data),
        custom_train_input_function_path="tests.support.trainer.record_input_first",
        custom_train_output_function_path="tests.support.trainer.echo_output",
    )
    actor_args = make_args(
        pipeline,
        tmp_path,
        prompt_data=str(data),
        custom_train_input_function_path="tests.support.trainer.record_input_second",
    )
    first = dataclasses.replace(run_spec(first_args).group("actor"), role="first")
    run = dataclasses.replace(run_spec(args), groups=(first, run_spec(actor_args).group("actor")))
    pgs = create_placement_groups(args)
    manager = create_rollout_manager(run)
    gpus, cpus = trainer_resources(2, False, bundle_cpus(args))
    groups = {
        role: RayTrainGroup(run, role, 1, 2, pgs["actor"], num_gpus_per_actor=gpus, num_cpus_per_actor=cpus)
        for role in ("first", "actor")
    }
    try:
        ray.get([ref for group in groups.values() for ref in group.async_init()])
        train_diffusion.run_rollouts(args, manager, groups, None, 0, MetricsTracker(args, job="driver"))
        # On the CPU the groups do not take turns: sleeping would free nothing (miles.driver.schedule.needs_sleep).
        assert ray.get(groups["first"].async_sleep_state()) == ["awake", "awake"]
    finally:
        for group in groups.values():
            group.shutdown()
        ray.kill(manager)
        ray.util.remove_placement_group(pgs["actor"][0])

    with open(Path(args.output_dir) / "handoff.jsonl") as f:
        records = sorted((json.loads(line) for line in f), key=lambda r: (r["rollout_id"], r["group"], r["dp_rank"]))
    assert [(r["rollout_id"], r["group"], r["dp_rank"]) for r in records] == [
        (rollout, group, rank) for rollout in (0, 1) for group in ("first", "second") for rank in (0, 1)
    ]
    for record in records:
        if record["group"] == "first":
            assert record["external"] == {}
        else:
            handed = record["external"]["first"]
            assert (handed["rollout_id"], handed["dp_rank"]) == (record["rollout_id"], record["dp_rank"])
            assert handed["sample_indices"] == [4 * record["dp_rank"] + i for i in range(4)]
            assert handed["external"] == {}
    # The driver writes every record (one job): each group's per-step train metrics and one perf record per rollout.
    metrics = read_metrics(args.output_dir)
    assert {r["job"] for r in metrics} == {"driver"}
    perf = [r for r in metrics if "perf/step_time" in r]
    assert [r["rollout_id"] for r in perf] == [0, 1]
    assert {
        "perf/rollout_time",
        "perf/actor-generate_time",
        "perf/first_train_time",
        "perf/first-train_steps_time",
        "perf/first-train_output_time",
        "perf/actor_train_time",
        "perf/actor-train_steps_time",
    } <= perf[0].keys()
    assert not any(key.endswith("sleep_time") or key == "perf/sleep_wake_time" for key in perf[0])
    assert [r["rollout_id"] for r in metrics if "train/first-loss" in r] == [0, 1]
    assert [r["rollout_id"] for r in metrics if "train/loss" in r] == [0, 1]


def _run(argv, run_dir):
    """``python train_diffusion.py ARGV`` in a new process that joins the session's Ray cluster (``--ray-address``);
    its per-step train records by rollout id."""
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, str(REPO / "train_diffusion.py"), *argv, "--ray-address", address],
        env=os.environ.copy(),  # the test environment (tests/support/ray.py)
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["rollout_id"]: r for r in read_metrics(run_dir) if "train/loss" in r}


def test_cli_sft_on_digits_saves_exports_and_resumes_exactly(ray_cluster, pipeline, data, tmp_path):
    from diffusers import SD3Transformer2DModel

    save, export = tmp_path / "ckpt", tmp_path / "student"
    extra = ["--num-rollout", "4", "--save", str(save), "--save-interval", "2", "--save-hf", str(export)]
    full = _run(_cli(pipeline, data, tmp_path / "full", *extra), tmp_path / "full")
    assert sorted(full) == [0, 1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in full.values())
    assert (save / "latest").read_text().strip() == "3" and (save / "rollout_1").is_dir()
    exported = SD3Transformer2DModel.from_pretrained(export / "transformer")
    initial = SD3Transformer2DModel.from_pretrained(pipeline / "transformer")
    assert (export / "model_index.json").read_text() == (pipeline / "model_index.json").read_text()
    # An SFT model samples like its source: the export keeps the source's scheduler, no student schedule.
    scheduler_config = Path("scheduler", "scheduler_config.json")
    assert (export / scheduler_config).read_text() == (pipeline / scheduler_config).read_text()
    assert not torch.equal(exported.proj_out.weight, initial.proj_out.weight)

    # Resume from the rollout-1 checkpoint: rollouts 2 and 3 (data cursor included) repeat exactly.
    (save / "latest").write_text("1\n")
    resumed = _run(_cli(pipeline, data, tmp_path / "resumed", "--num-rollout", "4", "--load", str(save)),
                   tmp_path / "resumed")  # fmt: skip
    assert sorted(resumed) == [2, 3]
    for rollout_id in (2, 3):
        assert resumed[rollout_id]["train/loss"] == full[rollout_id]["train/loss"]
        assert resumed[rollout_id]["train/grad_norm"] == full[rollout_id]["train/grad_norm"]
