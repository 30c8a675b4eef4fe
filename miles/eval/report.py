"""Summaries of evaluation results: a markdown table, a JSON file, and optional wandb logging.

A result is the dict returned by :func:`miles.eval.metrics.evaluate_images`, usually with the meta fields
``model`` ("teacher" / "student" / "real"), ``sampler`` ("euler" / "dmd2"), ``steps`` and ``guidance_scale``.
"""

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SUMMARY_COLUMNS", "format_summary_table", "write_summary", "log_to_wandb"]

logger = logging.getLogger(__name__)

# (header, result key, formatter). Missing values render as "–" so rows from different sources can share a table.
SUMMARY_COLUMNS = [
    ("name", "name", str),
    ("model", "model", str),
    ("sampler", "sampler", str),
    ("steps", "steps", str),
    ("CFG", "guidance_scale", lambda v: f"{float(v):g}"),
    ("n", "n_samples", str),
    ("seed", "seed", str),
    ("accuracy", "accuracy", lambda v: f"{100 * float(v):.1f}%"),
    ("FD ↓", "fd", lambda v: f"{float(v):.3f}"),
    ("precision", "precision", lambda v: f"{float(v):.3f}"),
    ("recall", "recall", lambda v: f"{float(v):.3f}"),
    ("spread", "spread_ratio", lambda v: f"{float(v):.2f}"),
]
_WANDB_SCALARS = ("accuracy", "fd", "precision", "recall", "spread_ratio")


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


def format_summary_table(results: list[dict]) -> str:
    """The results as a GitHub markdown table, one row per result, columns as in ``SUMMARY_COLUMNS``."""
    header = "| " + " | ".join(title for title, _, _ in SUMMARY_COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in SUMMARY_COLUMNS) + "|"
    rows = []
    for result in results:
        cells = []
        for _, key, fmt in SUMMARY_COLUMNS:
            value = result.get(key)
            cells.append("–" if value is None else fmt(value))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([header, rule, *rows])


def write_summary(
    results: list[dict], out_dir: str | os.PathLike, *, title: str = "Digits evaluation", stem: str = "summary"
) -> tuple[str, str]:
    """Write ``{stem}.md`` (title, how to read the figures, the table) and ``{stem}.json`` into ``out_dir``.

    Args:
        results: dicts from :func:`miles.eval.metrics.evaluate_images` (any extra fields are kept in the JSON).
        out_dir: directory, created if missing.
        title: markdown heading.
        stem: file name without extension.

    Returns:
        ``(md_path, json_path)`` as strings.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out / f"{stem}.md", out / f"{stem}.json"
    references = sorted({r["n_reference"] for r in results if r.get("n_reference") is not None})
    classifier_acc = sorted({r["classifier_heldout_accuracy"] for r in results if "classifier_heldout_accuracy" in r})
    notes = [
        "Figures use the features of a digits MLP classifier"
        + (f" (held-out accuracy {100 * classifier_acc[0]:.1f}%)" if len(classifier_acc) == 1 else "")
        + " and compare against the real held-out digits"
        + (f" ({references[0]} images)" if len(references) == 1 else "")
        + ".",
        "accuracy: generated images classified as their prompt's digit. FD: Fréchet distance of classifier features "
        "(Heusel et al. 2017; lower is better, biased upward at small n: compare rows at equal n and against the "
        "real-digits row). precision / recall: k-NN manifold estimates (Kynkäänniemi et al. 2019). spread: "
        "within-class feature spread relative to real digits (1 = real-like variety).",
    ]
    markdown = f"# {title}\n\n" + "\n\n".join(notes) + "\n\n" + format_summary_table(results) + "\n"
    md_path.write_text(markdown)
    json_path.write_text(json.dumps({"title": title, "results": _jsonable(results)}, indent=2) + "\n")
    logger.info("wrote evaluation summary %s and %s", md_path, json_path)
    return str(md_path), str(json_path)


def log_to_wandb(results: list[dict], images: dict[str, Any] | None = None, step: int | None = None) -> bool:
    """Log the figures (``eval/<name>/<metric>``), a summary table and image grids to the active wandb run.

    Does nothing when wandb is not installed or no run is active (``wandb.run is None``), so callers need no
    ``--use-wandb`` check of their own.

    Args:
        results: dicts from :func:`miles.eval.metrics.evaluate_images`.
        images: ``{name: PNG path | PIL image | uint8 array}``, logged as ``eval_media/<name>``.
        step: wandb step (e.g. the rollout id); None lets wandb use its own counter.

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
        for key in _WANDB_SCALARS:
            if result.get(key) is not None:
                data[f"eval/{result['name']}/{key}"] = float(result[key])
    if results:
        columns = [key for _, key, _ in SUMMARY_COLUMNS]
        data["eval/summary"] = wandb.Table(
            columns=columns, data=[[_jsonable(result.get(key)) for key in columns] for result in results]
        )
    for name, image in (images or {}).items():
        media = os.fspath(image) if isinstance(image, str | os.PathLike) else image
        data[f"eval_media/{name}"] = wandb.Image(media, caption=name)
    wandb.log(data, step=step)
    return True
