"""Training plots of one run, drawn from its ``metrics.jsonl`` with matplotlib (Agg canvas, no display needed).

Run::

    python -m miles.plot RUN_DIR [--out DIR]     # PNGs into DIR, default RUN_DIR/plots/

or call :func:`plot_run` (the recipe does at the end of each stage). Figures, each written only when at least one
of its keys is in the file (the names: docs/architecture.md, "Metrics"), so an SFT run simply gets fewer of them:

* ``losses.png``: ``train/loss`` (actor) and ``train/<role>-loss`` (critic, ...), one panel per group.
* ``grad_norms.png``: ``train/grad_norm`` and ``train/<role>-grad_norm``.
* ``learning_rates.png``: ``train/lr`` and ``train/<role>-lr``.
* ``dmd2.png``: ``train/dmd2_grad_abs_mean``, ``train/dmd2_loss``, the ``train/x0_*`` gaps, then any other
  ``train/dmd2_*`` (e.g. ``dmd2_nonfinite_frac``).
* ``eval.png``: every numeric ``eval/*`` per rollout (fd, accuracy, recall, ...; the ``eval/samples`` path is not
  a number and is skipped).
* ``time_breakdown.png``: per rollout, the seconds of each in-worker phase (``perf/<role>-wake_time``,
  ``-generate_time``, ``-train_steps_time``, ``-train_output_time``, ``-sleep_time``) stacked, topped by the rest of
  ``perf/step_time`` labelled "driver and Ray". A run without in-worker timers stacks the driver's own timers
  (``perf/rollout_time``, ``perf/<role>_train_time``, ``perf/update_weights_time``, ...) instead; they are
  consecutive intervals of one rollout, so they stack too.
* ``health.png``: every ``health/*`` per rollout (the evaluations' ``health/eval_*`` at each evaluation), and the
  eval hook's collapse figures ``eval/diversity_ratio`` and ``eval/saturated_excess``; a dashed line marks each
  alarm threshold (:data:`miles.utils.health.THRESHOLDS`).

How the file is read:

* Records of several jobs (driver, actor, critic, a resumed driver) interleave in one file; each key is collected on
  its own, so the order of jobs does not matter. Lines that are not JSON objects (a line cut by a killed process) are
  skipped with one warning.
* Per-step train records are placed at their group's optimizer step: the record's ``step``, else its
  ``train/step`` / ``train/<role>-step`` counter. Records without either are placed evenly within their rollout.
* A resumed run repeats rollout ids: the last value per (key, rollout, step) wins. Without a step counter, a new pass
  over a rollout replaces the earlier pass as a whole.
* Non-finite values (written as the strings ``"nan"``, ``"inf"``, ``"-inf"``) are not drawn as points; a red ``x``
  on the panel's top edge marks each step where one occurred.
* Noisy series (train and health, at least :data:`SMOOTH_MIN_POINTS` points) are drawn as faint raw points under a
  centred running mean over about 5 % of the points (:func:`running_mean`). A panel whose positive values span more
  than :data:`LOG_SPAN` switches to a log y axis (losses, gradient norms, DMD2 figures).
"""

import argparse
import json
import logging
import math
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from miles.utils.health import EVAL_FIGURES, THRESHOLDS
from miles.utils.tracking import METRICS_FILE

__all__ = [
    "plot_run",
    "collect_series",
    "time_breakdown",
    "running_mean",
    "main",
    "Series",
    "SMOOTH_MIN_POINTS",
    "LOG_SPAN",
    "REST_DRIVER_AND_RAY",
    "REST_OF_ROLLOUT",
]

logger = logging.getLogger(__name__)

SMOOTH_MIN_POINTS = 20  # fewer points than this are drawn as they are: nothing to smooth
LOG_SPAN = 30.0  # max / min of a panel's positive values above which its y axis is logarithmic

_PREFIXES = ("train/", "perf/", "eval/", "health/")
_STEP_KEY = re.compile(r"^train/(?:[^/]+-)?step$")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

