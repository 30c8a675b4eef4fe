"""The digits recipe: train a tiny text-to-image teacher on real handwritten digits, pick the teacher's best CFG
scale, distill it with DMD2 phase 2 (GAN head on the critic against real digits, generator EMA) into a 4-step
student, evaluate everything and print the table.

    python examples/digits/run_digits.py                       # the whole recipe (CPU, 2 cores)
    python examples/digits/run_digits.py --one-step --phase1   # also a 1-step student and the phase-1 baseline
    python examples/digits/run_digits.py --quality             # the LoRA student instead (about 2x the time)
    python examples/digits/run_digits.py --smoke --out /tmp/d  # a few rollouts per stage (CI)

Stages (each reuses its output when that output is complete, so an interrupted run picks up where it stopped):

1. data      ``miles.eval.digits.data``: sklearn's digits, a fixed stratified train / held-out split, JSONL files.
2. init      ``python -m miles.models.digits init``: a fresh 0.6M-parameter SD3 transformer pipeline.
3. teacher   ``train_diffusion.py --loss-type sft_loss --train-only``: flow matching on the train split, with 10%
             of the prompts dropped to the empty prompt so the teacher supports CFG.
4. sweep     the teacher's 28-step FD at CFG 1, 1.5, 2 and 3; the recipe distills at the best one
             (``--guidance-scale`` picks one instead).
5. students  ``train_diffusion.py --loss-type dmd2``: student and critic start from the teacher; the teacher scores
             with that CFG; phase 2 adds the GAN head (real digits: the train split), the student's EMA (0.99 from
             the first step) and DMD's regression loss on 1,000 cached teacher noise -> sample pairs (written once
             per CFG by ``python -m miles.rollout.regression_pairs``, ``regression-pairs-cfg<w>/``); the evaluation
             of lowest train-time FD is exported beside the last (``--keep-best fd:min``, ``<name>-best/``).
             ``--one-step`` adds a 1-step phase-2 student, ``--phase1`` the no-GAN, no-EMA 4-step student of the
             same CFG (the gain's baseline), ``--unguided`` a phase-2 student distilled at CFG 1.
6. eval      ``miles.eval.digits.evaluate_suite``: teacher 28 / 4 / 1 Euler steps and each student, at equal CFG,
             the quality bar, and each stage's plots (``python -m miles.plot``).

Every stage is a subprocess running the project's own command line, so the log shows the exact commands to rerun.
"""

import argparse
import hashlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPLETE = ".miles_stage_complete.json"
SWEEP_SCALES = (1.0, 1.5, 2.0, 3.0)
# Keeps summary<tag>.json and eval-cfg<w><tag>/ well under the file systems' 255 bytes a name.
MAX_TAG_LENGTH = 120
# Far above any useful CFG scale, and finite in float32, where the teacher's guided velocity is computed.
MAX_GUIDANCE_SCALE = 100.0

logger = logging.getLogger("digits")


# Teacher SFT: 256 images per rollout in 4 optimizer steps of 64 (2 ranks x 32).
TEACHER_FLAGS = [
    "--loss-type", "sft_loss", "--train-only",
    "--rollout-batch-size", "256", "--num-steps-per-rollout", "4", "--micro-batch-size", "32",
    "--lr", "1e-3", "--lr-warmup-steps", "50", "--lr-decay-style", "cosine", "--min-lr", "1e-5",
    "--fsdp-flow-shift", "3.0", "--sft-uncond-prob", "0.1", "--clip-grad", "1.0",
]  # fmt: skip

# DMD2: 40 prompts per rollout, 20 per rank; the critic's K = 5 steps take 4 pairs each.
STUDENT_FLAGS = [
    "--loss-type", "dmd2",
    "--rollout-batch-size", "40", "--micro-batch-size", "4",
    "--diffusion-flow-shift", "3.0", "--fsdp-flow-shift", "3.0",
    "--dmd2-critic-steps-per-rollout", "5",
    "--lr", "1e-4", "--critic-lr", "4e-4", "--clip-grad", "1.0",
]  # fmt: skip

