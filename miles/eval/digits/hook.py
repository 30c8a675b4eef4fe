"""Evaluate digits pipelines (teacher, DMD2 students) by sampling them and scoring the digits against real ones.

* :func:`evaluate_pipeline`: one row: ``n_per_class`` samples of each digit prompt from a pipeline directory at a
  given schedule and CFG, scored by :func:`miles.eval.digits.metrics.evaluate_images`, with a PNG grid.
* :func:`evaluate_suite`: the distillation comparison: the teacher at 28 / 4 / 1 Euler steps, each student at
  its exported schedule, and the real-digits row, at one CFG scale; writes ``summary.md`` and ``summary.json``.
* :func:`digits_eval_hook`: the train-time ``--eval-function-path`` hook.

Sampling: sample ``i = label·n_per_class + j`` (``j < n_per_class``) is prompted with digit ``label``'s prompt and
drawn by :class:`~miles.models.digits_pipeline.DigitsPipeline` with noise keyed by ``(seed, "eval", i)``, so every
row of a suite with the same seed starts from the same noise, and a row is reproducible from its seed alone.

Students and CFG: a DMD2 student distils the teacher *with* the teacher's CFG scale and samples unguided, so its
row reports ``guidance_scale`` = the distilled scale (``sampling_guidance_scale`` = 1) and stands beside the
teacher's rows at that scale.
"""

import logging
import os
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from miles.eval.digits.data import DIGIT_PROMPTS, load_split
from miles.eval.digits.grids import save_digit_grid
from miles.eval.digits.metrics import evaluate_images, evaluate_real_baseline, summary_notes
from miles.eval.grids import eval_grid_path
from miles.eval.report import aggregate_seeds, log_to_wandb, write_summary
from miles.models.digits_pipeline import DigitsPipeline
from miles.utils.health import reference_figures

__all__ = [
    "TEACHER_STEPS",
    "digits_eval_hook",
    "eval_grid_path",
    "evaluate_pipeline",
    "evaluate_suite",
    "load_pipeline",
    "sample_digits",
]

logger = logging.getLogger(__name__)

TEACHER_STEPS = (28, 4, 1)
_NUM_CLASSES = 10
_GRID_PER_ROW = 10
_HOOK_FIGURES = ("accuracy", "fd", "precision", "recall", "spread_ratio")


def load_pipeline(pipeline: str | os.PathLike | DigitsPipeline) -> DigitsPipeline:
    """A ``DigitsPipeline`` in eval mode: the given one, or loaded from a pipeline directory.

    Raises:
        FileNotFoundError: when the directory has no ``model_index.json``.
    """
    if isinstance(pipeline, DigitsPipeline):
        return pipeline
    if not (Path(pipeline) / "model_index.json").is_file():
        raise FileNotFoundError(
            f"{pipeline} is not a pipeline directory (no model_index.json); pass a digits pipeline"
        )
    loaded = DigitsPipeline.from_pretrained(os.fspath(pipeline))
    loaded.set_progress_bar_config(disable=True)
    return loaded


