"""Shared pieces of the rollout tests: a ``RolloutEngine`` on a pipeline directory, prompt shards, and hooks.

The hooks below are loaded by dotted path (``tests.support.rollout.stop_steps_from_args``), in this process or in
Ray workers (which find this module through the ``PYTHONPATH`` that :mod:`tests.support.ray` exports).
"""

from pathlib import Path

from miles.utils.types import PromptShard

STOP_STEPS_HOOK = "tests.support.rollout.stop_steps_from_args"


def engine_spec(args):
    """The engine spec of parsed ``args``, as the driver builds it (the step strategy and converter imported)."""
    from miles.driver.specs import build_run_spec

    return build_run_spec(args).engine


def make_engine(args, pipeline: Path, *, family=None, conditioner=None):
    """A ``RolloutEngine`` on ``pipeline``'s own denoiser (float32, CPU), as an engine replica builds it; the step
    strategy gets ``args`` (tests set ``args.test_stop_steps`` on them)."""
    from miles.models import get_model_family
    from miles.models.base import read_scheduler_config
    from miles.rollout.conditioning import PromptConditioner
    from miles.rollout.engine import RolloutEngine

    spec = engine_spec(args)
    family = family or get_model_family(pipeline)
    conditioner = conditioner or PromptConditioner(spec, family, pipeline)
    return RolloutEngine(
        spec,
        family,
        family.load_denoiser(pipeline),
        conditioner,
        family.latent_shape(pipeline),
        read_scheduler_config(pipeline)["num_train_timesteps"],
        args=args,
    )


def prompt_shard(rollout_id, prompts: list[str], indices: list[int] | None = None, records=None) -> PromptShard:
    """A shard of ``prompts`` with sample indices ``indices`` (default ``0..B−1``) and ``{"prompt": p}`` records."""
    return PromptShard(
        rollout_id=rollout_id,
        sample_indices=list(range(len(prompts))) if indices is None else list(indices),
        prompts=list(prompts),
        records=[{"prompt": prompt} for prompt in prompts] if records is None else list(records),
    )


# -- hooks loaded by path --------------------------------------------------------------------------------------------
def stop_steps_from_args(args, rollout_id, sample_indices, num_steps):
    """Step strategy whose stop steps the test sets on the args: ``args.test_stop_steps`` maps a sample index to its
    stop step (missing: the full trajectory), or is a list returned as it is (to test the engine's checks)."""
    stops = vars(args).get("test_stop_steps", {})
    if isinstance(stops, list):
        return stops
    return [stops.get(index) for index in sample_indices]