# Phase 2 as first measured: tianweiy/DMD2's discriminator weight; the generator weight and the GAN's noise range
# from the recipe's search (docs/digits.md: the GAN runs' lowest FD); an EMA of the student that the export and the
# evaluation use, with diffusers' warm-up. The reference generator weight (3e-3) left the GAN gradient below 1/100
# of the DM gradient on 8x8 digits. The LoRA, late-GAN and reward students keep this EMA (their rows were measured
# with it, and the LoRA student lost FD without the warm-up).
WARMUP_PHASE2_FLAGS = [
    "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-gen-weight", "0.03", "--dmd2-gan-max-timestep-ratio", "0.5",
    "--ema-decay", "0.99",
]  # fmt: skip
# The EMA at its 0.99 from the first step instead of diffusers' warm-up (which reached only 0.971 by step 300).
NO_WARMUP_FLAGS = ["--ema-min-decay", "0.99"]
# The recipe's phase 2 until DMD's regression joined it: the same GAN head and EMA, the EMA without its warm-up.
# Against the warm-up it lowered the 4-step student's FD on every sample seed of both training seeds measured (1.106
# vs 1.317, 1.145 vs 1.291: docs/digits.md, runs 10 and 11). Now --ablation no-regression.
NO_REGRESSION_PHASE2_FLAGS = [*WARMUP_PHASE2_FLAGS, *NO_WARMUP_FLAGS]
# DMD's regression loss (the first DMD paper, docs/dmd2.md): w = 0.25 (DMD's lambda_reg) of the L2 between the
# student's one-step output from a cached noise and the teacher's 28-step Euler sample from it, on REGRESSION_PAIRS
# pairs the recipe writes once from its teacher (a stage of its own). It pulls the student, less precise and more
# diverse than its teacher (precision 0.69 vs 0.81, recall 0.85 vs 0.71), toward the teacher's own mapping of noise
# to digit.
REGRESSION_FLAGS = ["--dmd2-regression-weight", "0.25"]
# The recipe's phase 2: the GAN head, the EMA without warm-up and the regression term. Against the same without the
# term it lowered the 4-step student's FD on every sample seed of both training seeds measured (1.020 vs 1.107,
# 1.045 vs 1.146: docs/digits.md, runs 17 and 18).
PHASE2_FLAGS = [*NO_REGRESSION_PHASE2_FLAGS, *REGRESSION_FLAGS]
# The regression's cached teacher pairs: prompts.jsonl's 1,000 records once each (100 per digit).
REGRESSION_PAIRS = 1000


# Students beside the recipe's, for docs/digits.md's phase-2 ablation and the LoRA comparison (``--ablation NAME``,
# repeatable; each student is named ``student-4step-cfg<w>-<NAME>``). Each list replaces PHASE2_FLAGS; "{half}" is
# half the student's rollouts. A list with a GAN weight gets the real-data flags as the recipe's student does.
EMA_FLAGS = ["--ema-decay", "0.99"]
COSINE_FLAGS = ["--lr-decay-style", "cosine", "--min-lr", "1e-5"]
# A prompt-judging discriminator (projection term, approximate R1) whose gradient reaches the student only from
# half-way, once the DM term has settled, on decaying learning rates.
GAN_LATE_FLAGS = [*WARMUP_PHASE2_FLAGS, *COSINE_FLAGS, "--dmd2-gan-projection", "--dmd2-gan-r1-weight", "1",
                  "--dmd2-gan-start-rollout", "{half}"]  # fmt: skip