def sample_digits(
    pipeline: DigitsPipeline,
    n_per_class: int,
    *,
    seed: int,
    batch_size: int = 100,
    desc: str = "sampling",
    **schedule: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``n_per_class`` digits of each class 0..9 (sample indices ``0..10·n_per_class − 1``, class-major).

    ``schedule`` holds the sampling keywords of :meth:`DigitsPipeline.__call__` (``num_inference_steps``,
    ``guidance_scale``, ``step_rule``, ``shift``; unset or None = the pipeline's default). A tqdm bar counts the
    images (hidden when stderr is not a terminal).

    Returns:
        ``(images, labels)``: uint8 ``(N, 8, 8, 1)`` pixels 0..255 and int64 ``(N,)`` labels, N = 10·n_per_class.

    Raises:
        ValueError: if ``n_per_class`` < 1.
    """
    if n_per_class < 1:
        raise ValueError(f"n_per_class must be >= 1, got {n_per_class}")
    labels = np.repeat(np.arange(_NUM_CLASSES, dtype=np.int64), n_per_class)
    prompts = [DIGIT_PROMPTS[label] for label in labels]
    chunks = []
    with tqdm(total=len(prompts), desc=desc, unit="img", disable=None, leave=False) as bar:
        for start in range(0, len(prompts), batch_size):
            stop = min(start + batch_size, len(prompts))
            chunks.append(
                pipeline(
                    prompts[start:stop],
                    seed=seed,
                    sample_indices=list(range(start, stop)),
                    batch_size=batch_size,
                    **schedule,
                ).images
            )
            bar.update(stop - start)
    return np.concatenate(chunks), labels


def evaluate_pipeline(
    pipeline_dir: str | os.PathLike | DigitsPipeline,
    *,
    name: str,
    num_steps: int | None = None,
    guidance_scale: float | None = None,
    step_rule: str | None = None,
    shift: float | None = None,
    n_per_class: int = 50,
    seed: int = 0,
    out_dir: str | os.PathLike | None = None,
    model: str | None = None,
    sampler: str | None = None,
    meta: dict | None = None,
    cache_dir: str | os.PathLike | None = None,
    batch_size: int = 100,
) -> dict:
    """Sample a pipeline ``n_per_class`` times per digit and score the images against real held-out digits.

    Args:
        pipeline_dir: a digits pipeline directory (teacher or exported student) or a loaded ``DigitsPipeline``.
        name: row name; the grid is ``<out_dir>/<name>.png``.
        num_steps, guidance_scale, step_rule, shift: the sampling settings; None = the pipeline's scheduler-config
            defaults (a student's exported schedule; 28 Euler steps for a teacher; guidance 1).
        n_per_class: images per digit (N = 10·n_per_class in all).
        seed: noise seed of the samples.
        out_dir: where to save the grid (None: no grid).
        model: ``"teacher"`` / ``"student"``; default ``"student"`` when the scheduler config carries an exported
            schedule, else ``"teacher"``.
        sampler: default the step rule used (``"euler"`` = the ODE, ``"dmd2"`` = the student's re-noising rule).
        meta: extra fields for the result, applied last (e.g. the distilled CFG scale of a student).
        cache_dir: digits-classifier cache directory (default :func:`miles.eval.digits.classifier.default_cache_dir`).
        batch_size: images per pipeline call.

    Returns:
        :func:`miles.eval.digits.metrics.evaluate_images`'s dict (``name``, ``seed``, ``n_samples``, ``accuracy``,
        ``fd``, ``precision``, ``recall``, ``spread_ratio``, ...) plus ``model``, ``sampler``, ``steps``,
        ``guidance_scale``, ``step_rule``, ``shift``, ``sigmas``, ``pipeline``, ``sample_seconds`` and ``grid`` (the
        PNG path, or None).

    Raises:
        FileNotFoundError: when ``pipeline_dir`` is not a pipeline directory.
        ValueError: on a bad schedule or ``n_per_class`` < 1.
    """
    pipeline = load_pipeline(pipeline_dir)
    schedule = pipeline.resolve_schedule(num_inference_steps=num_steps, step_rule=step_rule, shift=shift)
    scale = schedule["guidance_scale"] if guidance_scale is None else float(guidance_scale)
    start = time.perf_counter()
    images, labels = sample_digits(
        pipeline,
        n_per_class,
        seed=seed,
        batch_size=batch_size,
        desc=name,
        num_inference_steps=schedule["num_inference_steps"],
        guidance_scale=scale,
        step_rule=schedule["step_rule"],
        shift=shift,
    )
    seconds = time.perf_counter() - start
    row_meta = {
        "model": model or ("student" if schedule["is_student"] else "teacher"),
        "sampler": sampler or schedule["step_rule"],
        "steps": schedule["num_inference_steps"],
        "guidance_scale": scale,
        "step_rule": schedule["step_rule"],
        "shift": None if schedule["timesteps"] is not None else schedule["shift"],
        "sigmas": schedule["sigmas"],
        "pipeline": os.fspath(pipeline.name_or_path or pipeline_dir),
        "sample_seconds": round(seconds, 3),
        **(meta or {}),
    }
    result = evaluate_images(images, labels, seed=seed, name=name, cache_dir=cache_dir, meta=row_meta)
    result["grid"] = None
    if out_dir is not None:
        title = f"{name}: {result['steps']} steps, CFG {float(result['guidance_scale']):g}"
        result["grid"] = save_digit_grid(
            images, labels, Path(out_dir) / f"{name}.png", per_row=min(n_per_class, _GRID_PER_ROW), title=title
        )
    return result


def evaluate_suite(
    teacher_dir: str | os.PathLike | None,
    students: dict[str, str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    guidance_scale: float,
    n_per_class: int = 50,
    seed: int = 0,
    teacher_steps: Sequence[int] = TEACHER_STEPS,
    student_steps: Sequence[int | None] = (None,),
    cache_dir: str | os.PathLike | None = None,
    title: str | None = None,
    seeds: Sequence[int] | None = None,
) -> list[dict]:
    """The teacher-vs-students comparison at one CFG scale, with the real-digits floor; writes ``summary.md`` / ``summary.json``.

    Rows, all with the same ``n_per_class`` and seeds (``seeds``, default ``[seed]``); with several seeds each row
    is :func:`miles.eval.report.aggregate_seeds` of its per-seed rows (figures are means, ``<figure>_std`` their
    sample standard deviations; one seed's FD at n = 500 moves by about ±0.05, so a single seed cannot rank two
    close rows), and only the first seed draws a grid:

    * ``teacher-<S>step-cfg<w>`` for S in ``teacher_steps``: the teacher's Euler sampler at CFG ``guidance_scale``.
    * ``<name>`` for each student at its exported schedule and sampling guidance (1 for DMD2), reported at the
      CFG it was distilled with (``_miles_distilled_guidance_scale``; ``guidance_scale`` when not recorded, with a
      warning when the two differ); ``<name>-<S>step`` for each integer S in ``student_steps``.
    * ``real-train``: :func:`miles.eval.digits.metrics.evaluate_real_baseline` on ``10·n_per_class`` real train digits.

    Grids go to ``<out_dir>/<row name>.png``; figures and grids are logged to wandb when a run is active.

    Args:
        teacher_dir: the teacher pipeline directory (None: no teacher rows).
        students: ``{row name: exported student directory}``.
        out_dir: output directory (created).
        guidance_scale: the teacher's CFG scale.
        student_steps: per student, None = its exported schedule, an integer = that many steps of its rule.
        seeds: the sample seeds of every row (default ``[seed]``).

    Returns:
        the result dicts in table order (teacher rows, student rows, real row).

    Raises:
        ValueError: for an empty or repeating ``seeds``.
    """
    out_dir = Path(out_dir)
    seeds = [seed] if seeds is None else [int(value) for value in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"evaluate_suite needs distinct sample seeds, got {seeds}")

    def over_seeds(evaluate) -> dict:
        rows = [evaluate(value, out_dir if position == 0 else None) for position, value in enumerate(seeds)]
        return rows[0] if len(rows) == 1 else aggregate_seeds(rows)

    results = []
    if teacher_dir is not None:
        teacher = load_pipeline(teacher_dir)
        for steps in teacher_steps:
            results.append(
                over_seeds(
                    partial(
                        _seeded_row,
                        teacher,
                        name=f"teacher-{steps}step-cfg{guidance_scale:g}",
                        num_steps=steps,
                        guidance_scale=guidance_scale,
                        step_rule="euler",
                        n_per_class=n_per_class,
                        model="teacher",
                        sampler="euler",
                        cache_dir=cache_dir,
                    )
                )
            )
    for student_name, student_dir in students.items():
        student = load_pipeline(student_dir)
        defaults = student.sampling_defaults
        distilled = defaults["distilled_guidance_scale"]
        if distilled is not None and distilled != guidance_scale:
            logger.warning(
                "student %s was distilled at CFG %g but the suite compares at CFG %g; its row reports %g",
                student_name,
                distilled,
                guidance_scale,
                distilled,
            )
        reported = guidance_scale if distilled is None else distilled
        for steps in student_steps:
            row_name = student_name if steps is None else f"{student_name}-{steps}step"
            results.append(
                over_seeds(
                    partial(
                        _seeded_row,
                        student,
                        name=row_name,
                        num_steps=steps,
                        n_per_class=n_per_class,
                        model="student",
                        cache_dir=cache_dir,
                        meta={"guidance_scale": reported, "sampling_guidance_scale": defaults["guidance_scale"]},
                    )
                )
            )
    results.append(
        over_seeds(
            lambda value, _: evaluate_real_baseline(_NUM_CLASSES * n_per_class, seed=value, cache_dir=cache_dir)
        )
    )
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}: means ± std"
    title = title or f"Digits evaluation (CFG {guidance_scale:g}, {n_per_class} samples per digit, {seed_text})"
    write_summary(results, out_dir, title=title, notes=summary_notes(results))
    log_to_wandb(results, images={r["name"]: r["grid"] for r in results if r.get("grid")})
    return results


def _seeded_row(pipeline: DigitsPipeline, seed: int, out_dir: Path | None, **kwargs) -> dict:
    return evaluate_pipeline(pipeline, seed=seed, out_dir=out_dir, **kwargs)


def _record_label(record: dict, position: int) -> int:
    label = record.get("label", (record.get("metadata") or {}).get("label"))
    if label is None:
        raise ValueError(
            f"eval prompt record {position} has no 'label' (keys {sorted(record)}); the digits eval hook needs the "
            "digit of each prompt: write the eval prompts with miles.eval.digits.data"
        )
    return int(label)


def digits_eval_hook(args: Any, images: Any, records: list[dict], rollout_id: int) -> dict[str, float]:
    """``--eval-function-path miles.eval.digits.digits_eval_hook``: score the student's eval images of a rollout.

    Args:
        args: run args; reads ``output_dir``, ``rollout_seed`` (the engine's noise seed, reported as the seed),
            ``diffusion_num_steps``, ``diffusion_step_rule`` and ``diffusion_guidance_scale``.
        images: uint8 ``[N, H, W, C]`` (or ``[N, H, W]``) images the engine drew for the eval prompts.
        records: the eval prompt records, each with a ``"label"`` (or ``metadata["label"]``). Either one record per
            image, or one per prompt with the images prompt-major (``N = len(records) · n``, image
            ``p·n + j`` is record p's j-th sample, the ``Sample.index`` order).
        rollout_id: the rollout after which the images were drawn; names the grid
            (:func:`eval_grid_path`).

    Returns:
        ``{"accuracy", "fd", "precision", "recall", "spread_ratio"}`` as floats (NaN when not computable), and the
        collapse alarms' ``"diversity_ratio"`` (the per-class pixel spread across samples over the held-out real
        digits') and ``"saturated_excess"`` (the share of pixels at 0 or 255 minus the real digits')
        (:func:`miles.utils.health.reference_figures`; the ratio needs two images of a class).

    Raises:
        ValueError: when a record has no label or N is not a multiple of the record count.
    """
    images = np.asarray(images)
    if not records or len(images) % len(records):
        raise ValueError(
            f"digits eval hook got {len(images)} images for {len(records)} eval records; expected a whole number of "
            "images per record (--eval-n-samples-per-prompt)"
        )
    labels = np.repeat([_record_label(record, i) for i, record in enumerate(records)], len(images) // len(records))
    meta = {
        "model": "student",
        "sampler": args.diffusion_step_rule,
        "steps": args.diffusion_num_steps,
        "guidance_scale": args.diffusion_guidance_scale,
        "rollout_id": int(rollout_id),
    }
    name = f"rollout_{rollout_id}"
    result = evaluate_images(images, labels, seed=args.rollout_seed, name=name, meta=meta)
    title = f"{name}: {meta['steps']} steps"
    save_digit_grid(
        images, labels, eval_grid_path(args, rollout_id), per_row=int(min(np.bincount(labels).max(), 10)), title=title
    )
    figures = {key: float("nan") if result.get(key) is None else float(result[key]) for key in _HOOK_FIGURES}
    # The collapse alarms' figures against the held-out real digits of each prompt's class (miles.utils.health).
    real_images, real_labels = load_split("heldout")
    figures.update(reference_figures(images, [str(label) for label in labels], real_images,
                                     [str(label) for label in real_labels]))  # fmt: skip
    return figures