_DMD2_ORDER = ("dmd2_grad_abs_mean", "dmd2_loss", "x0_mean_abs_diff", "x0_max_abs_diff", "x0_rel_max")
_WORKER_PHASES = ("wake", "generate", "train_steps", "train_output", "sleep")
_WORKER_TIMER = re.compile(r"^perf/(?P<role>[^/]+)-(?P<phase>" + "|".join(_WORKER_PHASES) + r")_time$")
_DRIVER_TIMER = re.compile(
    r"^perf/(?:rollout_time|[^/-]+_train_time|update_weights_time|sleep_wake_time|save_time|eval_time)$"
)
_DPI = 100

REST_DRIVER_AND_RAY = "driver and Ray"  # perf/step_time minus the in-worker phases
REST_OF_ROLLOUT = "rest of the rollout"  # perf/step_time minus the driver's own timers


@dataclass
class Series:
    """One metric's points after de-duplication, in (rollout, step) order.

    Attributes:
        key: the metric name, e.g. ``"train/critic-loss"``.
        x: float64 ``[n]``: the group's optimizer step for train keys whose records carry one, else the rollout id
            (step-less train points at ``rollout + i / points_in_that_rollout``).
        y: float64 ``[n]``: the values; nan / ±inf where the file holds ``"nan"`` / ``"inf"`` / ``"-inf"``.
        x_label: ``"optimizer step (<role>)"`` or ``"rollout"``.
    """

    key: str
    x: np.ndarray
    y: np.ndarray
    x_label: str


