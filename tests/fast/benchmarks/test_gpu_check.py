"""``benchmarks/gpu_check.py`` on the CPU, so that its first minutes on a lent GPU are not spent on a typo.

Three layers: ``--plan-only`` builds every stage's full-size command (the SD3.5-Medium configuration, every family's
tiny pipeline and inputs) and checks each as ``train_diffusion.py --dry-run`` does, without training; ``--tiny``
runs the SD3.5 stage (DMD2 phase 2 with the GAN head and the EMA, bf16), the digits family's run and the sleep probe
at toy size through the same code; the stage runner keeps a failing or overrunning stage to itself. What needs CUDA
(device peaks, memory moved by sleep, the MFU) reads "–" here: no test can stand in for it.
"""

import importlib.util
import json
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from miles.utils.tracking import read_metrics
from tests.support.memory import assert_plan_agrees

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def _stages(report: dict) -> dict:
    return {stage["name"]: stage for stage in report["stages"]}


def _argv(command: str) -> list[str]:
    """The train_diffusion.py flags of a recorded command (with or without the interpreter and the script)."""
    words = shlex.split(command)
    return words[2:] if words[1].endswith("train_diffusion.py") else words


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    work = tmp_path_factory.mktemp("plan")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--plan-only", "--work-dir", str(work / "work"), "--out", str(work / "out")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {"work": work / "work", "out": work / "out", "stdout": result.stdout,
            "report": json.loads((work / "out" / "gpu_check.json").read_text())}  # fmt: skip


def test_plan_only_checks_every_full_size_command_and_trains_nothing(plan):
    report, work = plan["report"], plan["work"]
    stages = _stages(report)
    assert [s["name"] for s in report["stages"]] == ["prepare", "sd35", "families", "sleep", "lora", "sd35_gc"]
    assert {s["status"] for s in report["stages"]} == {"ok"}, [(s["name"], s["reason"]) for s in report["stages"]]
    # SD3.5-Medium's public configuration, written without weights; nothing trained, no run directory.
    config = json.loads((work / "pipeline" / "transformer" / "config.json").read_text())
    assert {key: config[key] for key in gpu_check.SD35_MEDIUM} == gpu_check.SD35_MEDIUM
    assert not list((work / "pipeline").rglob("*.safetensors"))
    assert report["parameters"] == 2_243_171_520 and not (work / "sd35").exists()
    commands = {name: _argv(command) for name, command in report["commands"].items()}
    sd35, gc, lora = commands["sd35"], commands["sd35_gc"], commands["lora"]
    for argv in (sd35, gc, lora):  # DMD2 phase 2 with the EMA, bf16 over float32 masters, cached prompts
        assert _flag(argv, "--dmd2-gan-disc-weight") == "1e-2" and _flag(argv, "--ema-decay") == "0.99"
        assert _flag(argv, "--train-dtype") == "bfloat16" and _flag(argv, "--actor-num-gpus-per-node") == "1"
        assert _flag(argv, "--num-rollout") == "3" and Path(_flag(argv, "--negative-cond")).is_file()
    assert "--gradient-checkpointing" in gc and "--gradient-checkpointing" not in sd35 + lora
    assert (_flag(lora, "--lora-rank"), _flag(lora, "--critic-lora-rank")) == ("64", "32")
    assert _flag(lora, "--teacher-load") == _flag(lora, "--hf-checkpoint")  # the critic and the teacher share a base
    # Every family's tiny run: its inputs written, its command through the dry run's checks, bf16 on one rank.
    families = stages["families"]["data"]["families"]
    assert list(families) == list(gpu_check.FAMILIES) and {r["status"] for r in families.values()} == {"ok"}
    for name, spec in gpu_check.FAMILIES.items():
        argv = commands[f"families/{name}"]
        assert _flag(argv, "--diffusion-model-family") == spec.family and _flag(argv, "--train-dtype") == "bfloat16"
        assert ("--negative-cond" in argv) == (spec.prompts != "encode"), name
    digits = commands["families/digits"]
    records = [json.loads(line) for line in Path(_flag(digits, "--prompt-data")).read_text().splitlines()]
    assert all("cond" in record for record in records)  # the GPU machine has no MiniLM: every prompt is cached
    assert _flag(commands["sleep"], "--ema-decay") == "0.99" and "--train-only" in commands["sleep"]


