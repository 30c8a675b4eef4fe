"""Each DP rank's work per rollout, phase by phase: what the dry run prints and the time estimate counts.

Both :mod:`miles.driver.plan` (``--dry-run``) and :mod:`miles.driver.estimate` read it, so it lives below them.
"""

import argparse

from miles.config import GroupSpec
from miles.methods import get_method
from miles.methods.base import PhaseWork
from miles.utils.validation import dp_size, rollout_pairs

__all__ = ["work_per_rank"]


def work_per_rank(args: argparse.Namespace, groups: list[GroupSpec] | None = None) -> list[tuple[str, PhaseWork]]:
    """``(group, PhaseWork)`` of one DP rank per rollout.

    Rollout: the actor ranks (or the engine replicas) sample their shard in micro-batches; each micro-batch runs up
    to every step of the schedule (the largest stop step), with a doubled batch under student CFG. Train: each group
    runs its steps per rollout in windows of micro-batches, one forward and backward each, then its train-output
    hook's forwards (the method's).

    Args:
        groups: the run's groups (``RunSpec.groups``); default: as the flags lay them out
            (:func:`miles.driver.validators.group_layout`).
    """
    from miles.driver.validators import group_layout

    groups = group_layout(args) if groups is None else groups
    dp = dp_size(args)
    pairs = rollout_pairs(args) // dp
    micro = args.micro_batch_size
    work = []
    if not args.train_only:
        steps = len(args.diffusion_timesteps) if args.diffusion_timesteps else args.diffusion_num_steps
        cfg = 2 if args.diffusion_guidance_scale != 1 else 1
        chunks = -(-pairs // micro)
        if args.rollout_num_gpus:
            chunks *= dp // args.rollout_num_gpus
        where = "engine replica" if args.rollout_num_gpus else "actor"
        work.append((where, PhaseWork("rollout (at most)", chunks * steps, 0, cfg * micro)))
    method = get_method(args)
    for group in groups:
        if group.trains:  # a frozen group (the DMD2 reward group) only runs its train-output hook
            steps = group.steps_per_rollout
            per_window = -(-pairs // steps // micro) if pairs else 0
            count = steps * per_window
            work.append((group.role, PhaseWork(f"{steps} optimizer steps", count, count, micro)))
        work += [(group.role, phase) for phase in method.train_output_work(args, group, pairs)]
    return work
