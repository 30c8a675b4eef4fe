"""The digits recipe: train a tiny text-to-image teacher on real handwritten digits, distill it with DMD2 into a
4-step (and optionally a 1-step) student, evaluate everything and print the table.

    python examples/digits/run_digits.py                       # the whole recipe (CPU, ~11 min on 2 cores)
    python examples/digits/run_digits.py --one-step --unguided # also a 1-step and an unguided student (~+15 min)
    python examples/digits/run_digits.py --smoke --out /tmp/d  # a few rollouts per stage (CI)

Stages (each reuses its output when that output is complete, so an interrupted run picks up where it stopped):

1. data      ``miles.eval.digits.data``: sklearn's digits, a fixed stratified train / held-out split, JSONL files.
2. init      ``python -m miles.models.digits init``: a fresh 0.6M-parameter SD3 transformer pipeline.
3. teacher   ``train_diffusion.py --loss-type sft_loss --train-only``: flow matching on the train split, with 10%
             of the prompts dropped to the empty prompt so the teacher supports CFG.
4. students  ``train_diffusion.py --loss-type dmd2``: student and critic start from the teacher; the teacher scores
             with CFG ``--guidance-scale``. ``--unguided`` adds a CFG-1 distillation, reported beside the teacher at 1.
5. eval      ``miles.eval.digits.evaluate_suite``: teacher 28 / 4 / 1 Euler steps and each student, at equal CFG.

Every stage is a subprocess running the project's own command line, so the log shows the exact commands to rerun.
"""

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPLETE = ".miles_stage_complete.json"

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


