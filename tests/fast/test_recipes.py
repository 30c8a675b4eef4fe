"""The shipped recipes: the SD3.5-Medium DMD2 script passes ``--dry-run`` here, bad flags fail on one line, and the
digits recipe's command line parses."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.utils.tracking import read_metrics
from tests.support.ray import REPO


def _env(**extra: str) -> dict[str, str]:
    # The recipe calls plain `python`: put this interpreter's bin directory first so it runs the venv's.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1", **extra}


def test_sd35_medium_dmd2_recipe_prepares_its_data_and_passes_its_dry_run(tmp_path):
    """The recipe's two steps on a machine without a GPU, on a tiny SD3 pipeline with CLIP x2 and T5 in place of
    the gated SD3.5-Medium: ``prepare`` writes the prompt cache and the real images' latents (with their cached
    conds), then ``DRY_RUN=1`` checks every input of the phase-2 command and prints its plan."""
    from PIL import Image

    from tests.support.sd3_t5 import PIXEL_SIZE, tiny_sd3_t5_pipeline

    model = tiny_sd3_t5_pipeline(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a photo of thing {i}"}) + "\n" for i in range(8)))
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        Image.new("RGB", (PIXEL_SIZE, PIXEL_SIZE), (40 * i, 90, 200 - 40 * i)).save(images / f"real{i}.png")
        (images / f"real{i}.txt").write_text(f"a real photo {i}")
    data, out = tmp_path / "data", tmp_path / "out"
    env = _env(MODEL_DIR=str(model), PROMPTS=str(prompts), IMAGES=str(images), DATA=str(data), OUT=str(out),
               DEVICE="cpu")  # fmt: skip
    script = str(REPO / "examples" / "sd35_medium" / "run_dmd2.sh")
    prepare = subprocess.run(["bash", script, "prepare"], env=env, capture_output=True, text=True, timeout=600)
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    real = [json.loads(line) for line in (data / "real" / "prompts.jsonl").read_text().splitlines()]
    assert [record["prompt"] for record in real] == [f"a real photo {i}" for i in range(3)]
    assert all(
        (data / "real" / record["latent"]).is_file() and (data / "real" / record["cond"]).is_file() for record in real
    )
    assert (data / "prompts" / "negative.safetensors").is_file()

    proc = subprocess.run(["bash", script], env={**env, "DRY_RUN": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    # 8 ranks on one node, one bundle each (GPU bundles on a GPU machine, CPU bundles here); every rank generates.
    assert "placement: 8 bundles of {GPU: 1, CPU: c}" in log, log  # the cluster's, also on this CPU machine
    assert "rollout: each of the 8 actor ranks generates its own shard on its student" in log
    assert "work per DP rank per rollout (DP size 8, 10 pairs per rank)" in log
    # Both groups, the critic first: K = 5 steps at the critic lr from the teacher, with the GAN head; the student
    # one step at its lr.
    rows = [line.split("plan: ", 1)[-1] for line in log.splitlines()]
    critic = next(i for i, row in enumerate(rows) if row.startswith(f"  critic  {model}"))
    actor = next(i for i, row in enumerate(rows) if row.startswith(f"  actor   {model}"))
    assert critic < actor
    assert rows[critic].split() == ["critic", str(model), str(model), "8e-06", "5", f"{out}/ckpt_critic", "-"]
    assert rows[actor].split() == ["actor", str(model), "-", "2e-06", "1", f"{out}/ckpt", "-"]
    assert any(row.split() == ["--custom-build-modules-path", "miles.backends.fsdp_utils.loss_hub.gan.build_discriminator"]
               for row in rows)  # fmt: skip
    # The groups take turns on shared GPUs; the dry run plans the cluster's GPUs on this machine without any.
    assert "schedule: rollouts 0..2999, sleep between groups on GPUs: True, saves after rollouts [249, 499," in log
    assert f"... (12 in all), 2999], export {out / 'student'}" in log
    assert f"eval: every 250 rollouts, 8 prompts of {data / 'prompts' / 'prompts.jsonl'}" in log
    assert "time estimate (an estimate, not a measurement: no CUDA line of miles has run yet)" in log
    assert "memory per GPU, DP rank 0 of 8: bfloat16 compute" in log  # the planner, from the configs alone
    # A dry run writes nothing: no run directory, no wandb files.
    assert not out.exists()


def test_dry_run_rejects_a_bad_combination_with_one_line_and_exit_2(tmp_path):
    argv = [
        sys.executable, str(REPO / "train_diffusion.py"), "--dry-run", "--loss-type", "dmd2",
        "--hf-checkpoint", str(tmp_path / "student"), "--teacher-load", str(tmp_path / "teacher"),
        "--prompt-data", str(tmp_path / "prompts.jsonl"), "--num-rollout", "2", "--rollout-batch-size", "4",
        "--diffusion-guidance-scale", "3",
    ]  # fmt: skip
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("train_diffusion.py: error: --loss-type dmd2 needs unguided student rollouts")
    assert "--diffusion-guidance-scale 1" in lines[0]


def test_digits_recipe_help():
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "digits" / "run_digits.py"), "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for flag in ("--out", "--guidance-scale", "--one-step", "--smoke", "--ranks"):
        assert flag in proc.stdout
    # The whole first paragraph of the description, each default that has a value, and each ablation's flags.
    assert "into a 4-step\nstudent, evaluate everything and print the table." in proc.stdout
    assert "(default: 300)" in proc.stdout and "(default: None)" not in proc.stdout
    assert (
        "  warmup: --dmd2-gan-disc-weight 1e-2 --dmd2-gan-gen-weight 0.03 --dmd2-gan-max-timestep-ratio 0.5 "
        "--ema-decay 0.99\n" in proc.stdout
    )


def test_digits_recipe_smoke_runs_every_stage_and_reuses_them(ray_cluster, tmp_path):
    # The README's main job with two rollouts per stage: data, init, teacher SFT, DMD2 student, evaluation. Every
    # train_diffusion.py stage joins the session's Ray cluster (ray.init reads RAY_ADDRESS) instead of starting one.
    out = tmp_path / "digits"
    cmd = [sys.executable, str(REPO / "examples" / "digits" / "run_digits.py"), "--smoke", "--out", str(out)]
    env = _env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stage in ("init", "teacher", "regression-pairs-cfg3", "student-4step-cfg3"):
        assert (out / stage / ".miles_stage_complete.json").is_file(), stage
    summary = (out / "summary.md").read_text()
    for row in ("teacher-28step-cfg3", "teacher-4step-cfg3", "teacher-1step-cfg3", "student-4step-cfg3", "real-train"):
        assert f"| {row} |" in summary, row
    assert (out / "eval-cfg3" / "student-4step-cfg3.png").is_file()
    # --keep-best fd:min: the evaluation of lowest train-time FD is exported beside the last, and the summary names it.
    fds = [
        (r["eval/fd"], r["rollout_id"]) for r in read_metrics(out / "runs" / "student-4step-cfg3") if "eval/fd" in r
    ]
    best_fd, best_rollout = min(fds)
    assert json.loads((out / "student-4step-cfg3-best" / "keep_best.json").read_text())["rollout_id"] == best_rollout
    assert (
        f"| student-4step-cfg3 | {best_fd:.3f} after rollout {best_rollout} | `student-4step-cfg3-best/` |" in summary
    )
    summary_json = json.loads((out / "summary.json").read_text())
    assert summary_json["training"]["student-4step-cfg3"]["best"] == {"rollout_id": best_rollout, "fd": best_fd}
    assert {row["name"] for row in summary_json["rows"]} >= {"student-4step-cfg3", "real-train"}
    # The teacher's CFG sweep picks the distilled scale: its lowest FD is at the scale the student was named after.
    assert min(summary_json["sweep"], key=lambda row: row["fd"])["guidance_scale"] == 3.0
    # The exported student samples with its own 4-step schedule by default.
    from miles.models.digits_pipeline import DigitsPipeline

    student = DigitsPipeline.from_pretrained(str(out / "student-4step-cfg3"))
    assert student.sampling_defaults["num_inference_steps"] == 4
    assert student.sampling_defaults["step_rule"] == "dmd2"

    # A rerun reuses every complete stage instead of training again.
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[teacher] reusing" in again.stderr and "[student-4step-cfg3] reusing" in again.stderr
    assert "[sweep] reusing" in again.stderr and "[regression pairs] reusing" in again.stderr
    assert "train_diffusion.py" not in again.stderr


def test_the_summary_names_the_kept_rollout_and_each_collapse_alarm(tmp_path):
    from types import SimpleNamespace

    from miles.utils.tracking import MetricsTracker

    recipe = _run_digits_module()
    run_dir = tmp_path / "runs" / "student-4step-cfg1"
    tracker = MetricsTracker(SimpleNamespace(output_dir=str(run_dir), use_wandb=False), job="driver")
    tracker.log({"health/std_ratio": 1.0, "health/diversity_ratio": 0.9}, 0)
    tracker.log({"health/std_ratio": 2.5, "health/diversity_ratio": 0.9}, 1)  # wider than the teacher's
    tracker.log({"eval/fd": 1.4, "health/eval_diversity": 0.15, "eval/diversity_ratio": 0.9}, 1)
    tracker.log({"best/fd": 1.4, "best/rollout_id": 1}, 1)
    tracker.log({"health/std_ratio": float("nan")}, 2)
    tracker.log({"eval/fd": 1.6, "eval/diversity_ratio": 0.4, "eval/saturated_excess": 0.2}, 3)  # collapsing
    info = recipe.kept_and_alarms(run_dir)
    assert info == {
        "best": {"rollout_id": 1, "fd": 1.4},
        "alarms": {"health/std_ratio": [1, 2], "eval/diversity_ratio": [3], "eval/saturated_excess": [3]},
    }
    (tmp_path / "student-4step-cfg1-best").mkdir()
    assert recipe.best_rows(tmp_path, {"teacher": tmp_path, "student-4step-cfg1": run_dir}) == [
        ["student-4step-cfg1", "1.400 after rollout 1", "`student-4step-cfg1-best/`",
         "health/std_ratio after rollouts 1, 2; eval/diversity_ratio after rollout 3; eval/saturated_excess after "
         "rollout 3"]
    ]  # fmt: skip
    assert recipe._rollouts(list(range(12, 52))) == "after 40 rollouts (12, 13, 14, 15, …)"


def test_digits_recipe_rejects_bad_flags_before_any_stage(tmp_path):
    # Without these checks --ranks 3 failed in the teacher stage, and --guidance-scale 0.5 only in the student stage,
    # after the teacher's training.
    for extra, message in (
        (["--ranks", "3"], "--ranks must be 1 or 2"),
        (["--guidance-scale", "0.5"], "--guidance-scale must be a number in [1, 100] (1 = no CFG), got 0.5"),
        (["--guidance-scale", "1e308"], "--guidance-scale must be a number in [1, 100] (1 = no CFG), got 1e+308"),
        (["--student-rollouts", "0"], "--student-rollouts must be >= 1, got 0"),
        (["--only-ablations"], "--only-ablations trains the --ablation, --one-step, --phase1 and --unguided students"),
        (["--only-ablations", "--quality", "--ablation", "ema"], "--quality replaces the recipe's student, which"),
        # Without a finished teacher in --out the study would first train one of its own.
        (["--only-ablations", "--ablation", "ema"], "--only-ablations trains on a finished run's teacher, and"),
        (["--ablation", "nope"], "argument --ablation: invalid choice: 'nope'"),
        (["--student-seed", "-1"], "--student-seed must be in [0, 2**63 - 1] (train_diffusion.py's --seed), got -1"),
    ):
        cmd = [sys.executable, str(REPO / "examples" / "digits" / "run_digits.py"), "--out", str(tmp_path / "out")]
        proc = subprocess.run([*cmd, *extra], env=_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(f"run_digits.py: error: {message}"), proc.stderr
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "out").exists()


def _run_digits_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_digits", REPO / "examples" / "digits" / "run_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_digits_ablation_parses_as_a_dmd2_student_run(tmp_path):
    # The recipe composes each --ablation's command as below (2 DP ranks); a flag the trainer refuses would fail
    # only after the teacher's training. The GAN variants' real data and the LoRA's pipeline are checked later
    # (preflight, Ray).
    from miles.backends.fsdp_utils.loss_hub.regression import dmd2_regression_loss
    from miles.driver.arguments import parse_args
    from miles.methods import get_method

    recipe = _run_digits_module()
    parsed = {}
    for name, variant in recipe.ABLATIONS.items():
        flags = [flag.format(half=150) for flag in variant]
        if "--dmd2-gan-disc-weight" in flags:
            flags += ["--dmd2-gan-real-data", str(tmp_path / "train.jsonl")]
        if "--dmd2-regression-weight" in flags:
            flags += ["--dmd2-regression-pairs", str(tmp_path / "pairs.jsonl")]
        args = parse_args(
            [*recipe.STUDENT_FLAGS, *flags, "--hf-checkpoint", "/models/teacher", "--teacher-load", "/models/teacher",
             "--prompt-data", str(tmp_path / "prompts.jsonl"), "--num-rollout", "300", "--diffusion-num-steps", "4",
             "--actor-num-gpus-per-node", "2"]
        )  # fmt: skip
        assert args.ema_decay == 0.99, name  # every variant evaluates an EMA, as the recipe's student does
        parsed[name] = args
    # The critic-pace and step-grid variants override STUDENT_FLAGS' K, critic lr and (shift-3) schedule.
    pace = {name: (parsed[name].dmd2_critic_steps_per_rollout, parsed[name].critic_lr) for name in parsed}
    assert [pace[f"ema-nowarmup{end}"] for end in ("", "-k1", "-critic-lr1e-4", "-critic-lr1.6e-3")] == [
        (5, 4e-4),
        (1, 4e-4),
        (5, 1e-4),
        (5, 1.6e-3),
    ]
    assert parsed["ema-nowarmup-linear-grid"].diffusion_timesteps == [1000, 750, 500, 250]
    # The recipe's own phase 2 holds its EMA at 0.99 from the first step and adds DMD's regression term on the pairs
    # the recipe writes; "warmup" is the phase 2 first measured, "no-regression" the one before the term.
    recipe_student = parse_args([*recipe.STUDENT_FLAGS, *recipe.PHASE2_FLAGS, "--dmd2-gan-real-data", "r.jsonl",
                                 "--dmd2-regression-pairs", "pairs.jsonl", "--hf-checkpoint", "t", "--teacher-load",
                                 "t", "--prompt-data", "p", "--num-rollout", "3"])  # fmt: skip
    assert (recipe_student.ema_decay, recipe_student.ema_min_decay) == (0.99, 0.99)
    assert (recipe_student.dmd2_regression_weight, recipe_student.dmd2_regression_pairs) == (0.25, "pairs.jsonl")
    assert get_method(recipe_student).default_hooks(recipe_student).loss is dmd2_regression_loss
    assert (parsed["warmup"].ema_min_decay, parsed["lora"].ema_min_decay, parsed["reward"].ema_min_decay) == (0, 0, 0)
    assert recipe.ABLATIONS["no-regression"] == [*recipe.ABLATIONS["warmup"], "--ema-min-decay", "0.99"]
    assert recipe.PHASE2_FLAGS == [*recipe.ABLATIONS["no-regression"], "--dmd2-regression-weight", "0.25"]
    assert parsed["no-regression"].dmd2_regression_weight == 0.0
    lora = parse_args([*recipe.STUDENT_FLAGS, *recipe.ABLATIONS["lora"], "--dmd2-gan-real-data", "r.jsonl",
                       "--hf-checkpoint", "t", "--teacher-load", "t", "--prompt-data", "p", "--num-rollout", "3"])  # fmt: skip
    # The later --lr overrides the recipe's; the critic takes the LoRA's rank and its own learning rate.
    assert (lora.lora_rank, lora.critic_lora_rank, lora.lr, lora.critic_lr) == (16, 16, 1e-3, 4e-3)
    late = recipe.ABLATIONS["gan-late"]
    assert late[late.index("--dmd2-gan-start-rollout") + 1] == "{half}"


def test_digits_recipe_rejects_an_out_that_cannot_hold_a_run_and_leaves_it_as_it_was(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file the user keeps\n")
    script = [sys.executable, str(REPO / "examples" / "digits" / "run_digits.py")]
    for out, message in (
        (taken, f"--out {taken}: {taken} is a file, not a directory"),
        (taken / "digits", f"--out {taken / 'digits'}: {taken} is a file, not a directory"),
        ("", "argument --out: an empty path; pass the run directory"),
    ):
        proc = subprocess.run([*script, "--out", str(out)], env=_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == f"run_digits.py: error: {message}", proc.stderr
    assert taken.read_text() == "a file the user keeps\n"


def test_an_ablation_study_writes_its_tables_beside_the_full_runs(tmp_path):
    # --only-ablations in a finished run's --out: its tables and grids are named after the students it adds, so the
    # recipe's summary.md and eval-cfg<w>/ stay as they were.
    recipe = _run_digits_module()
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / recipe.COMPLETE).write_text("{}")
    study = ["--out", str(tmp_path), "--only-ablations", "--ablation", "warmup", "--ablation", "ema", "--one-step"]
    assert recipe.study_tag(recipe.parse_args(study)) == "-warmup+ema+one-step"
    assert recipe.study_tag(recipe.parse_args([*study, "--student-seed", "7"])) == "-warmup+ema+one-step-seed7"
    at_cfg3 = recipe.parse_args([*study, "--guidance-scale", "3"])
    assert recipe.study_tag(at_cfg3) == "-warmup+ema+one-step-cfg3"
    assert recipe.study_tag(at_cfg3, with_cfg=False) == "-warmup+ema+one-step"  # eval-cfg3-... names the scale
    # A full run on another training seed of a finished run's teacher keeps the first run's tables too.
    assert recipe.study_tag(recipe.parse_args(["--out", str(tmp_path), "--student-seed", "7"])) == "-seed7"
    assert recipe.study_tag(recipe.parse_args(["--out", str(tmp_path), "--ablation", "warmup"])) == ""
    every = [arg for name in recipe.ABLATIONS for arg in ("--ablation", name)]
    long_tag = recipe.study_tag(recipe.parse_args([*study, *every, "--phase1", "--student-seed", "7"]))
    assert long_tag.startswith("-study-") and len(long_tag) == len("-study-") + 12


def test_a_terminated_recipe_ends_its_running_stage(tmp_path):
    # A scheduler's SIGTERM to run_digits.py must not leave the stage it runs (a training) behind. The stage here is a
    # sleeping child that writes its PID; the test ends exactly the processes it started.
    pid_file = tmp_path / "stage.pid"
    stage = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    driver = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('run_digits', {str(REPO / 'examples' / 'digits' / 'run_digits.py')!r})\n"
        "recipe = importlib.util.module_from_spec(spec); spec.loader.exec_module(recipe)\n"
        "recipe.end_stages_on_sigterm()\n"
        f"recipe.run([sys.executable, '-c', {stage!r}])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.is_file() or not pid_file.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "the stage did not start"
            time.sleep(0.1)
        stage_pid = int(pid_file.read_text())
        proc.terminate()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):  # reaped by the recipe's wait, so not even a zombie is left
            os.kill(stage_pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_damaged_sweep_file_is_swept_again_and_a_complete_one_reused(tmp_path, caplog):
    # An untrained digits pipeline stands in for the teacher: the sweep's figures are not the point here.
    recipe = _run_digits_module()
    teacher = tmp_path / "teacher"
    init = [sys.executable, "-m", "miles.models.digits", "init", str(teacher), "--max-length", "8"]
    subprocess.run(init, env=_env(), check=True, capture_output=True, timeout=300)
    sweep_dir = tmp_path / "eval-cfg-sweep"
    sweep_dir.mkdir()
    (sweep_dir / recipe.COMPLETE).write_text("{}")
    (sweep_dir / "sweep.json").write_text('[{"guidance_scale": 1.0}')  # cut mid-write
    with caplog.at_level("INFO", logger="digits"):
        rows = recipe.cfg_sweep(teacher, tmp_path, n_per_class=2)
    assert [row["guidance_scale"] for row in rows] == list(recipe.SWEEP_SCALES)
    assert "is not a complete sweep; sweeping again" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="digits"):
        assert recipe.cfg_sweep(teacher, tmp_path, n_per_class=2) == json.loads(json.dumps(rows, default=str))
    assert "[sweep] reusing" in caplog.text
    # Well-formed JSON with a figure that is not a number would fail later, when the tables are written.
    damaged = json.loads((sweep_dir / "sweep.json").read_text())
    damaged[2]["fd"] = None
    (sweep_dir / "sweep.json").write_text(json.dumps(damaged))
    caplog.clear()
    with caplog.at_level("INFO", logger="digits"):
        again = recipe.cfg_sweep(teacher, tmp_path, n_per_class=2)
    assert "is not a complete sweep; sweeping again" in caplog.text
    assert all(isinstance(row["fd"], float) for row in again)


def test_compare_runs_names_a_missing_or_broken_run_in_one_line(tmp_path):
    script = REPO / "examples" / "digits" / "compare_runs.py"
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "metrics.jsonl").write_text('{"rollout_id": 0, "eval/fd": 2.0}\n{"rollout_id": 1, "ev')
    for run, message in (
        (tmp_path / "missing", f"{tmp_path / 'missing'} has no metrics.jsonl; pass a train_diffusion.py --output-dir"),
        (tmp_path / "cut", f"{tmp_path / 'cut' / 'metrics.jsonl'}:2 is not valid JSON (a run killed mid-write?)"),
    ):
        cmd = [sys.executable, str(script), f"a={run}", "--out", str(tmp_path / "fd.png")]
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == f"compare_runs.py: error: {message}", proc.stderr


def test_the_cluster_guides_sd35_medium_memory_figures_are_the_recipes_own(tmp_path):
    """docs/cluster.md section 4 quotes the planned peak per GPU of ``examples/sd35_medium/run_dmd2.sh`` as shipped
    (issue 34 item 5: it quoted a gradient-checkpointed command without the GAN head and the EMA). The recipe's own
    flags are read by running it with a ``python`` that records its argv; the plan is made on the meta device from
    SD3.5-Medium's public transformer configuration, as the recipe's dry run makes it."""
    from miles.driver.arguments import parse_args
    from miles.driver.memory_plan import format_bytes, plan_run

    model = tmp_path / "sd35m"
    (model / "transformer").mkdir(parents=True)
    config = (REPO / "miles" / "models" / "configs" / "sd35_medium.json").read_text()
    (model / "transformer" / "config.json").write_text(config)
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    bin_dir, argv_file = tmp_path / "bin", tmp_path / "argv.txt"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {argv_file}\n')
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MODEL_DIR": str(model),
           "OUT": str(tmp_path / "out")}  # fmt: skip
    script = str(REPO / "examples" / "sd35_medium" / "run_dmd2.sh")
    subprocess.run(["bash", script], env=env, check=True, timeout=60)
    argv = argv_file.read_text().splitlines()
    assert argv[0] == "train_diffusion.py"
    _, plans = plan_run(parse_args(argv[1:]))
    peaks = {plan.role: format_bytes(plan.peak) for plan in plans}
    doc = " ".join((REPO / "docs" / "cluster.md").read_text().split())
    assert (
        f"plans a peak of {peaks['critic']} for the critic group and {peaks['actor']} for the student: it fits an "
        "80 GB GPU"
    ) in doc, peaks
