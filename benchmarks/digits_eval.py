"""Rerun the digits evaluation of a teacher and its DMD2 students and print the summary table.

    python benchmarks/digits_eval.py --teacher outputs/digits/teacher \\
        --student student-4step-cfg3=outputs/digits/student-4step-cfg3 \\
        --student student-1step-cfg3=outputs/digits/student-1step-cfg3 \\
        --guidance-scale 3 --n-per-class 50 --seeds 0 1 2 3 --out outputs/digits/eval

Rows: the teacher at ``--teacher-steps`` Euler steps (28 4 1) with CFG ``--guidance-scale``; each student at its
exported schedule (plus ``--student-steps`` extra step counts); the real-digits baseline at the same sample count.
With several ``--seeds`` every row is the mean ± standard deviation over them.
Writes ``summary.md``, ``summary.json`` and one PNG grid per row into ``--out`` (see ``miles.eval.digits.hook``).
"""

import argparse
import logging
import os
import sys

from miles.eval.digits.hook import TEACHER_STEPS, evaluate_suite
from miles.eval.report import format_summary_table


def parse_student(value: str) -> tuple[str, str]:
    """``NAME=DIR`` → ``(NAME, DIR)``."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--student takes NAME=DIR (e.g. student-4step=outputs/s4), got {value!r}")
    return name, path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", default=None, help="Teacher pipeline directory (omit for students only).")
    parser.add_argument(
        "--student", type=parse_student, action="append", default=[], help="NAME=DIR of an exported student."
    )
    parser.add_argument("--guidance-scale", type=float, required=True, help="The teacher's CFG scale.")
    parser.add_argument("--n-per-class", type=int, default=50, help="Samples per digit (10x this per row).")
    parser.add_argument("--seed", type=int, default=0, help="Noise seed of every row (one seed).")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="Several noise seeds: each row is their mean ± std."
    )
    parser.add_argument("--out", required=True, help="Output directory: summary.md, summary.json, grids.")
    parser.add_argument("--teacher-steps", type=int, nargs="+", default=list(TEACHER_STEPS))
    parser.add_argument(
        "--student-steps", type=int, nargs="*", default=[], help="Extra step counts for every student (e.g. 1)."
    )
    parser.add_argument("--cache-dir", default=None, help="Digits classifier cache (default ~/.cache/miles/eval).")
    args = parser.parse_args(argv)
    if args.teacher is None and not args.student:
        parser.error("give --teacher and/or at least one --student NAME=DIR")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    results = evaluate_suite(
        args.teacher,
        dict(args.student),
        args.out,
        guidance_scale=args.guidance_scale,
        n_per_class=args.n_per_class,
        seed=args.seed,
        seeds=args.seeds,
        teacher_steps=args.teacher_steps,
        student_steps=[None, *args.student_steps],
        cache_dir=args.cache_dir,
    )
    print(format_summary_table(results))
    print(f"\nwrote {os.path.join(args.out, 'summary.md')} and the grids in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
