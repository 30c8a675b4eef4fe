"""Train-time evaluation, run by the driver every ``--eval-interval`` rollouts.

The student samples the eval prompts (``--eval-prompt-data``, default ``--prompt-data``; at most
``--eval-max-prompts`` of them, evenly spaced through the file; each ``--eval-n-samples-per-prompt`` times) from
fixed noise, so every evaluation of a run is comparable; the samples are split over the actor ranks (or the engine
replicas). ``--eval-function-path`` scores them; the figures are logged as ``eval/<name>`` and the PNG grid
``<output-dir>/eval/rollout_<id>.png`` (at most :data:`GRID_MAX_IMAGES` images, each at most
:data:`GRID_MAX_SIDE` pixels a side; a video family's as frame strips, plus the animation ``rollout_<id>.gif``) as
wandb media. Every evaluation also logs the collapse alarms' figures of the
decoded samples, ``health/eval_diversity`` (the spread across the seeds of each prompt) and
``health/eval_saturated_frac`` (:func:`miles.utils.health.eval_health_figures`).
"""

import logging
import os
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from miles.config import hook_name
from miles.rollout.data_source import make_prompt_shard, read_jsonl_records
from miles.rollout.engine import data_base_dir
from miles.utils.health import eval_health_figures
from miles.utils.types import PromptShard

__all__ = [
    "EVAL_ROLLOUT_ID",
    "EvalHookError",
    "eval_prompt_indices",
    "eval_shard",
    "load_eval_records",
    "maybe_evaluate",
    "move_aside_earlier_eval",
    "should_evaluate",
]

logger = logging.getLogger(__name__)

# The noise-seed key of every evaluation draw (the exported pipelines sample with it too).
EVAL_ROLLOUT_ID = "eval"
# The driver's own tiled grid (when the hook draws none): the first images, thumbnailed, so that an SD3.5 eval of
# 1024 px images stays a PNG of a few MB.
GRID_MAX_IMAGES = 100
GRID_MAX_SIDE = 256


class EvalHookError(RuntimeError):
    """``--eval-function-path`` raised or returned something other than a dict of figures. ``summary`` is the
    driver's one line; ``details`` the hook's traceback (empty for a wrong return value)."""

    def __init__(self, summary: str, details: str = "") -> None:
        super().__init__(summary)
        self.summary = summary
        self.details = details


def should_evaluate(args, rollout_id: int) -> bool:
    """Evaluate at every ``--eval-interval`` rollouts and after the last one (with ``--eval-interval``)."""
    if not args.eval_interval:
        return False
    return rollout_id == args.num_rollout - 1 or (rollout_id + 1) % args.eval_interval == 0


