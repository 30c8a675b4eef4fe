"""Train-time evaluation, run by the driver every ``--eval-interval`` rollouts.

The student samples the eval prompts (``--eval-prompt-data``, default ``--prompt-data``, each record
``--eval-n-samples-per-prompt`` times) from fixed noise, so every evaluation of a run is comparable; the samples are
split over the actor ranks (or the engine replicas). ``--eval-function-path`` scores them; the figures are logged as
``eval/<name>`` and the PNG grid ``<output-dir>/eval/rollout_<id>.png`` as wandb media.
"""

import json
import logging
from typing import Any

from miles.rollout.data_source import make_prompt_shard
from miles.rollout.engine import data_base_dir
from miles.utils.misc import load_function
from miles.utils.types import PromptShard

__all__ = ["EVAL_ROLLOUT_ID", "eval_shard", "load_eval_records", "maybe_evaluate", "should_evaluate"]

logger = logging.getLogger(__name__)

# The noise-seed key of every evaluation draw (the exported pipelines sample with it too).
EVAL_ROLLOUT_ID = "eval"


def should_evaluate(args, rollout_id: int) -> bool:
    """Evaluate at every ``--eval-interval`` rollouts and after the last one (with ``--eval-interval``)."""
    if not args.eval_interval:
        return False
    return rollout_id == args.num_rollout - 1 or (rollout_id + 1) % args.eval_interval == 0


def load_eval_records(args) -> list[dict]:
    """The eval prompts: every record of ``--eval-prompt-data`` (default ``--prompt-data``), each repeated
    ``--eval-n-samples-per-prompt`` times, in file order."""
    path = args.eval_prompt_data or args.prompt_data
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [record for record in records for _ in range(args.eval_n_samples_per_prompt)]


def eval_shard(args, records: list[dict]) -> PromptShard:
    """The eval samples as one shard: sample b is position b (fixed indices, so fixed noise)."""
    return make_prompt_shard(
        EVAL_ROLLOUT_ID,
        records,
        input_key=args.input_key,
        base_dir=data_base_dir(args.eval_prompt_data or args.prompt_data),
    )


def maybe_evaluate(args, rollout_id: int, sampler: Any, tracker, groups: dict | None = None) -> dict[str, Any]:
    """Every ``--eval-interval`` rollouts: sample the eval prompts with the current student, score them with
    ``--eval-function-path`` and log the figures as ``eval/<name>``.

    The grid ``<output-dir>/eval/rollout_<id>.png`` is the hook's own if it writes one there, else the images tiled
    in order; it is logged as wandb media with ``--use-wandb``.

    With ``groups`` (the trainer groups), the method's own eval images are drawn too (``Method.eval_media``: DMD2's
    debug grid) and logged as media beside the samples, and its own figures (``Method.eval_metrics``: DMD2's
    discriminator quality) beside the hook's.

    Args:
        sampler: the actor group or the engine group (anything with ``evaluate(shard) -> uint8 (B, H, W, C)``).
        groups: ``{role: RayTrainGroup}``, or None for no method media.

    Returns:
        The logged metrics (``{}`` when this rollout does not evaluate).
    """
    if not should_evaluate(args, rollout_id):
        return {}
    from miles.eval.grids import eval_grid_path, save_image_grid

    records = load_eval_records(args)
    images = sampler.evaluate(eval_shard(args, records))
    grid = eval_grid_path(args, rollout_id)
    grid.unlink(missing_ok=True)  # a resumed run's earlier grid must not stand in for this one
    metrics = {}
    if args.eval_function_path:
        hook = load_function(args.eval_function_path)
        metrics = {f"eval/{key}": value for key, value in hook(args, images, records, rollout_id).items()}
    if not grid.exists():
        # The hook may draw its own grid there (the digits hook labels one row per digit); else tile the images.
        save_image_grid(images, grid, per_row=10)
    media = {"eval/samples": grid}
    if groups is not None:
        from miles.methods import get_method

        method = get_method(args)
        media.update(method.eval_media(args, groups, records, rollout_id))
        metrics.update({f"eval/{key}": value for key, value in method.eval_metrics(args, groups, rollout_id).items()})
    tracker.log(metrics, rollout_id, images=media)
    return metrics
