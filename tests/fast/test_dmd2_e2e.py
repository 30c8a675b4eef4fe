"""DMD2 end to end through ``train_diffusion.main`` on a tiny random SD3 pipeline.

One pipeline directory is the student's init, the frozen teacher and the critic's init at once, so the run also
checks that nothing writes into the teacher: the export hard-links the pipeline's files. 2 DP ranks on CPU (each
actor rank generates its own shard), critic and actor colocated, 3 rollouts, teacher CFG 2 (the negative prompt
reaches the scoring). The runs join the session's Ray cluster.
"""

import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

from miles.driver.run_dir import complete_rollouts, read_latest
from miles.models.digits_pipeline import read_sampling_schedule
from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.memory import assert_plan_agrees
from tests.support.sd3 import tiny_sd3_pipeline

PROMPTS = ["a red square", "a blue circle", "two green dots", "a yellow line", "a cat", "a dog"]
ACTOR_METRICS = [
    "train/loss",
    "train/grad_norm",
    "train/dmd2_grad_abs_mean",
    "train/dmd2_nonfinite_frac",
    "train/x0_mean_abs_diff",
    "train/x0_max_abs_diff",
    "train/x0_rel_max",
]
CRITIC_METRICS = ["train/critic-loss", "train/critic-grad_norm", "train/critic-lr"]
# The actor ranks generate (no engine replicas, so no perf/update_weights_time); on the CPU no group sleeps.
PERF_METRICS = [
    "perf/rollout_time",
    "perf/actor-generate_time",
    "perf/critic_train_time",
    "perf/critic-train_steps_time",
    "perf/critic-train_output_time",
    "perf/actor_train_time",
    "perf/actor-train_steps_time",
    "perf/step_time",
]
# Exactly reproduced on resume: everything except the wall-clock fields.
EXACT_KEYS = ACTOR_METRICS + CRITIC_METRICS + ["train/critic-step", "train/step", "train/lr"]


def _tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, keyed by relative path."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def _argv(pipeline: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", str(data), "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "4",
        "--micro-batch-size", "1", "--dmd2-critic-steps-per-rollout", "2", "--dmd2-teacher-guidance-scale", "2",
        "--num-rollout", "3", "--lr", "1e-3", "--critic-lr", "1e-3", "--output-dir", str(out), *extra,
    ]  # fmt: skip


def _kind(record: dict) -> str:
    """Which figure a driver record carries: a critic or an actor optimizer step, or a rollout's perf timers."""
    if "train/critic-loss" in record:
        return "critic"
    if "train/loss" in record:
        return "actor"
    return "perf" if "perf/step_time" in record else "other"


def _by_kind(out: Path) -> dict[str, dict[int, list[dict]]]:
    """metrics.jsonl records as ``{kind: {rollout_id: [records in file order]}}``; the driver writes them all."""
    grouped: dict[str, dict[int, list[dict]]] = {}
    for record in read_metrics(out):
        assert record["job"] == "driver", record
        grouped.setdefault(_kind(record), {}).setdefault(record["rollout_id"], []).append(record)
    return grouped


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("dmd2_e2e")
    _, pipeline = tiny_sd3_pipeline(root / "sd3")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    before = _tree_hashes(pipeline)
    save, export, out = root / "ckpt", root / "student", root / "full"
    # Rollout 1 is traced: the resume test below checks that rollout 2 still repeats exactly.
    extra = ["--save", str(save), "--save-interval", "1", "--save-hf", str(export), "--profile-rollouts", "1"]
    run_main(_argv(pipeline, data, out, *extra))
    return {
        "root": root,
        "out": out,
        "pipeline": pipeline,
        "data": data,
        "before": before,
        "save": save,
        "export": export,
        "metrics": _by_kind(out),
    }


def test_every_rollout_logs_finite_actor_critic_and_perf_metrics(run):
    metrics = run["metrics"]
    assert set(metrics) == {"actor", "critic", "perf"}
    for job, names, per_rollout in (
        ("actor", ACTOR_METRICS, 1),
        ("critic", CRITIC_METRICS, 2),  # K = 2 critic optimizer steps per rollout, one record each
        ("perf", PERF_METRICS, 1),
    ):
        assert sorted(metrics[job]) == [0, 1, 2], job
        for rollout_id, records in metrics[job].items():
            assert len(records) == per_rollout, (job, rollout_id)
            for record in records:
                for name in names:
                    assert isinstance(record[name], float) and math.isfinite(record[name]), (job, rollout_id, name)
    # The critic's step counter runs over K steps per rollout; the actor takes one step per rollout.
    assert [r["train/critic-step"] for rid in (0, 1, 2) for r in metrics["critic"][rid]] == [1, 2, 3, 4, 5, 6]
    assert [metrics["actor"][rid][0]["train/step"] for rid in (0, 1, 2)] == [1, 2, 3]
    assert all(r["train/critic-lr"] == 1e-3 for rid in (0, 1, 2) for r in metrics["critic"][rid])
    actor = [metrics["actor"][rid][0] for rid in (0, 1, 2)]
    assert all(r["train/dmd2_nonfinite_frac"] == 0.0 and r["train/dmd2_grad_abs_mean"] > 0 for r in actor)
    # The trainer's recomputed x0 of the student matches the engine's x̂0_i (same weights, same inputs).
    assert all(r["train/x0_max_abs_diff"] < 1e-4 for r in actor)


