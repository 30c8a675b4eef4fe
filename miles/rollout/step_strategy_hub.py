"""Step strategies: at which step each sample of a rollout stops.

A strategy is any callable ``fn(args, rollout_id, sample_indices, num_steps) -> list[int | None]`` (one entry per
sample: the step i in ``[0, num_steps)`` to stop at, or None for the full trajectory). The rollout engine
(:class:`miles.rollout.engine.RolloutEngine`) loads it from ``--diffusion-step-strategy-path`` (``--loss-type
dmd2`` defaults to ``stop_at_random_step``); without a path it runs full trajectories.
"""

from typing import Any

import torch

from miles.utils.misc import make_generator

__all__ = ["stop_at_random_step", "full_trajectory"]


def stop_at_random_step(args: Any, rollout_id: int, sample_indices: list[int], num_steps: int) -> list[int]:
    """DMD2 backward simulation: each sample stops at a step i drawn uniformly from ``[0, num_steps)``.

    Sample ``index`` draws from a generator seeded by ``stable_hash("stop_step", args.rollout_seed, rollout_id,
    index)``, so the draw does not depend on which other samples share the batch.

    Raises:
        ValueError: if ``num_steps < 1``.
    """
    if num_steps < 1:
        raise ValueError(f"stop_at_random_step needs --diffusion-num-steps >= 1, got {num_steps}")
    return [
        int(
            torch.randint(num_steps, (1,), generator=make_generator("stop_step", args.rollout_seed, rollout_id, index))
        )
        for index in sample_indices
    ]


def full_trajectory(args: Any, rollout_id: int, sample_indices: list[int], num_steps: int) -> list[None]:
    """Every sample runs all steps and returns its whole trajectory and final sample."""
    return [None] * len(sample_indices)