def test_the_plan_of_every_sd35_run_fits_an_h200_and_counts_the_full_weights(plan):
    stages = _stages(plan["report"])
    params = plan["report"]["parameters"]
    for name in ("sd35", "lora", "sd35_gc"):
        memory = stages[name]["data"]["memory"]
        assert max(memory["plan_peak"].values()) < 0.9 * 141 * 2**30, name  # the planner's headroom on an H200
    exact = stages["sd35"]["data"]["memory"]["exact"]
    # float32 master weights of the 2.24B transformer; the critic's teacher in bf16 beside its own masters
    assert exact["actor-parameters"][0] == 4 * params and exact["critic-frozen"][0] == 2 * params
    lora = stages["lora"]["data"]["memory"]["exact"]
    assert lora["actor-frozen"][0] == lora["critic-frozen"][0] == 2 * params  # one bf16 base per group
    assert "| sd35 | critic | critic steps |" in plan["stdout"] and "sd35_gc: --loss-type dmd2" in plan["stdout"]


def test_model_flops_count_the_gan_rows_the_gan_gradient_and_lora_backwards(plan):
    """The MFU's numerator for rollout 1 of the full-size commands, in forwards of one sample, from the method's own
    counts: the critic's forward carries 3 rows per pair (flow matching, fakes, reals), the GAN gradient runs back to
    the middle block (12 of 24), a LoRA backward through a frozen base counts once."""
    from miles.driver.arguments import parse_args
    from miles.rollout.step_strategy_hub import stop_at_random_step

    stages = _stages(plan["report"])
    full, lora = stages["sd35"]["data"]["work"], stages["lora"]["data"]["work"]
    assert (full["critic_rows"], full["teacher_cfg"], full["student_cfg"]) == (3, 2, 1)
    assert full["gan_backward_share"] == pytest.approx(13 / 24) and full["gan_gradient"]
    assert not full["actor_lora"] and lora["actor_lora"] and lora["critic_lora"]
    args = parse_args(_argv(plan["report"]["commands"]["sd35"]))
    last = max(stop_at_random_step(args, 1, [0, 1, 2, 3], 4))
    expected = {
        "rollout (student)": 2 * (last + 1) * 2,  # 2 micro-batches of 2, to the rollout's largest stop step
        "critic steps": 4 * 3 * 3,  # 4 pairs × 3 rows × (a forward + a backward of two)
        "scoring (teacher CFG + critic)": 4 * (2 + 1 + 1 + 13 / 24),
        "student step": 4 * 3,
    }
    assert full["forwards_rollout_1"] == pytest.approx(expected, rel=1e-12)
    assert (lora["forwards_rollout_1"]["critic steps"], lora["forwards_rollout_1"]["student step"]) == (24, 8)


def test_a_cuda_runs_records_fill_the_peak_mfu_and_plan_columns(plan):
    """Records standing in for a CUDA run's (the trainer logs device peaks on CUDA only): rollout 0 is warm-up, the
    medians of rollouts 1 and 2 make the row, the MFU divides the phase's model FLOPs by its seconds and the bf16 peak,
    the memory table puts the largest peak beside the plan."""
    argv = _argv(plan["report"]["commands"]["sd35"])
    work = gpu_check.Work.from_argv(argv, 24)
    fwd, peak = plan["report"]["forward_flops_per_sample"], 989.4
    records = [
        {"rollout_id": rid, "perf/step_time": 20.0 + rid, "perf/critic-train_steps_time": seconds,
         "memory/critic-peak_train_steps_bytes": (80 + rid) * 2**30, "perf/sleep_wake_time": 6.0}
        for rid, seconds in ((0, 50.0), (1, 4.0), (2, 6.0))
    ]  # fmt: skip
    rows, figures = gpu_check.summarise(records, fwd, work, peak)
    assert figures["rollouts"] == [1, 2] and figures["medians"]["perf/critic-train_steps_time"] == 5.0
    critic = next(row for row in rows if row[0] == "critic steps")
    rates = [gpu_check.phase_flops(fwd, work, rid)["critic steps"] / s / 1e12 for rid, s in ((1, 4.0), (2, 6.0))]
    tflops = (rates[0] + rates[1]) / 2
    assert critic == ["critic steps", "5.000", "82.0", f"{tflops:.3g}", f"{100 * tflops / peak:.1f}%"]
    assert rows[-1] == ["rollout total", "21.500", "", "", "model compute 23% of it"]
    memory_rows, memory = gpu_check.memory_rows(argv, records)
    planned = memory["peaks"]["critic-train_steps"]["planned"]
    assert memory["peaks"]["critic-train_steps"]["measured"] == 82 * 2**30
    assert memory_rows[0][3:] == ["82 GiB", f"{82 * 2**30 / planned:.2f}"]