def stage_done(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def mark_done(path: Path, **info) -> None:
    # Replace, never rewrite in place: an export hard-links its source's files, this marker included.
    tmp = path / (COMPLETE + ".tmp")
    tmp.write_text(json.dumps({"finished": time.strftime("%Y-%m-%d %H:%M:%S"), **info}, indent=2))
    os.replace(tmp, path / COMPLETE)


def run(cmd: list[str]) -> None:
    logger.info("$ %s", shlex.join(cmd))
    start = time.perf_counter()
    returncode = subprocess.run(cmd, cwd=REPO).returncode
    if returncode != 0:
        # The stage printed its own error; stop here so no later stage runs on a missing or partial output.
        logger.error("stage failed with exit code %d: %s", returncode, shlex.join(cmd))
        sys.exit(returncode)
    logger.info("  done in %.0fs", time.perf_counter() - start)


def train(name: str, out: Path, flags: list[str], save_hf: Path) -> None:
    """One ``train_diffusion.py`` run exporting to ``save_hf``, skipped when its export is complete."""
    if stage_done(save_hf):
        logger.info("[%s] reusing %s", name, save_hf)
        return
    logger.info("[%s] training -> %s", name, save_hf)
    run_dir = out / "runs" / name  # metrics.jsonl and eval grids; kept apart from the exported pipeline
    cmd = [sys.executable, "train_diffusion.py", *flags, "--save-hf", str(save_hf), "--output-dir", str(run_dir)]
    run(cmd)
    mark_done(save_hf, command=shlex.join(cmd))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "digits", help="Run directory.")
    parser.add_argument("--guidance-scale", type=float, default=3.0, help="Teacher CFG distilled into the student.")
    parser.add_argument("--teacher-rollouts", type=int, default=300, help="Teacher SFT rollouts (4 steps each).")
    parser.add_argument("--student-rollouts", type=int, default=300, help="DMD2 rollouts per student.")
    parser.add_argument("--one-step", action="store_true", help="Also distill a 1-step student.")
    parser.add_argument("--unguided", action="store_true", help="Also distill unguided (teacher CFG 1).")
    parser.add_argument("--n-per-class", type=int, default=50, help="Evaluation samples per digit.")
    parser.add_argument("--ranks", type=int, default=2, help="DP ranks of each trainer group (CPU processes).")
    parser.add_argument("--smoke", action="store_true", help="A few rollouts per stage and a small evaluation.")
    parser.add_argument("--use-wandb", action="store_true", help="Log training and eval media to wandb (offline).")
    args = parser.parse_args(argv)
    # Checked here, before the first stage: a bad value would otherwise surface only in the stage that reads it,
    # possibly after the teacher's hour of training.
    for flag in ("teacher_rollouts", "student_rollouts", "n_per_class"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.ranks not in (1, 2):
        # The teacher's 64 pairs per step in micro-batches of 32, and the student's 40-pair rollouts, split over 1
        # or 2 ranks only.
        parser.error(f"--ranks must be 1 or 2 (the recipe's batch sizes split over those), got {args.ranks}")
    if args.guidance_scale < 1:
        parser.error(f"--guidance-scale must be >= 1 (1 = no CFG), got {args.guidance_scale}")
    if args.smoke:
        args.teacher_rollouts, args.student_rollouts, args.n_per_class = 2, 2, 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    from miles.eval.digits.data import write_digits_jsonl

    data = write_digits_jsonl(out / "data")

    init_dir = out / "init"
    if not stage_done(init_dir):
        # Digit prompts are at most 7 MiniLM tokens: 8 text tokens keep the transformer's sequence short.
        run([sys.executable, "-m", "miles.models.digits", "init", str(init_dir), "--max-length", "8"])
        mark_done(init_dir)

    common = ["--actor-num-gpus-per-node", str(args.ranks), "--seed", "1234", "--rollout-seed", "42"]
    if args.use_wandb:
        common += ["--use-wandb"]
    eval_flags = ["--eval-function-path", "miles.eval.digits.digits_eval_hook", "--eval-prompt-data"]

    teacher = out / "teacher"
    train(
        "teacher",
        out,
        [*TEACHER_FLAGS, *common, "--hf-checkpoint", str(init_dir), "--prompt-data", str(data["train"]),
         "--num-rollout", str(args.teacher_rollouts),
         # The engine only draws the eval images here: the teacher's own sampler, 28 Euler steps with CFG.
         "--diffusion-num-steps", "28", "--diffusion-step-rule", "euler",
         "--diffusion-guidance-scale", str(args.guidance_scale),
         "--eval-interval", str(max(1, args.teacher_rollouts // 3)), *eval_flags, str(data["eval_prompts"])],
        teacher,
    )  # fmt: skip

    students = {}
    variants = [(4, args.guidance_scale)]
    if args.one_step:
        variants.append((1, args.guidance_scale))
    if args.unguided:
        variants.append((4, 1.0))
    for steps, scale in variants:
        name = f"student-{steps}step-cfg{scale:g}"
        flags = [
            *STUDENT_FLAGS, *common,
            "--hf-checkpoint", str(teacher), "--teacher-load", str(teacher),
            "--prompt-data", str(data["prompts"]), "--num-rollout", str(args.student_rollouts),
            "--diffusion-num-steps", str(steps), "--dmd2-teacher-guidance-scale", str(scale),
            "--eval-interval", str(max(1, args.student_rollouts // 3)), *eval_flags, str(data["eval_prompts"]),
        ]  # fmt: skip
        train(name, out, flags, out / name)
        students[(steps, scale)] = (name, out / name)

    from miles.eval.digits import evaluate_suite
    from miles.eval.report import format_summary_table

    tables, all_results = [], []
    for scale in sorted({scale for _, scale in variants}, reverse=True):
        chosen = {name: str(path) for (steps, s), (name, path) in students.items() if s == scale}
        results = evaluate_suite(
            str(teacher),
            chosen,
            out / f"eval-cfg{scale:g}",
            guidance_scale=scale,
            n_per_class=args.n_per_class,
            seed=0,
        )
        tables.append(f"### CFG {scale:g}\n\n{format_summary_table(results)}")
        all_results += results
    summary = "\n\n".join(tables)
    (out / "summary.md").write_text(f"# Digits DMD2 recipe\n\n{summary}\n")
    (out / "summary.json").write_text(json.dumps(all_results, indent=2, default=str) + "\n")
    logger.info("finished in %.0fs; tables in %s and grids under %s/eval-cfg*/", time.perf_counter() - start,
                out / "summary.md", out)  # fmt: skip
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
