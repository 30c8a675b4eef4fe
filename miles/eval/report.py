"""Summaries of evaluation results: a markdown table, a JSON file, and optional wandb logging.

A result is one row's flat dict of figures and settings, e.g. :func:`miles.eval.metrics.feature_figures`'s figures
plus ``name``, ``n_samples``, ``seed`` and meta fields such as ``model`` ("teacher" / "student" / "real"),
``sampler`` ("euler" / "dmd2"), ``steps`` and ``guidance_scale`` (:func:`miles.eval.digits.metrics.evaluate_images`
returns such dicts). Which keys become columns and wandb scalars is a parameter; the defaults cover those fields.
"""

import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SUMMARY_COLUMNS",
    "WANDB_SCALARS",
    "aggregate_seeds",
    "format_summary_table",
    "write_summary",
    "log_to_wandb",
]

logger = logging.getLogger(__name__)

# (header, result key, formatter). Missing values render as "–" so rows from different sources can share a table.
Column = tuple[str, str, Callable[[Any], str]]
SUMMARY_COLUMNS: list[Column] = [
    ("name", "name", str),
    ("model", "model", str),
    ("sampler", "sampler", str),
    ("steps", "steps", str),
    ("CFG", "guidance_scale", lambda v: f"{float(v):g}"),
    ("n", "n_samples", str),
    ("seed", "seed", lambda v: ",".join(str(seed) for seed in v) if isinstance(v, list | tuple) else str(v)),
    ("accuracy", "accuracy", lambda v: f"{100 * float(v):.1f}%"),
    ("FD ↓", "fd", lambda v: f"{float(v):.3f}"),
    ("precision", "precision", lambda v: f"{float(v):.3f}"),
    ("recall", "recall", lambda v: f"{float(v):.3f}"),
    ("spread", "spread_ratio", lambda v: f"{float(v):.2f}"),
]
WANDB_SCALARS = ("accuracy", "fd", "precision", "recall", "spread_ratio")


def _jsonable(value: Any) -> Any:
    """numpy scalars/arrays and paths → plain JSON values; NaN/inf → None (JSON has no such numbers)."""
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def aggregate_seeds(rows: Sequence[dict], keys: Sequence[str] = WANDB_SCALARS) -> dict:
    """One result from the same evaluation repeated at several sample seeds.

    Each figure in ``keys`` becomes the mean over the rows (NaN when a row lacks it or holds None) and
    ``<key>_std`` its sample standard deviation (``ddof = 1``; NaN for a single row); ``seed`` becomes the list of
    the rows' seeds, ``per_seed`` holds the rows themselves, and every other field is the first row's (``n_samples``
    therefore stays the count of one seed).

    Args:
        rows: result dicts of one configuration, one per seed (at least one).
        keys: the figures to average.

    Raises:
        ValueError: for no rows, or rows of different names.
    """
    if not rows:
        raise ValueError("aggregate_seeds needs at least one row")
    names = {row.get("name") for row in rows}
    if len(names) != 1:
        raise ValueError(f"aggregate_seeds averages one configuration's rows, got names {sorted(map(str, names))}")
    result = dict(rows[0])
    for key in keys:
        values = np.array([np.nan if row.get(key) is None else float(row[key]) for row in rows], dtype=np.float64)
        result[key] = float(values.mean())
        result[f"{key}_std"] = float(values.std(ddof=1)) if len(values) > 1 else float("nan")
    result["seed"] = [row.get("seed") for row in rows]
    result["per_seed"] = list(rows)
    return result


def format_summary_table(results: list[dict], columns: Sequence[Column] = SUMMARY_COLUMNS) -> str:
    """The results as a GitHub markdown table, one row per result.

    A figure with a finite ``<key>_std`` beside it (an :func:`aggregate_seeds` row) renders as ``mean ± std``, both
    through the column's formatter.

    Args:
        results: result dicts; a key that is missing or None renders as "–".
        columns: ``(header, result key, formatter)`` triples, default ``SUMMARY_COLUMNS``.
    """
    header = "| " + " | ".join(title for title, _, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    rows = []
    for result in results:
        cells = []
        for _, key, fmt in columns:
            value = result.get(key)
            std = result.get(f"{key}_std")
            if value is None:
                cells.append("–")
            elif std is not None and math.isfinite(std):
                cells.append(f"{fmt(value)} ± {fmt(std)}")
            else:
                cells.append(fmt(value))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([header, rule, *rows])


def write_summary(
    results: list[dict],
    out_dir: str | os.PathLike,
    *,
    title: str = "Evaluation",
    stem: str = "summary",
    notes: Sequence[str] = (),
    columns: Sequence[Column] = SUMMARY_COLUMNS,
) -> tuple[str, str]:
    """Write ``{stem}.md`` (title, notes, the table) and ``{stem}.json`` (title and results) into ``out_dir``.

    Args:
        results: result dicts (every field is kept in the JSON; numpy values become plain numbers, NaN/inf null).
        out_dir: directory, created if missing.
        title: markdown heading and the JSON's ``title``.
        stem: file name without extension.
        notes: markdown paragraphs between the heading and the table, e.g. how to read the figures.
        columns: the table's columns (see :func:`format_summary_table`).

    Returns:
        ``(md_path, json_path)`` as strings.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out / f"{stem}.md", out / f"{stem}.json"
    markdown = "\n\n".join([f"# {title}", *notes, format_summary_table(results, columns)]) + "\n"
    md_path.write_text(markdown)
    json_path.write_text(json.dumps({"title": title, "results": _jsonable(results)}, indent=2) + "\n")
    logger.info("wrote evaluation summary %s and %s", md_path, json_path)
    return str(md_path), str(json_path)


def log_to_wandb(
    results: list[dict],
    images: dict[str, Any] | None = None,
    step: int | None = None,
    *,
    scalars: Sequence[str] = WANDB_SCALARS,
    columns: Sequence[Column] = SUMMARY_COLUMNS,
) -> bool:
    """Log the figures (``eval/<name>/<metric>``), a summary table and image grids to the active wandb run.

    Does nothing when wandb is not installed or no run is active (``wandb.run is None``), so callers need no
    ``--use-wandb`` check of their own.

    Args:
        results: result dicts, each with a ``name``.
        images: ``{name: PNG path | PIL image | uint8 array}``, logged as ``eval_media/<name>``.
        step: wandb step (e.g. the rollout id); None lets wandb use its own counter.
        scalars: result keys logged as ``eval/<name>/<key>`` (missing or None values are skipped).
        columns: the ``eval/summary`` table's columns (their result keys; see :func:`format_summary_table`).

    Returns:
        True when something was logged.
    """
    try:
        import wandb
    except ImportError:
        return False
    if wandb.run is None:
        return False
    data: dict[str, Any] = {}
    for result in results:
        for key in scalars:
            if result.get(key) is not None:
                data[f"eval/{result['name']}/{key}"] = float(result[key])
    if results:
        keys = [key for _, key, _ in columns]
        data["eval/summary"] = wandb.Table(
            columns=keys, data=[[_jsonable(result.get(key)) for key in keys] for result in results]
        )
    for name, image in (images or {}).items():
        media = os.fspath(image) if isinstance(image, str | os.PathLike) else image
        data[f"eval_media/{name}"] = wandb.Image(media, caption=name)
    wandb.log(data, step=step)
    return True