# gan-late, and real digits shown with another sample's prompt count as fakes (Reed et al. 2016): the projection
# alone left the right-vs-wrong-prompt AUC below chance (0.38), nothing taught the head that a prompt can be wrong.
GAN_LATE_MISMATCH_FLAGS = [*GAN_LATE_FLAGS, "--dmd2-gan-mismatch-weight", "1"]
# The recipe's phase 2 with student and critic as rank-16 LoRA adapters on the teacher's one frozen base (issue 19).
# The adapters' B starts at zero and Adam moves each of A, B by about lr a step, so at the full-weight learning rate
# a rank-16 update moves the weights about 3x slower: 10x and 3x are tried (docs/digits.md).
LORA_FLAGS = [*WARMUP_PHASE2_FLAGS, "--lora-rank", "16", "--lr", "1e-3", "--critic-lr", "4e-3"]
ABLATIONS = {
    # The recipe's phase 2 as first measured: its EMA with diffusers' warm-up.
    "warmup": WARMUP_PHASE2_FLAGS,
    # The recipe's phase 2 before DMD's regression term joined it (runs 10 to 16).
    "no-regression": NO_REGRESSION_PHASE2_FLAGS,
    # The EMA alone, no GAN head.
    "ema": EMA_FLAGS,
    # The EMA, and both learning rates decaying to 1e-5 (cosine) instead of staying constant.
    "ema-cosine": [*EMA_FLAGS, *COSINE_FLAGS],
    # The EMA, scoring at σ uniform in the scoring range (tianweiy/DMD2 draws its timestep uniformly) instead of the
    # flow-shift-3 grid, which puts only 7.5% of the draws below σ = 0.2, where a digit's strokes are decided.
    "ema-uniform-sigma": [*EMA_FLAGS, "--dmd2-scoring-sigma", "shift", "--dmd2-scoring-shift", "1"],
    "ema-nowarmup": [*EMA_FLAGS, *NO_WARMUP_FLAGS],
    # The critic's pace against the student's (STUDENT_FLAGS: K = 5 critic steps per student step, each on a fifth
    # of the rollout, at 4x the student's learning rate: tianweiy/DMD2's two-time-scale rule). K = 1 is one critic
    # step on the whole rollout (K must split each rank's 20 pairs into whole micro-batches of 4: 1 or 5); the
    # critic's learning rate slower (1e-4) or faster (1.6e-3).
    "ema-nowarmup-k1": [*EMA_FLAGS, *NO_WARMUP_FLAGS, "--dmd2-critic-steps-per-rollout", "1"],
    "ema-nowarmup-critic-lr1e-4": [*EMA_FLAGS, *NO_WARMUP_FLAGS, "--critic-lr", "1e-4"],
    "ema-nowarmup-critic-lr1.6e-3": [*EMA_FLAGS, *NO_WARMUP_FLAGS, "--critic-lr", "1.6e-3"],
    # The step grid: tianweiy/DMD2's evenly spaced 4-step timesteps (999, 749, 499, 249 there), sigma = 1, 0.75,
    # 0.5, 0.25, instead of the flow-shift-3 grid (1, 0.9, 0.75, 0.5), whose last step starts at a coarser noise.
    "ema-nowarmup-linear-grid": [*EMA_FLAGS, *NO_WARMUP_FLAGS, "--diffusion-timesteps", "1000,750,500,250"],
    # The recipe's phase 2 (before the regression term) with the DM gradient (and the GAN's noise) drawn at σ >= 0.2 only, the opposite of
    # ema-uniform-sigma: more draws below 0.2 sped the drift up, and this drops the shift-3 grid's 7.5% there.
    "sigma-min0.2": [*NO_REGRESSION_PHASE2_FLAGS, "--dmd2-min-timestep-ratio", "0.2"],
    # The recipe's phase 2 (before the regression term) with the student at half its learning rate (the critic's kept: 8x the student's, not 4x):
    # the student widens past the teacher (precision falls all run long) while its critic lags behind it.
    "student-lr5e-5": [*NO_REGRESSION_PHASE2_FLAGS, "--lr", "5e-5"],
    "gan-late": GAN_LATE_FLAGS,
    "gan-late-mismatch": GAN_LATE_MISMATCH_FLAGS,
    "gan-late-mismatch-nowarmup": [*GAN_LATE_MISMATCH_FLAGS, *NO_WARMUP_FLAGS],
    # The same with the generator's GAN weight at 0.1 (the later flag overrides the recipe's 0.03): a head that
    # judges the digit may carry a stronger pull toward the real digits than the first heads could.
    "gan-late-mismatch-nowarmup-gen0.1": [*GAN_LATE_MISMATCH_FLAGS, *NO_WARMUP_FLAGS, "--dmd2-gan-gen-weight", "0.1"],
    "lora": LORA_FLAGS,
    "lora-lr3e-4": [*LORA_FLAGS, "--lr", "3e-4", "--critic-lr", "1.2e-3"],  # the later rates override LORA_FLAGS'
    "lora-nowarmup": [*LORA_FLAGS, *NO_WARMUP_FLAGS],
    # DMD + reward (DMDR, docs/dmd2.md): the recipe's phase 2 plus the digits reward, the log-probability of the
    # prompt's digit under a logistic regression fitted on the train split (not the evaluator's MLP). At 0.5 the
    # reward step is a quarter of the DM gradient's norm at the start and a fiftieth once the classifier is sure
    # of the student's digits (train/dmd2_reward_dm_grad_ratio over 20 rollouts: docs/dmd2.md).
    "reward": [*WARMUP_PHASE2_FLAGS, "--dmd2-reward-weight", "0.5",
               "--dmd2-reward-function-path", "miles.eval.digits.reward.digit_log_prob"],
}  # fmt: skip


