"""``benchmarks/gpu_check.py --tiny``: the GPU check's whole path on the CPU (a tiny SD3 transformer with SD3's
structure, a cached prompt file, bf16 DMD2 runs with and without gradient checkpointing, the per-phase table)."""

import shlex
import subprocess
import sys
from pathlib import Path

from miles.utils.tracking import read_metrics
from tests.support.memory import assert_plan_agrees

REPO = Path(__file__).resolve().parents[3]


def test_the_tiny_gpu_check_runs_both_trainings_and_prints_every_phase(tmp_path, ray_cluster):
    # The trainings join the session's cluster instead of starting one each.
    address = ray_cluster.get_runtime_context().gcs_address
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--tiny", "--rollouts", "2",
         "--work-dir", str(tmp_path), "--json", str(tmp_path / "report.json"), "--ray-address", address],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for phase in ("rollout (student)", "critic steps", "scoring (teacher CFG + critic)", "student step"):
        assert out.count(phase) == 2, phase  # one row per run
    assert "without gradient checkpointing" in out and "with --gradient-checkpointing" in out
    assert out.count("model compute") == 2
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["forward_flops_per_sample"] > 0 and report["parameters"] > 0
    assert len(report["runs"]) == 2
    # The cached prompts replaced the text encoders: the pipeline has none.
    index = json.loads((tmp_path / "pipeline" / "model_index.json").read_text())
    assert index["text_encoder_3"] == [None, None] and index["vae"] == [None, None]
    # The memory planner agrees with the bytes the bf16 run at one rank logged (teacher stored in bf16).
    for title, run in report["runs"].items():
        argv = shlex.split(run["command"])[2:]  # after the interpreter and train_diffusion.py
        out = Path(argv[argv.index("--output-dir") + 1])
        assert len(assert_plan_agrees(argv, read_metrics(out))) == 8, title


def test_without_a_gpu_the_full_check_says_so_in_one_line():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["gpu_check: no CUDA device; run with --tiny on the CPU"]
