"""Each DP rank's work per rollout: the denoiser forwards and backwards of every phase, the table of ``--dry-run``
(:mod:`miles.driver.plan`) and the count the time estimate prices (:mod:`miles.driver.estimate`)."""

from miles.methods import compute_trainer_configs, get_method
from miles.methods.base import PhaseWork
from miles.utils.trainer_config import compute_trainer_args, trains
from miles.utils.validation import dp_size, rollout_pairs

__all__ = ["work_per_rank"]


def work_per_rank(args) -> list[tuple[str, PhaseWork]]:
    """``(group, PhaseWork)`` of one DP rank per rollout.

    Rollout: the actor ranks (or the engine replicas) sample their shard in micro-batches; each micro-batch runs up
    to every step of the schedule (the largest stop step), with a doubled batch under student CFG. Train: each group
    runs ``num_steps_per_rollout`` windows of micro-batches, one forward and backward each, then its train-output
    hook's forwards (the method's).
    """
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
    for config in compute_trainer_configs(args):
        group_args = compute_trainer_args(args, config)
        if trains(group_args):  # a frozen group (the DMD2 reward group) only runs its train-output hook
            per_window = -(-pairs // group_args.num_steps_per_rollout // micro) if pairs else 0
            count = group_args.num_steps_per_rollout * per_window
            work.append(
                (config.role, PhaseWork(f"{group_args.num_steps_per_rollout} optimizer steps", count, count, micro))
            )
        work += [(config.role, phase) for phase in method.train_output_work(group_args, pairs)]
    return work