def _as_float(value: Any) -> float | None:
    """A metric value as a float, or None for what is not a number (an image path, a bool, a list)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return _NON_FINITE.get(value)
    return None


def _record_step(record: dict[str, Any]) -> float | None:
    """The optimizer step a train record belongs to: ``step``, else its ``train/[<role>-]step`` counter."""
    for key, value in record.items():
        if key == "step" or _STEP_KEY.match(key):
            step = _as_float(value)
            if step is not None and math.isfinite(step):
                return step
    return None


def _train_role_and_name(key: str) -> tuple[str, str]:
    """``train/loss`` → ("actor", "loss"); ``train/critic-loss`` → ("critic", "loss") (docs/architecture.md, "Metrics")."""
    rest = key[len("train/") :]
    if "-" in rest:
        role, name = rest.split("-", 1)
        return role, name
    return "actor", rest


def _read_records(path: Path) -> list[dict[str, Any]]:
    records, skipped = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            else:
                skipped += 1
    if skipped:
        logger.warning("%s: skipped %d line(s) that are not JSON objects", path, skipped)
    return records


def collect_series(records: Iterable[dict[str, Any]]) -> dict[str, Series]:
    """Every numeric ``train/``, ``perf/``, ``eval/`` and ``health/`` metric of ``records``, de-duplicated.

    Args:
        records: ``metrics.jsonl`` records in file order (several jobs interleaved); records without an integer
            ``rollout_id`` and values that are not numbers (image paths) are ignored, as are the step counters
            ``train/step`` / ``train/<role>-step`` themselves.

    Returns:
        ``{key: Series}`` in the order keys first appear. The last value per (key, rollout, step) wins; for train
        records without a step counter a new pass over a rollout (a resumed run) replaces the earlier pass.
    """
    # key → rollout → position within the rollout (step, or pass index without one) → value
    points: dict[str, dict[int, dict[float, float]]] = {}
    stepped: dict[str, bool] = {}  # train keys: did every point carry an optimizer step?
    passes: dict[str, tuple[int, int]] = {}  # step-less train key → (rollout of the current pass, points so far)
    for record in records:
        rollout = record.get("rollout_id")
        if isinstance(rollout, bool) or not isinstance(rollout, int):
            continue
        step = _record_step(record)
        for key, raw in record.items():
            if not key.startswith(_PREFIXES) or _STEP_KEY.match(key):
                continue
            value = _as_float(raw)
            if value is None:
                continue
            by_rollout = points.setdefault(key, {})
            if not key.startswith("train/"):
                position = 0.0
            elif step is not None:
                position = step
                stepped.setdefault(key, True)
            else:
                stepped[key] = False
                current, count = passes.get(key, (None, 0))
                if current != rollout:
                    # First visit, or a resumed run repeating this rollout: the new pass replaces the old one.
                    by_rollout[rollout] = {}
                    count = 0
                passes[key] = (rollout, count + 1)
                position = float(count)
            by_rollout.setdefault(rollout, {})[position] = value

    series = {}
    for key, by_rollout in points.items():
        xs, ys = [], []
        if key.startswith("train/") and stepped.get(key, False):
            for rollout in sorted(by_rollout):
                for step in sorted(by_rollout[rollout]):
                    xs.append(step)
                    ys.append(by_rollout[rollout][step])
            x_label = f"optimizer step ({_train_role_and_name(key)[0]})"
        else:
            # Per-rollout keys sit on the rollout id; step-less train points spread evenly within their rollout.
            for rollout in sorted(by_rollout):
                positions = sorted(by_rollout[rollout])
                for i, position in enumerate(positions):
                    xs.append(rollout + i / len(positions))
                    ys.append(by_rollout[rollout][position])
            x_label = "rollout"
        series[key] = Series(key, np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64), x_label)
    return series


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Centred running mean over ``window`` points that ignores non-finite values.

    Args:
        values: float ``[n]``; nan / ±inf entries are left out of every mean.
        window: points per mean (≥ 1); near the ends the window is cut short rather than padded.

    Returns:
        float64 ``[n]``: entry ``i`` is the mean of the finite values among ``values[i - window // 2 :
        i - window // 2 + window]``, nan where there are none.
    """
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    index = np.arange(len(values))
    lo = np.clip(index - window // 2, 0, len(values))
    hi = np.clip(index - window // 2 + window, 0, len(values))
    count = counts[hi] - counts[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (sums[hi] - sums[lo]) / count, np.nan)


def _wants_log(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    return len(finite) > 1 and bool((finite > 0).all()) and finite.max() / finite.min() > LOG_SPAN


def _draw_series(ax, series: Series, *, smooth: bool, log: bool, y_label: str, limits: bool = False) -> None:
    x, y = series.x, series.y
    finite = np.isfinite(y)
    if smooth and finite.sum() >= SMOOTH_MIN_POINTS:
        window = max(3, min(50, len(y) // 20))
        ax.plot(x[finite], y[finite], ls="none", marker=".", ms=3, alpha=0.35, color="C0", label="per point")
        ax.plot(x, running_mean(y, window), lw=1.6, color="C0", label=f"running mean of {window}")
    else:
        ax.plot(x[finite], y[finite], marker="o", ms=3, lw=1.2, color="C0")
    bad = ~finite
    if bad.any():
        # Marked on the top edge (axes coordinates in y) so a nan loss is visible however the y axis is scaled.
        ax.plot(
            x[bad],
            np.ones(int(bad.sum())),
            ls="none",
            marker="x",
            ms=6,
            color="red",
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            label=f"non-finite ({int(bad.sum())})",
        )
    if limits and series.key in THRESHOLDS:
        for bound in THRESHOLDS[series.key]:
            if math.isfinite(bound):
                ax.axhline(bound, ls="--", lw=1.0, color="red", alpha=0.6, label=f"alarm at {bound:g}")
    if log and _wants_log(y):
        ax.set_yscale("log")
    ax.set_title(series.key, fontsize=10)
    ax.set_xlabel(series.x_label)
    ax.set_ylabel(y_label)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")


def _panel_figure(
    series: list[Series], path: Path, title: str, *, smooth: bool, log: bool, unit: str, limits: bool = False
) -> Path:
    """One panel per series, three to a row; the y label is ``unit``, or the metric's own name without one; with
    ``limits`` each series' alarm thresholds as dashed lines."""
    columns = min(3, len(series))
    rows = -(-len(series) // columns)
    fig = Figure(figsize=(5.0 * columns, 3.6 * rows), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    for i, item in enumerate(series):
        _draw_series(
            fig.add_subplot(rows, columns, i + 1),
            item,
            smooth=smooth,
            log=log,
            y_label=unit or item.key.rsplit("/", 1)[-1],
            limits=limits,
        )
    fig.suptitle(title)
    fig.savefig(path, format="png")
    return path


def _train_keys(series: dict[str, Series], names: tuple[str, ...]) -> list[Series]:
    """Train series whose name is in ``names``, the actor's first, then other groups in first-seen order."""
    keys = [key for key in series if key.startswith("train/") and _train_role_and_name(key)[1] in names]
    roles = list(dict.fromkeys(_train_role_and_name(key)[0] for key in keys))
    rank = {role: (role != "actor", i) for i, role in enumerate(roles)}
    keys.sort(key=lambda key: (rank[_train_role_and_name(key)[0]], names.index(_train_role_and_name(key)[1])))
    return [series[key] for key in keys]


def _dmd2_keys(series: dict[str, Series]) -> list[Series]:
    named = [key for key in series if key.startswith("train/") and _train_role_and_name(key)[0] == "actor"]
    first = [f"train/{name}" for name in _DMD2_ORDER if f"train/{name}" in series]
    rest = [key for key in named if key not in first and key.startswith(("train/dmd2_", "train/x0_"))]
    return [series[key] for key in first + rest]


def _phase_label(key: str) -> str:
    """``perf/critic-train_steps_time`` → "critic train steps"; ``perf/rollout_time`` → "rollout"."""
    return key[len("perf/") : -len("_time")].replace("-", " ").replace("_", " ")


def time_breakdown(series: dict[str, Series]) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """Seconds per rollout of each phase, as ``time_breakdown.png`` stacks them.

    The phases are the in-worker timers ``perf/<role>-{wake,generate,train_steps,train_output,sleep}_time`` (actor
    first, then other groups; per group in that order), or, in a run that has none of them, the driver's consecutive
    timers (``perf/rollout_time``, ``perf/<role>_train_time``, ``perf/update_weights_time``, ``perf/sleep_wake_time``,
    ``perf/save_time``, ``perf/eval_time``). With ``perf/step_time`` a last entry holds the rest of the rollout:
    :data:`REST_DRIVER_AND_RAY` after in-worker phases, :data:`REST_OF_ROLLOUT` after driver timers (0 where the
    phases add up to more, e.g. groups whose phases overlap in time).

    Args:
        series: :func:`collect_series` of the run.

    Returns:
        ``(rollouts, {label: seconds})``: float64 ``[R]`` rollout ids and float64 ``[R]`` seconds per label, 0 for a
        phase a rollout did not time and for non-finite timers; None without any ``perf/`` timer.
    """
    worker = [key for key in series if _WORKER_TIMER.match(key)]
    if worker:
        roles = list(dict.fromkeys(_WORKER_TIMER.match(key)["role"] for key in worker))

        def order(key):
            match = _WORKER_TIMER.match(key)
            return match["role"] != "actor", roles.index(match["role"]), _WORKER_PHASES.index(match["phase"])

        phases, rest_label = sorted(worker, key=order), REST_DRIVER_AND_RAY
    else:
        phases, rest_label = [key for key in series if _DRIVER_TIMER.match(key)], REST_OF_ROLLOUT
    total = series.get("perf/step_time")
    if not phases and total is None:
        return None

    def per_rollout(item: Series) -> dict[int, float]:
        return {int(x): float(y) if math.isfinite(y) else 0.0 for x, y in zip(item.x, item.y)}

    columns = {_phase_label(key): per_rollout(series[key]) for key in phases}
    totals = per_rollout(total) if total is not None else {}
    rollouts = sorted(set(totals).union(*columns.values()))
    stack = {label: np.asarray([values.get(r, 0.0) for r in rollouts]) for label, values in columns.items()}
    if total is not None:
        summed = sum(stack.values(), np.zeros(len(rollouts)))
        whole = np.asarray([totals.get(r, 0.0) for r in rollouts])
        stack[rest_label] = np.clip(whole - summed, 0.0, None)
    return np.asarray(rollouts, dtype=np.float64), stack


def _time_breakdown_figure(rollouts: np.ndarray, stack: dict[str, np.ndarray], path: Path, title: str) -> Path:
    fig = Figure(figsize=(11.0, 4.8), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bottom = np.zeros(len(rollouts))
    width = 0.85 if len(rollouts) <= 100 else 1.0
    for i, (label, seconds) in enumerate(stack.items()):
        color = "0.6" if label in (REST_DRIVER_AND_RAY, REST_OF_ROLLOUT) else f"C{i % 10}"
        mean = f"mean {seconds.mean():.3g} s"
        ax.bar(rollouts, seconds, width=width, bottom=bottom, color=color, lw=0, label=f"{label} ({mean})")
        bottom = bottom + seconds
    ax.set_xlabel("rollout")
    ax.set_ylabel("seconds")
    ax.set_title("time per rollout by phase (perf/*)", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    # Reversed so the legend reads top to bottom like the stack.
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title)
    fig.savefig(path, format="png")
    return path


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the run's PNG plots (see the module docstring for the figures) and return their paths.

    Args:
        run_dir: a run directory holding ``metrics.jsonl`` (``--output-dir`` of ``train_diffusion.py``).
        out_dir: where the PNGs go (created); default ``run_dir/plots``.

    Returns:
        The written files in the order losses, grad_norms, learning_rates, dmd2, eval, time_breakdown, health;
        a figure none of whose keys is in the file is not written. ``[]`` for a file without plottable keys.

    Raises:
        FileNotFoundError: if ``run_dir`` or its ``metrics.jsonl`` does not exist.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir} has no {METRICS_FILE}; pass the --output-dir of a training run")
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "plots"
    series = collect_series(_read_records(metrics))
    name = run_dir.resolve().name

    def keys(prefix: str) -> list[Series]:
        return [item for key, item in series.items() if key.startswith(prefix)]

    if series:
        out_dir.mkdir(parents=True, exist_ok=True)
    # (file, title, series, smoothed, log y where it helps, y label; "" = the metric's name)
    panels = (
        ("losses.png", "losses", _train_keys(series, ("loss",)), True, True, "loss"),
        ("grad_norms.png", "gradient norms", _train_keys(series, ("grad_norm",)), True, True, "L2 norm"),
        ("learning_rates.png", "learning rates", _train_keys(series, ("lr",)), False, False, "learning rate"),
        ("dmd2.png", "DMD2", _dmd2_keys(series), True, True, ""),
        ("eval.png", "evaluation", keys("eval/"), False, False, ""),
    )
    written = []
    for filename, title, items, smooth, log, unit in panels:
        if items:
            written.append(
                _panel_figure(items, out_dir / filename, f"{name}: {title}", smooth=smooth, log=log, unit=unit)
            )
    breakdown = time_breakdown(series)
    if breakdown is not None:
        path = out_dir / "time_breakdown.png"
        written.append(_time_breakdown_figure(*breakdown, path, f"{name}: time breakdown"))
    health = keys("health/") + [series[key] for key in EVAL_FIGURES if key.startswith("eval/") and key in series]
    if health:
        path = out_dir / "health.png"
        written.append(_panel_figure(health, path, f"{name}: health", smooth=True, log=False, unit="", limits=True))
    if written:
        logger.info("plots of %s in %s: %s", run_dir, out_dir, ", ".join(path.name for path in written))
    else:
        logger.info("plots of %s: none, %s holds no train/perf/eval/health numbers", run_dir, metrics)
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m miles.plot RUN_DIR [--out DIR]``: 0 on success, 2 (one line on stderr) without metrics."""
    parser = argparse.ArgumentParser(
        prog="python -m miles.plot", description="Write PNG training plots from RUN_DIR/metrics.jsonl."
    )
    parser.add_argument("run_dir", type=Path, help="run directory (--output-dir of train_diffusion.py)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        plot_run(args.run_dir, args.out)
    except FileNotFoundError as exc:
        print(f"miles.plot: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