def eval_prompt_indices(count: int, cap: int | None) -> list[int]:
    """The positions of the eval prompts among ``count`` records: all of them, or ``cap`` evenly spaced ones
    (``floor(i · count / cap)``), so that a file sorted by class or topic keeps every part."""
    if not cap or count <= cap:
        return list(range(count))
    return [i * count // cap for i in range(cap)]


def load_eval_records(args) -> list[dict]:
    """The eval prompts: the records of ``--eval-prompt-data`` (default ``--prompt-data``), at most
    ``--eval-max-prompts`` of them (:func:`eval_prompt_indices`), each repeated ``--eval-n-samples-per-prompt``
    times, in file order."""
    path = args.eval_prompt_data or args.prompt_data
    flag = "--eval-prompt-data" if args.eval_prompt_data else "--prompt-data"
    records = read_jsonl_records(path, args.input_key, flag)
    records = [records[i] for i in eval_prompt_indices(len(records), args.eval_max_prompts)]
    return [record for record in records for _ in range(args.eval_n_samples_per_prompt)]


def move_aside_earlier_eval(output_dir: str | os.PathLike) -> Path | None:
    """A run that does not resume starts its own ``<output-dir>/eval``: an earlier run's folder is renamed to
    ``eval.earlier`` (or ``eval.earlier.<n>``), never overwritten. Returns the new name, or None when there was
    none."""
    folder = Path(output_dir) / "eval"
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    aside, n = folder.with_name("eval.earlier"), 1
    while aside.exists():
        aside, n = folder.with_name(f"eval.earlier.{n}"), n + 1
    os.rename(folder, aside)
    return aside


def _grid_images(images) -> np.ndarray:
    """The first :data:`GRID_MAX_IMAGES` images, each shrunk (Lanczos) to at most :data:`GRID_MAX_SIDE` pixels a
    side; uint8 ``(N, H, W, C)``, or a video family's ``(N, F, H, W, C)`` with every frame shrunk alike."""
    pixels = np.asarray(images.numpy() if hasattr(images, "numpy") else images)[:GRID_MAX_IMAGES]
    if pixels.ndim == 5:
        # Frames as images of their own, put back as videos (save_image_grid draws each as a strip).
        n, frames = pixels.shape[:2]
        shrunk = _grid_images_of(pixels.reshape(n * frames, *pixels.shape[2:]))
        return shrunk.reshape(n, frames, *shrunk.shape[1:])
    return _grid_images_of(pixels)


def _grid_images_of(pixels: np.ndarray) -> np.ndarray:
    height, width = pixels.shape[1:3]
    if max(height, width) <= GRID_MAX_SIDE:
        return pixels
    from PIL import Image

    factor = GRID_MAX_SIDE / max(height, width)
    size = (max(1, round(width * factor)), max(1, round(height * factor)))
    shrunk = [np.asarray(Image.fromarray(p.squeeze(-1) if p.shape[-1] == 1 else p).resize(size, Image.LANCZOS))
              for p in pixels]  # fmt: skip
    return np.stack(shrunk).reshape(len(pixels), size[1], size[0], -1)


def _run_hook(hook: Callable, args, images, records: list[dict], rollout_id: int) -> dict[str, Any]:
    """Call the eval hook (``--eval-function-path``, imported once by the driver) and check that it returned
    ``{name: number}``.

    Raises:
        EvalHookError: naming the hook and the rollout, for an exception (its traceback in ``details``) or a
            result that is not a dict of numbers.
    """
    path = hook_name(hook)
    try:
        result = hook(args, images, records, rollout_id)
    except Exception as exc:  # noqa: BLE001 - the user's hook: report it on one line, its traceback below
        raise EvalHookError(
            f"eval hook {path} failed after rollout {rollout_id}: {type(exc).__name__}: {exc}", traceback.format_exc()
        ) from exc
    if not isinstance(result, Mapping):
        raise EvalHookError(
            f"eval hook {path} returned {type(result).__name__} after rollout {rollout_id}; expected a dict of "
            "metric name -> number"
        )
    for key, value in result.items():
        if not isinstance(key, str) or not (isinstance(value, (int, float)) or getattr(value, "ndim", None) == 0):
            raise EvalHookError(
                f"eval hook {path} returned {{{key!r}: {type(value).__name__}}} after rollout {rollout_id}; expected "
                "a dict of metric name -> number"
            )
    return dict(result)


def eval_shard(args, records: list[dict]) -> PromptShard:
    """The eval samples as one shard: sample b is position b (fixed indices, so fixed noise)."""
    return make_prompt_shard(
        EVAL_ROLLOUT_ID,
        records,
        input_key=args.input_key,
        base_dir=data_base_dir(args.eval_prompt_data or args.prompt_data),
    )


def maybe_evaluate(
    args, rollout_id: int, sampler: Any, tracker, groups: dict | None = None, eval_hook: Callable | None = None
) -> dict[str, Any]:
    """Every ``--eval-interval`` rollouts: sample the eval prompts with the current student, score them with
    ``--eval-function-path`` and log the figures as ``eval/<name>``.

    The grid ``<output-dir>/eval/rollout_<id>.png`` is the hook's own if it writes one there, else the images tiled
    in order (a video family's as frame strips); it is logged as wandb media with ``--use-wandb``. A video family's
    samples are also written as the animation ``rollout_<id>.gif`` (:func:`miles.eval.video.save_video_grid`), logged
    as ``eval/samples_video`` (``wandb.Video``).

    With ``groups`` (the trainer groups), the method's own eval images are drawn too (``Method.eval_media``: DMD2's
    debug grid) and logged as media beside the samples, and its own figures (``Method.eval_metrics``: DMD2's
    discriminator quality) beside the hook's.

    Args:
        sampler: the actor group or the engine group (anything with ``evaluate(shard) -> uint8 (B, H, W, C)``).
        groups: ``{role: RayTrainGroup}``, or None for no method media.
        eval_hook: ``--eval-function-path``'s ``fn(args, images, records, rollout_id)`` (``RunSpec.eval_hook``), or
            None for none.

    Returns:
        The logged metrics (``{}`` when this rollout does not evaluate): the hook's and the method's ``eval/*``
        figures and ``health/eval_*``.

    Raises:
        EvalHookError: when ``--eval-function-path`` raises or returns something other than a dict of numbers (the
            rollout's checkpoint is saved before this runs).
    """
    if not should_evaluate(args, rollout_id):
        return {}
    from miles.eval.grids import eval_grid_path, save_image_grid

    records = load_eval_records(args)
    images = sampler.evaluate(eval_shard(args, records))
    grid = eval_grid_path(args, rollout_id)
    grid.unlink(missing_ok=True)  # a resumed run's earlier grid must not stand in for this one
    metrics = {}
    if eval_hook is not None:
        metrics = {
            f"eval/{key}": value for key, value in _run_hook(eval_hook, args, images, records, rollout_id).items()
        }
    # The decoded samples' own collapse figures, whatever the hook measures (one prompt's images are its seeds).
    metrics.update(eval_health_figures(images, [str(record[args.input_key]) for record in records]))
    if not grid.exists():
        # The hook may draw its own grid there (the digits hook labels one row per digit); else tile the images.
        save_image_grid(_grid_images(images), grid, per_row=10)
    media = {"eval/samples": grid}
    if getattr(images, "ndim", 0) == 5:
        # A video family: the PNG is the frame strip; the same samples play as an animation beside it.
        from miles.eval.video import save_video_grid

        media["eval/samples_video"] = save_video_grid(_grid_images(images), grid.with_suffix(".gif"), per_row=10)
    if groups is not None:
        from miles.methods import get_method

        method = get_method(args)
        media.update(method.eval_media(args, groups, records, rollout_id))
        metrics.update({f"eval/{key}": value for key, value in method.eval_metrics(args, groups, rollout_id).items()})
    tracker.log(metrics, rollout_id, images=media)
    return metrics