def test_the_sleep_check_fails_when_the_sleeping_group_keeps_its_reserved_memory():
    """Snapshots standing in for the probe's on CUDA (memory_reserved / memory_allocated): 40 GiB reserved awake,
    36 GiB of it allocated and moved out in 2 s, back in 4 s."""

    def states(reserved_asleep):
        return {
            "awake": {"reserved_bytes": 40 * 2**30, "allocated_bytes": 37 * 2**30, "seconds": None},
            "asleep": {"reserved_bytes": reserved_asleep, "allocated_bytes": 2**30, "seconds": 2.0},
            "woken": {"reserved_bytes": 40 * 2**30, "allocated_bytes": 37 * 2**30, "seconds": 4.0},
        }

    good = gpu_check.sleep_figures(states(2**30))
    assert good == {
        "moved_bytes": 36 * 2**30,
        "sleep_gb_per_s": 36 * 2**30 / 1e9 / 2,
        "wake_gb_per_s": 36 * 2**30 / 1e9 / 4,
    }
    bad = gpu_check.sleep_figures(states(3 * 2**30))
    assert bad["problem"] == "3.00 GiB reserved asleep, more than 5% of the 40.00 GiB awake"


def test_the_tiny_check_runs_the_sd35_digits_and_sleep_stages_on_the_cpu(tmp_path, ray_cluster):
    # The trainings join the session's cluster instead of starting one each.
    address = ray_cluster.get_runtime_context().gcs_address
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--stages", "sd35,families,sleep", "--families", "digits",
         "--work-dir", str(tmp_path), "--out", str(tmp_path / "out"), "--ray-address", address],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    stages = _stages(report)
    assert {name: stage["status"] for name, stage in stages.items()} == dict.fromkeys(
        ["prepare", "sd35", "families", "sleep"], "ok"
    )
    # One row per phase, the same markdown in the report file; no device peak or MFU on the CPU.
    out = result.stdout
    for label, _, _ in gpu_check.PHASES:
        assert out.count(f"| {label} |") == 2, label  # the phase table and the memory table
    assert "model compute" in out and (tmp_path / "out" / "gpu_check.md").read_text().strip() in out
    sd35 = stages["sd35"]["data"]
    assert [row[4] for row in sd35["rows"][:4]] == ["–"] * 4
    # Phase 2: the critic trained its head, the student took both gradients, on both rollouts.
    records = read_metrics(tmp_path / "sd35")
    assert [r["rollout_id"] for r in records if "train/loss" in r] == [0, 1]
    assert all(r["train/dmd2_gan_grad_abs_mean"] > 0 for r in records if "train/loss" in r)
    # The memory planner agrees with the bytes the bf16 run at one rank logged (GAN head and EMA included).
    figures = assert_plan_agrees(_argv(sd35["command"]), records)
    assert len(figures) == 8 and figures["critic-parameters"][1] > figures["actor-parameters"][1]  # the head
    digits = stages["families"]["data"]["families"]["digits"]
    assert (
        digits["rollouts"] == [0, 1] and (tmp_path / "families" / "digits" / "student" / "model_index.json").is_file()
    )
    # The sleep probe stepped, slept, woke and stepped again; on the CPU nothing moves and nothing is reserved.
    sleep = stages["sleep"]["data"]
    assert sleep["state"] == "done" and len(sleep["losses"]) == 2 and sleep["asleep"]["reserved_bytes"] is None
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as logs:
        assert {"sd35.log", "sleep.log", "families/digits/train.log"} <= set(logs.getnames())


def test_a_failing_or_overrunning_stage_costs_only_itself(tmp_path):
    def failing(deadline):
        raise RuntimeError("boom\nsecond line")

    def sleeper(deadline):
        code = gpu_check.run_process(
            [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "s.log", deadline
        )
        if code is None:
            raise gpu_check.StageTimeout("stopped", {"partial": 1})
        return {}

    start = time.monotonic()
    stages = [("a", 30, lambda d: {"x": 1}), ("b", 30, failing), ("c", 1, sleeper), ("d", 30, lambda d: {})]
    log = tmp_path / "progress.txt"
    with open(log, "w") as handle:
        results = gpu_check.run_stages(stages, start + 600, handle)
    assert [(r.name, r.status) for r in results] == [("a", "ok"), ("b", "failed"), ("c", "timeout"), ("d", "ok")]
    assert results[1].reason == "RuntimeError: boom" and "Traceback" in results[1].data["traceback"]
    assert results[2].data == {"partial": 1} and results[2].seconds < 10  # SIGTERM ended the sleeping process
    assert gpu_check.exit_code(results) == 1 and gpu_check.exit_code(results[:1] + results[3:]) == 0
    assert log.read_text().splitlines()[1] == "gpu_check: b failed (0 of 30 s): RuntimeError: boom"
    # A run whose deadline has passed skips what is left, with the reason.
    with open(log, "a") as handle:
        (late,) = gpu_check.run_stages([("e", 30, lambda d: {})], time.monotonic() + 5, handle)
    assert (late.status, late.reason) == ("skipped", "the run's deadline: 5 s left")


def test_without_a_gpu_the_full_check_says_so_in_one_line():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["gpu_check: no CUDA device; run with --tiny on the CPU"]