def test_profile_rollouts_traces_each_rank_and_phase_of_rollout_1_only(run):
    profiles = run["out"] / "profiles"
    assert sorted(path.name for path in profiles.iterdir()) == ["rollout_000001"]
    stems = [f"actor-rank{r}-generate" for r in (0, 1)] + [
        f"{g}-rank{r}-train" for g in ("actor", "critic") for r in (0, 1)
    ]
    assert sorted(path.name for path in (profiles / "rollout_000001").iterdir()) == sorted(
        f"{stem}.{ext}" for stem in stems for ext in ("json", "txt")
    )
    # The trainer's phases are named spans: the critic's K = 2 optimizer windows, then its scoring (train output).
    events = json.loads((profiles / "rollout_000001" / "critic-rank1-train.json").read_text())["traceEvents"]
    spans = [event["name"] for event in events if event.get("cat") == "user_annotation"]
    assert spans.count("train_steps") == 2 and spans.count("train_output") == 1
    table = (profiles / "rollout_000001" / "critic-rank1-train.txt").read_text()
    assert "train_steps" in table and "aten::" in table


def test_the_memory_plan_matches_the_bytes_each_group_logged(run):
    out = run["root"] / "full"
    figures = assert_plan_agrees(_argv(run["pipeline"], run["data"], out), read_metrics(out))
    # float32 compute: the teacher's shard weighs what the student's float32 master shard does
    assert figures["critic-frozen"][1] == figures["actor-parameters"][1] > 0


def test_student_weights_change_and_the_export_carries_its_schedule(run):
    from diffusers import SD3Transformer2DModel

    export, pipeline = run["export"], run["pipeline"]
    trained = SD3Transformer2DModel.from_pretrained(export / "transformer").state_dict()
    initial = SD3Transformer2DModel.from_pretrained(pipeline / "transformer").state_dict()
    assert trained.keys() == initial.keys()
    changed = [key for key in initial if not torch.equal(trained[key], initial[key])]
    assert "proj_out.weight" in changed and len(changed) > len(initial) // 2
    assert all(torch.isfinite(value).all() for value in trained.values())
    schedule = read_sampling_schedule(json.loads((export / "scheduler" / "scheduler_config.json").read_text()))
    assert schedule["is_student"] and schedule["num_inference_steps"] == 4 and schedule["step_rule"] == "dmd2"
    assert schedule["distilled_guidance_scale"] == 2.0


def test_teacher_pipeline_is_byte_identical_after_training_and_export(run):
    pipeline, export = run["pipeline"], run["export"]
    # The export shares the unchanged files with the teacher through hard links: writing the export's scheduler
    # config in place would have changed the teacher's.
    assert os.path.samefile(
        export / "text_encoder" / "model.safetensors", pipeline / "text_encoder" / "model.safetensors"
    )
    assert _tree_hashes(pipeline) == run["before"]
    teacher_config = json.loads((pipeline / "scheduler" / "scheduler_config.json").read_text())
    assert not read_sampling_schedule(teacher_config)["is_student"]


def test_actor_and_critic_each_checkpoint_every_rollout_under_one_commit(run):
    # One commit per rollout for both groups: `latest` lives in the actor's directory only.
    assert read_latest(run["save"]) == 2 and not Path(f"{run['save']}_critic", "latest").exists()
    for directory, role in ((run["save"], "actor"), (Path(f"{run['save']}_critic"), "critic")):
        assert complete_rollouts(directory) == [0, 1, 2]
        for rollout_id in (0, 1, 2):
            metadata = json.loads((directory / f"rollout_{rollout_id}" / "metadata.json").read_text())
            assert (metadata["rollout_id"], metadata["role"], metadata["world_size"]) == (rollout_id, role, 2)


def test_resume_from_rollout_1_repeats_rollout_2_exactly(run):
    save = run["save"]
    # Point the commit at rollout 1, as if the run had died during rollout 2.
    (save / "latest").write_text("1\n")
    out = run["root"] / "resumed"
    run_main(_argv(run["pipeline"], run["data"], out, "--load", str(save)))
    resumed = _by_kind(out)
    assert sorted(resumed["actor"]) == sorted(resumed["critic"]) == sorted(resumed["perf"]) == [2]
    for job in ("actor", "critic"):
        full_records, resumed_records = run["metrics"][job][2], resumed[job][2]
        assert len(resumed_records) == len(full_records)
        for full_record, resumed_record in zip(full_records, resumed_records):
            keys = [key for key in EXACT_KEYS if key in full_record]
            assert keys and {k: resumed_record[k] for k in keys} == {k: full_record[k] for k in keys}, job