def stage_done(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def mark_done(path: Path, **info) -> None:
    # Replace, never rewrite in place: an export hard-links its source's files, this marker included.
    tmp = path / (COMPLETE + ".tmp")
    tmp.write_text(json.dumps({"finished": time.strftime("%Y-%m-%d %H:%M:%S"), **info}, indent=2))
    os.replace(tmp, path / COMPLETE)


def end_stages_on_sigterm() -> None:
    """Make SIGTERM (a scheduler's, a timeout's) a ``SystemExit`` in this process, so that :func:`run` ends the
    running stage as well instead of leaving it training."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run(cmd: list[str]) -> None:
    logger.info("$ %s", shlex.join(cmd))
    start = time.perf_counter()
    stage = subprocess.Popen(cmd, cwd=REPO)
    try:
        returncode = stage.wait()
    except BaseException:
        # Ctrl-C or SIGTERM (main turns it into SystemExit) ends the running stage too, not only this script.
        stage.terminate()
        try:
            stage.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stage.kill()
        raise
    if returncode != 0:
        # The stage printed its own error; stop here so no later stage runs on a missing or partial output.
        logger.error("stage failed with exit code %d: %s", returncode, shlex.join(cmd))
        sys.exit(returncode)
    logger.info("  done in %.0fs", time.perf_counter() - start)


def train(name: str, out: Path, flags: list[str], save_hf: Path) -> Path:
    """One ``train_diffusion.py`` run exporting to ``save_hf``, skipped when its export is complete; its plots are
    written beside its ``metrics.jsonl``. Returns the run directory."""
    run_dir = out / "runs" / name  # metrics.jsonl, eval grids and plots; kept apart from the exported pipeline
    if stage_done(save_hf):
        logger.info("[%s] reusing %s", name, save_hf)
        return run_dir
    logger.info("[%s] training -> %s", name, save_hf)
    # An interrupted stage's export, or --keep-best's (<save_hf>-best), is this recipe's own: replaced on a rerun.
    best = save_hf.with_name(f"{save_hf.name}-best")
    overwrite = ["--overwrite-save-hf"] if save_hf.exists() or best.exists() else []
    cmd = [sys.executable, "train_diffusion.py", *flags, "--save-hf", str(save_hf), "--output-dir", str(run_dir)]
    run(cmd + overwrite)
    run([sys.executable, "-m", "miles.plot", str(run_dir)])
    mark_done(save_hf, command=shlex.join(cmd))
    return run_dir


def regression_pairs(teacher: Path, out: Path, prompts: str, cfg: float, count: int) -> Path:
    """The teacher's noise -> 28-step Euler sample pairs at CFG ``cfg`` (``python -m miles.rollout.regression_pairs``),
    written once per scale and reused when complete; returns their ``pairs.jsonl``."""
    pairs_dir = out / f"regression-pairs-cfg{cfg:g}"
    if stage_done(pairs_dir):
        logger.info("[regression pairs] reusing %s", pairs_dir)
    else:
        run([sys.executable, "-m", "miles.rollout.regression_pairs", str(teacher), prompts, str(pairs_dir),
             "--num-pairs", str(count), "--num-steps", "28", "--guidance-scale", str(cfg)])  # fmt: skip
        mark_done(pairs_dir)
    return pairs_dir / "pairs.jsonl"


def cfg_sweep(teacher: Path, out: Path, n_per_class: int) -> list[dict]:
    """The teacher's 28-step figures at each ``SWEEP_SCALES`` CFG scale (reused when complete)."""
    sweep_dir = out / "eval-cfg-sweep"
    summary = sweep_dir / "sweep.json"
    if stage_done(sweep_dir) and summary.is_file():
        try:
            rows = json.loads(summary.read_text())
            complete = sorted(row["guidance_scale"] for row in rows) == sorted(SWEEP_SCALES) and all(
                isinstance(row[key], (int, float)) for row in rows for key in ("fd", "accuracy", "recall")
            )
            if complete:
                logger.info("[sweep] reusing %s", summary)
                return rows
        except (ValueError, TypeError, KeyError, AttributeError):
            pass
        # A few seconds of sampling: redone rather than stopping the run over a damaged file.
        logger.warning("[sweep] %s is not a complete sweep; sweeping again", summary)
    from miles.eval.digits.hook import evaluate_pipeline, load_pipeline

    pipeline = load_pipeline(teacher)
    rows = []
    for scale in SWEEP_SCALES:
        logger.info("[sweep] the teacher's %d samples at CFG %g, 28 steps ...", 10 * n_per_class, scale)
        rows.append(
            evaluate_pipeline(
                pipeline,
                name=f"teacher-28step-cfg{scale:g}",
                num_steps=28,
                guidance_scale=scale,
                step_rule="euler",
                n_per_class=n_per_class,
                seed=0,
                out_dir=sweep_dir,
                model="teacher",
            )
        )
    summary.write_text(json.dumps(rows, indent=2, default=str) + "\n")
    mark_done(sweep_dir)
    return rows


def train_eval_trend(run_dir: Path) -> tuple[float, float] | None:
    """``(last, best)`` train-time eval FD of a run (``eval/fd`` in ``metrics.jsonl``), None without evaluations."""
    from miles.utils.tracking import read_metrics

    fds = [record["eval/fd"] for record in read_metrics(run_dir) if record.get("eval/fd") is not None]
    return (fds[-1], min(fds)) if fds else None


def bar_rows(results: list[dict], scale: float, run_dirs: dict[str, Path] | None = None) -> list[list[str]]:
    """The quality bars of docs/digits.md at one CFG scale, for each phase-2 student: (bar, measured, met) rows.

    On the suite's rows (means over the sample seeds when it ran several): FD ≤ the teacher's 28-step FD (1-step
    students: ≤ 1.3 ×), precision ≥ 0.95 × the teacher's, accuracy ≥ the teacher's − 1 point; on the student's
    train-time evaluations (``run_dirs[name]/metrics.jsonl``): the last FD ≤ 1.05 × the run's best."""
    by_name = {row["name"]: row for row in results}
    teacher = by_name.get(f"teacher-28step-cfg{scale:g}")
    rows = []
    for name, row in by_name.items():
        if teacher is None or row.get("model") != "student" or "phase1" in name:
            continue
        factor = 1.3 if row.get("steps") == 1 else 1.0
        limit = teacher["fd"] * factor
        rows.append([f"{name}: FD ≤ {'' if factor == 1 else f'{factor:g} × '}teacher 28-step FD",
                     f"{row['fd']:.3f} vs {limit:.3f}", "yes" if row["fd"] <= limit else "no"])  # fmt: skip
        floor = 0.95 * teacher["precision"]
        rows.append([f"{name}: precision ≥ 0.95 × teacher's", f"{row['precision']:.3f} vs {floor:.3f}",
                     "yes" if row["precision"] >= floor else "no"])  # fmt: skip
        least = teacher["accuracy"] - 0.01
        rows.append([f"{name}: accuracy ≥ teacher's − 1 point", f"{100 * row['accuracy']:.1f}% vs {100 * least:.1f}%",
                     "yes" if row["accuracy"] >= least else "no"])  # fmt: skip
        trend = train_eval_trend(run_dirs[name]) if run_dirs and name in run_dirs else None
        if trend is not None:
            last, best = trend
            rows.append([f"{name}: last train-time FD ≤ 1.05 × the run's best", f"{last:.3f} vs {1.05 * best:.3f}",
                         "yes" if last <= 1.05 * best else "no"])  # fmt: skip
    return rows


def training_rows(run_dirs: dict[str, Path]) -> list[list[str]]:
    """Per student run: its train-time FD at each evaluation (the trend the last-FD bar reads), the discriminator's
    right-vs-wrong-prompt AUC and D(real) − D(fake) at the last evaluation (phase 2), the state each rank held
    (``memory/<group>-{parameters,gradients,optimizer,frozen}_bytes`` summed over the critic and actor groups, DP rank
    0) and the training's wall time (first to last record, Ray's start-up left out)."""
    from miles.utils.tracking import read_metrics

    rows = []
    for name, run_dir in run_dirs.items():
        records = read_metrics(run_dir)
        if name == "teacher" or not records:
            continue
        evals = [record for record in records if record.get("eval/fd") is not None]
        trend = " → ".join(f"{record['eval/fd']:.2f}" for record in evals) or "–"
        last = evals[-1] if evals else {}
        auc, margin = last.get("eval/disc_prompt_auc"), last.get("eval/disc_real_minus_fake")
        memory = next((record for record in records if "memory/actor-parameters_bytes" in record), {})
        state = sum(value for key, value in memory.items() if key.startswith("memory/") and key.endswith("_bytes"))
        seconds = records[-1]["time"] - records[0]["time"]
        rows.append([name, trend, "–" if auc is None else f"{auc:.2f}", "–" if margin is None else f"{margin:+.2f}",
                     f"{state / 2**20:.1f} MiB", f"{seconds:.0f} s"])  # fmt: skip
    return rows


def kept_and_alarms(run_dir: Path) -> dict:
    """A student run's ``--keep-best fd:min`` choice and its collapse alarms, from its ``metrics.jsonl``.

    Returns:
        ``{"best": {"rollout_id", "fd"} or None, "alarms": {figure: [rollout ids]}}``: the last new best the
        driver logged (``best/fd``), and for each health figure (``miles.utils.health.THRESHOLDS``) the rollouts
        whose record read it outside its healthy range (the per-rollout ones every rollout, the evaluations'
        at each evaluation).
    """
    from miles.utils.health import THRESHOLDS, alarms
    from miles.utils.tracking import read_metrics

    best, crossed = None, {}
    for record in read_metrics(run_dir):
        if "best/rollout_id" in record:
            best = {"rollout_id": record["best/rollout_id"], "fd": record.get("best/fd")}
        # Only the alarmed figures; a non-finite one is written as the string "nan" / "inf" (miles.utils.tracking).
        figures = {key: float(value) for key, value in record.items() if key in THRESHOLDS}
        for alarm in alarms(figures):
            rollouts = crossed.setdefault(alarm.split("=")[0], [])
            if record["rollout_id"] not in rollouts:
                rollouts.append(record["rollout_id"])
    return {"best": best, "alarms": crossed}


def _rollouts(ids: list[int]) -> str:
    """``after rollout 3``, ``after rollouts 1, 2``, ``after 40 rollouts (12, 13, 14, 15, …)``."""
    if len(ids) > 4:
        return f"after {len(ids)} rollouts ({', '.join(map(str, ids[:4]))}, …)"
    return f"after rollout{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"


def best_rows(out: Path, run_dirs: dict[str, Path]) -> list[list[str]]:
    """Per student run: the train-time evaluation ``--keep-best fd:min`` kept (its FD, rollout and export) and the
    collapse alarms it raised (:func:`kept_and_alarms`)."""
    rows = []
    for name, run_dir in run_dirs.items():
        if name == "teacher" or not (run_dir / "metrics.jsonl").is_file():
            continue
        info = kept_and_alarms(run_dir)
        best = info["best"]
        export = out / f"{name}-best"
        kept = "–" if best is None else f"{best['fd']:.3f} after rollout {best['rollout_id']}"
        raised = "; ".join(f"{figure} {_rollouts(rollouts)}" for figure, rollouts in info["alarms"].items())
        rows.append([name, kept, f"`{export.name}/`" if export.is_dir() else "–", raised or "none"])
    return rows


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description and the list of ablations as written, and each flag's default where it has a value."""

    def _get_help_string(self, action: argparse.Action) -> str:
        # argparse.ArgumentDefaultsHelpFormatter's hook, minus its "(default: None)" and "(default: False)".
        if action.default in (None, False, [], argparse.SUPPRESS):
            return action.help
        return f"{action.help} (default: %(default)s)"


def ablations_help() -> str:
    """The ``--ablation`` names and the flags each gives the student in place of the recipe's phase-2 flags."""
    lines = [
        "--ablation NAME: the student's flags in place of the recipe's phase 2 "
        f"({shlex.join(PHASE2_FLAGS)}; {{half}} = half of --student-rollouts):"
    ]
    lines += [f"  {name}: {shlex.join(flags) or '(none)'}" for name, flags in ABLATIONS.items()]
    return "\n".join(lines)


def run_dir_path(value: str) -> Path:
    """``--out``'s type: ``Path("")`` would be the current directory, which the recipe would fill unasked."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path; pass the run directory")
    return Path(value)


def check_out_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with one line when ``--out`` cannot hold a run, or when ``--only-ablations`` has no teacher to train on."""
    out = args.out.resolve()
    # Without this check the study would train a teacher of its own first, where a copy without the marker
    # (`cp -r teacher/*` skips dot files) was meant.
    if args.only_ablations and not stage_done(out / "teacher"):
        parser.error(
            f"--only-ablations trains on a finished run's teacher, and {out / 'teacher'} has no {COMPLETE} "
            "(run the recipe first, or copy a finished run with `cp -al`, which keeps the marker)"
        )
    existing = next(path for path in (out, *out.parents) if path.exists())
    if not existing.is_dir():
        parser.error(f"--out {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"--out {out}: {existing} is not writable")


def study_tag(args: argparse.Namespace, with_cfg: bool = True) -> str:
    """The suffix of this invocation's tables and grids, so that a study sits beside the full run instead of replacing
    it: ``""`` for the recipe's own run; else the students an ``--only-ablations`` run adds, the ``--guidance-scale``
    (unless ``with_cfg`` is False: the grids' ``eval-cfg<w>`` already names it) and the ``--student-seed`` that set it
    apart, e.g. ``"-warmup+one-step-seed7"`` (a hash when that would make too long a file name)."""
    parts = []
    if args.only_ablations:
        students = [*dict.fromkeys(args.ablation)]
        students += [flag for flag in ("one-step", "phase1", "unguided") if getattr(args, flag.replace("-", "_"))]
        parts.append("+".join(students))
    if with_cfg and args.guidance_scale is not None:
        parts.append(f"cfg{args.guidance_scale:g}")
    if args.student_seed is not None:
        parts.append(f"seed{args.student_seed}")
    tag = "".join(f"-{part}" for part in parts)
    if len(tag) > MAX_TAG_LENGTH:
        tag = "-study-" + hashlib.sha256(tag.encode()).hexdigest()[:12]
    return tag


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=ablations_help(),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--out", type=run_dir_path, default=REPO / "outputs" / "digits", help="Run directory.")
    parser.add_argument(
        "--guidance-scale", type=float, default=None, help="Teacher CFG to distill; default: the sweep's best."
    )
    parser.add_argument("--teacher-rollouts", type=int, default=300, help="Teacher SFT rollouts (4 steps each).")
    parser.add_argument("--student-rollouts", type=int, default=300, help="DMD2 rollouts per student.")
    parser.add_argument("--one-step", action="store_true", help="Also distill a 1-step phase-2 student.")
    parser.add_argument("--phase1", action="store_true", help="Also distill the phase-1 (no GAN, no EMA) student.")
    parser.add_argument(
        "--unguided",
        action="store_true",
        help="Also distill a phase-2 student at CFG 1 (none when the distilled scale is already 1).",
    )
    parser.add_argument(
        "--quality",
        action="store_true",
        help="The longer quality recipe: the 4-step student and its critic as rank-16 LoRA adapters on the teacher's "
        "base (--ablation lora, named student-4step-cfg<w>-lora) instead of the full-weight student; about 2x the "
        "student's time, and it met the precision, accuracy and trend bars on both training seeds measured, where the "
        "default student has the lower FD (docs/digits.md).",
    )
    parser.add_argument(
        "--ablation",
        action="append",
        default=[],
        choices=sorted(ABLATIONS),
        help="Also distill this variant of the 4-step student (repeatable; the list below gives each one's flags, "
        "docs/digits.md what it measured).",
    )
    parser.add_argument(
        "--only-ablations",
        action="store_true",
        help="Train only the --ablation (and --one-step / --phase1 / --unguided) students, not the recipe's own (an "
        "ablation study on a finished run's teacher, in its --out or a copy of it); the tables go to "
        "summary-<names>.md and eval-cfg<w>-<names>/, beside the full run's.",
    )
    parser.add_argument("--n-per-class", type=int, default=50, help="Evaluation samples per digit.")
    parser.add_argument(
        "--eval-seeds", type=int, default=4, help="Sample seeds 0..N-1 of the final evaluation (means ± std)."
    )
    parser.add_argument(
        "--train-eval-samples", type=int, default=5, help="Train-time eval samples per eval prompt (100 prompts)."
    )
    parser.add_argument(
        "--student-seed",
        type=int,
        default=None,
        help="The students' --seed and --rollout-seed, another training seed of the same teacher (the students' "
        "names end in -seed<N>; the teacher, the sweep and the default seed's students are reused); default 1234 "
        "and 42, the teacher's.",
    )
    parser.add_argument("--ranks", type=int, default=2, help="DP ranks of each trainer group (CPU processes).")
    parser.add_argument("--smoke", action="store_true", help="A few rollouts per stage and a small evaluation.")
    parser.add_argument("--use-wandb", action="store_true", help="Log training and eval media to wandb (offline).")
    args = parser.parse_args(argv)
    # Checked here, before the first stage: a bad value would otherwise surface only in the stage that reads it,
    # possibly after the teacher's training.
    for flag in ("teacher_rollouts", "student_rollouts", "n_per_class", "eval_seeds", "train_eval_samples"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.student_seed is not None and not 0 <= args.student_seed < 2**63:
        parser.error(
            f"--student-seed must be in [0, 2**63 - 1] (train_diffusion.py's --seed), got {args.student_seed}"
        )
    if args.only_ablations and not (args.ablation or args.one_step or args.phase1 or args.unguided):
        parser.error(
            "--only-ablations trains the --ablation, --one-step, --phase1 and --unguided students: name at least one"
        )
    if args.only_ablations and args.quality:
        parser.error(
            "--quality replaces the recipe's student, which --only-ablations does not train: use --ablation lora"
        )
    if args.ranks not in (1, 2):
        # The teacher's 64 pairs per step in micro-batches of 32, and the student's 40-pair rollouts, split over 1
        # or 2 ranks only.
        parser.error(f"--ranks must be 1 or 2 (the recipe's batch sizes split over those), got {args.ranks}")
    if args.guidance_scale is not None and not 1 <= args.guidance_scale <= MAX_GUIDANCE_SCALE:
        parser.error(
            f"--guidance-scale must be a number in [1, {MAX_GUIDANCE_SCALE:g}] (1 = no CFG), got {args.guidance_scale}"
        )
    check_out_dir(parser, args)
    if args.smoke:
        args.teacher_rollouts, args.student_rollouts, args.n_per_class, args.eval_seeds = 2, 2, 3, 1
        args.train_eval_samples = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from miles.utils.log import setup_logging

    # The recipe's own lines only: the evaluation's pipeline loads stay quiet (no loading bars).
    setup_logging("INFO")
    out = args.out.resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # parse_args checked the nearest existing parent; /proc and the like pass that check
        print(f"run_digits.py: error: --out {out} cannot be created: {exc.strerror}", file=sys.stderr)
        return 2
    end_stages_on_sigterm()
    start = time.perf_counter()

    from miles.eval.digits.data import write_digits_jsonl

    data = write_digits_jsonl(out / "data")

    init_dir = out / "init"
    if not stage_done(init_dir):
        # Digit prompts are at most 7 MiniLM tokens: 8 text tokens keep the transformer's sequence short.
        run([sys.executable, "-m", "miles.models.digits", "init", str(init_dir), "--max-length", "8"])
        mark_done(init_dir)

    common = ["--actor-num-gpus-per-node", str(args.ranks)] + (["--use-wandb"] if args.use_wandb else [])
    seeds = ["--seed", "1234", "--rollout-seed", "42"]
    student_seeds = seeds
    if args.student_seed is not None:
        student_seeds = ["--seed", str(args.student_seed), "--rollout-seed", str(args.student_seed)]
    eval_flags = ["--eval-function-path", "miles.eval.digits.digits_eval_hook", "--eval-prompt-data"]

    teacher = out / "teacher"
    run_dirs = {
        "teacher": train(
            "teacher",
            out,
            [*TEACHER_FLAGS, *common, *seeds, "--hf-checkpoint", str(init_dir), "--prompt-data", str(data["train"]),
             "--num-rollout", str(args.teacher_rollouts),
             # The engine only draws the eval images here: the teacher's own sampler, 28 Euler steps with CFG 2.
             "--diffusion-num-steps", "28", "--diffusion-step-rule", "euler", "--diffusion-guidance-scale", "2",
             "--eval-interval", str(max(1, args.teacher_rollouts // 3)), *eval_flags, str(data["eval_prompts"])],
            teacher,
        )
    }  # fmt: skip

    sweep = cfg_sweep(teacher, out, args.n_per_class)
    best = min(sweep, key=lambda row: row["fd"])["guidance_scale"]
    scale = best if args.guidance_scale is None else args.guidance_scale
    logger.info("[sweep] teacher 28-step FD by CFG: %s; distilling at CFG %g",
                ", ".join(f"{row['guidance_scale']:g}: {row['fd']:.3f}" for row in sweep), scale)  # fmt: skip

    # (variant, steps, CFG): "phase2" the recipe's student, "phase1" no GAN and no EMA, else an ABLATIONS name.
    variants = [] if args.only_ablations else [("lora" if args.quality else "phase2", 4, scale)]
    if args.one_step:
        variants.append(("phase2", 1, scale))
    if args.phase1:
        variants.append(("phase1", 4, scale))
    variants += [(name, 4, scale) for name in dict.fromkeys(args.ablation)]
    if args.unguided and scale != 1.0:
        variants.append(("phase2", 4, 1.0))
    variants = list(dict.fromkeys(variants))  # --quality with --ablation lora trains that student once
    if not variants:
        logger.warning("no student to train: --unguided adds none when the distilled CFG is already 1")
    students = {}
    for phase, steps, cfg in variants:
        name = f"student-{steps}step-cfg{cfg:g}" + ("" if phase == "phase2" else f"-{phase}")
        if args.student_seed is not None:
            name += f"-seed{args.student_seed}"  # never the default seed's finished student, reused by its name
        variant_flags = {"phase2": PHASE2_FLAGS, "phase1": [], **ABLATIONS}[phase]
        variant = [flag.format(half=max(1, args.student_rollouts // 2)) for flag in variant_flags]
        if "--dmd2-gan-disc-weight" in variant:
            variant += ["--dmd2-gan-real-data", str(data["train"])]
            if not args.smoke:
                # The discriminator's quality on the held-out reals at every evaluation (eval/disc_*).
                variant += ["--dmd2-gan-eval-real-data", str(data["heldout"])]
        if "--dmd2-regression-weight" in variant:
            count = 20 if args.smoke else REGRESSION_PAIRS
            pairs = regression_pairs(teacher, out, str(data["prompts"]), cfg, count)
            variant += ["--dmd2-regression-pairs", str(pairs)]
        flags = [
            *STUDENT_FLAGS, *variant, *common, *student_seeds,
            "--hf-checkpoint", str(teacher), "--teacher-load", str(teacher),
            "--prompt-data", str(data["prompts"]), "--num-rollout", str(args.student_rollouts),
            "--diffusion-num-steps", str(steps), "--dmd2-teacher-guidance-scale", str(cfg),
            # Six evaluations of the same 500 fixed-noise samples: the trend of a run, not the noise of 100 samples.
            "--eval-interval", str(max(1, args.student_rollouts // 6)), *eval_flags, str(data["eval_prompts"]),
            "--eval-n-samples-per-prompt", str(args.train_eval_samples),
            # The evaluation with the lowest train-time FD, exported beside the last (<name>-best/).
            "--keep-best", "fd:min",
        ]  # fmt: skip
        run_dirs[name] = train(name, out, flags, out / name)
        students[(steps, cfg, phase)] = (name, out / name)

    from miles.eval.digits import evaluate_suite
    from miles.eval.report import format_summary_table

    # The tables' suffix, and the grids' (whose eval-cfg<w> directory names the scale already).
    sections, all_results, tag, grid_tag = [], [], study_tag(args), study_tag(args, with_cfg=False)
    sweep_rows = [[f"{row['guidance_scale']:g}", f"{row['fd']:.3f}", f"{100 * row['accuracy']:.1f}%",
                   f"{row['recall']:.3f}"] for row in sweep]  # fmt: skip
    sections.append(
        "### Teacher CFG sweep (28 Euler steps)\n\n"
        + markdown_table(["CFG", "FD ↓", "accuracy", "recall"], sweep_rows)
        + f"\n\nDistilled at CFG {scale:g}" + (" (the lowest FD)." if args.guidance_scale is None else " (--guidance-scale).")
    )  # fmt: skip
    for cfg in sorted({cfg for _, _, cfg in variants}, reverse=True):
        chosen = {name: str(path) for (_, c, _), (name, path) in students.items() if c == cfg}
        results = evaluate_suite(str(teacher), chosen, out / f"eval-cfg{cfg:g}{grid_tag}", guidance_scale=cfg,
                                 n_per_class=args.n_per_class, seeds=range(args.eval_seeds))  # fmt: skip
        section = f"### CFG {cfg:g}\n\n{format_summary_table(results)}"
        bars = bar_rows(results, cfg, run_dirs)
        if bars:
            section += "\n\n#### Against the quality bar\n\n" + markdown_table(["bar", "measured", "met"], bars)
        sections.append(section)
        all_results += results
    training = training_rows(run_dirs)
    if training:
        header = ["student", "train-time FD at each evaluation", "disc. prompt AUC", "D(real) − D(fake)",
                  "state per rank", "training time"]  # fmt: skip
        sections.append("### Students' training\n\n" + markdown_table(header, training))
    kept = best_rows(out, run_dirs)
    if kept:
        header = ["student", "best train-time FD (--keep-best fd:min)", "exported to", "collapse alarms"]
        sections.append("### Best rollout and collapse alarms\n\n" + markdown_table(header, kept))
    plots = [f"- {name}: " + ", ".join(f"[{png.name}]({png.relative_to(out)})" for png in sorted((run_dir / "plots").glob("*.png")))
             for name, run_dir in run_dirs.items() if (run_dir / "plots").is_dir()]  # fmt: skip
    if plots:
        sections.append("### Training plots\n\n" + "\n".join(plots))
    summary = "\n\n".join(sections)
    (out / f"summary{tag}.md").write_text(f"# Digits DMD2 recipe\n\n{summary}\n")
    (out / f"summary{tag}.json").write_text(
        json.dumps(
            {
                "sweep": sweep,
                "rows": all_results,
                # Per student: the evaluation --keep-best kept and the collapse alarms its run raised.
                "training": {
                    name: kept_and_alarms(run_dir) for name, run_dir in run_dirs.items() if name != "teacher"
                },
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    logger.info("finished in %.0fs; tables in %s and grids under %s", time.perf_counter() - start,
                out / f"summary{tag}.md", out / f"eval-cfg*{grid_tag}")  # fmt: skip
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
