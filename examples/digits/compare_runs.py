"""Compare the train-time evaluations of several digits runs: one PNG with a line per run for each figure, and
the markdown rows of the trend (the FD at every evaluation, the last one against the run's best).

    python examples/digits/compare_runs.py --out ablation.png \\
        recipe=outputs/digits/runs/student-4step-cfg1 ema=/tmp/runs/ema ...

Each ``NAME=RUN_DIR`` names a ``train_diffusion.py --output-dir`` (its ``metrics.jsonl``); runs evaluated every
``--eval-interval`` rollouts on the same fixed eval samples are comparable point by point.
"""

import argparse
import json
import sys
from pathlib import Path

FIGURES = ("fd", "accuracy", "precision", "recall")


def eval_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{figure: [(rollout, value), ...]}`` of a run's ``eval/<figure>`` records, in rollout order.

    Raises:
        FileNotFoundError: when the run has no ``metrics.jsonl``.
        ValueError: for a line of it that is not JSON.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl; pass a train_diffusion.py --output-dir")
    series: dict[str, list[tuple[int, float]]] = {}
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{line_no} is not valid JSON (a run killed mid-write?)") from None
        for key, value in record.items():
            if key.startswith("eval/") and isinstance(value, int | float):
                series.setdefault(key.removeprefix("eval/"), []).append((int(record["rollout_id"]), float(value)))
    return {key: sorted(points) for key, points in series.items()}


def trend_rows(runs: dict[str, dict]) -> list[str]:
    """Markdown rows: run, the FD at each evaluation, and last / best."""
    rows = ["| run | train-time FD at each evaluation | last / best |", "|---|---|---|"]
    for name, series in runs.items():
        fds = [value for _, value in series.get("fd", [])]
        if fds:
            rows.append(f"| {name} | {' → '.join(f'{fd:.2f}' for fd in fds)} | {fds[-1] / min(fds):.3f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="NAME=RUN_DIR of each run.")
    parser.add_argument("--out", type=Path, required=True, help="The PNG to write.")
    args = parser.parse_args(argv)
    runs = {}
    for item in args.runs:
        name, sep, run_dir = item.partition("=")
        if not sep:
            parser.error(f"each run is NAME=RUN_DIR, got {item!r}")
        try:
            runs[name] = eval_series(Path(run_dir))
        except (OSError, ValueError) as exc:  # a missing run, or a metrics.jsonl cut by a crash
            parser.error(str(exc))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4.2 * len(FIGURES), 3.4))
    for ax, figure in zip(axes, FIGURES):
        for name, series in runs.items():
            if figure in series:
                steps, values = zip(*series[figure])
                ax.plot(steps, values, marker="o", markersize=3, label=name)
        ax.set_title(f"eval/{figure}")
        ax.set_xlabel("rollout")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print("\n".join(trend_rows(runs)))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
