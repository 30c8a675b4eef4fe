"""``--dry-run``: what a command would run, printed without starting Ray.

The trainer groups with their overrides and hooks, the placement, the schedule, and each DP rank's work per rollout:
denoiser forwards and backwards for the rollout, every group's optimizer steps and its train-output hook (DMD2's
scoring), so a user sees every phase divided by the DP size.
"""

import logging

import torch

from miles.driver.memory_plan import log_memory_plan
from miles.methods import compute_trainer_configs, get_method
from miles.methods.base import PhaseWork
from miles.utils.trainer_config import compute_trainer_args
from miles.utils.validation import dp_size, rollout_pairs

__all__ = ["log_plan", "work_per_rank"]

logger = logging.getLogger(__name__)


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
        per_window = -(-pairs // group_args.num_steps_per_rollout // micro) if pairs else 0
        count = group_args.num_steps_per_rollout * per_window
        work.append(
            (config.role, PhaseWork(f"{group_args.num_steps_per_rollout} optimizer steps", count, count, micro))
        )
        work += [(config.role, phase) for phase in method.train_output_work(group_args, pairs)]
    return work


def log_plan(args) -> None:
    """Log the trainer groups, their placement, the work per rank, the schedule and the memory plan, without
    starting Ray."""
    from miles.driver.run_dir import read_latest
    from miles.driver.schedule import needs_sleep, should_save

    configs = compute_trainer_configs(args)
    use_gpu = torch.cuda.is_available()
    ranks = dp_size(args)
    bundle = "{GPU: 1, CPU: c}" if use_gpu else "{CPU: c}"
    logger.info(
        "placement: %d bundles of %s (one per DP rank; c = --num-cpus-per-rank or a node's CPUs / its ranks); the "
        "%d trainer groups share them, one group at a time",
        ranks,
        bundle,
        len(configs),
    )
    if args.train_only:
        readers = (
            f"each of the {args.rollout_num_gpus} engine replicas" if args.rollout_num_gpus else "each actor rank"
        )
        logger.info("rollout: none (--train-only): %s reads its share of the data", readers)
    elif args.rollout_num_gpus:
        logger.info(
            "rollout: %d dedicated engine replicas, each generating %d DP shards",
            args.rollout_num_gpus,
            ranks // args.rollout_num_gpus,
        )
    else:
        logger.info("rollout: each of the %d actor ranks generates its own shard on its student", ranks)
    for config in configs:
        group_args = compute_trainer_args(args, config)
        hooks = {
            name: getattr(group_args, f"custom_{name}_path", None)
            for name in ("train_input_function", "prepare_train_batch", "loss_function", "train_output_function")
        }
        logger.info(
            "group %s: overrides %s; init %s, teacher %s, lr %g, %d optimizer steps per rollout; hooks %s",
            config.role,
            config.overrides,
            group_args.hf_checkpoint,
            group_args.teacher_load,
            group_args.lr,
            group_args.num_steps_per_rollout,
            hooks,
        )
    for flag, source in getattr(args, "flow_shift_origin", {}).items():
        logger.info("flow shift: %s %s", flag, source)
    logger.info("work per DP rank per rollout (DP size %d, %d pairs per rank):", ranks, rollout_pairs(args) // ranks)
    for who, phase in work_per_rank(args):
        logger.info(
            "  %-16s %-24s forwards %5d  backwards %5d  batch %d",
            who,
            phase.phase,
            phase.forwards,
            phase.backwards,
            phase.batch,
        )
    start = read_latest(args.load) + 1 if args.load else 0
    saves = [r for r in range(start, args.num_rollout) if should_save(args, r)]
    logger.info(
        "schedule: rollouts %d..%d, sleep between groups on GPUs: %s, saves after rollouts %s, export %s",
        start,
        args.num_rollout - 1,
        needs_sleep(len(configs), use_gpu),
        saves,
        args.save_hf,
    )
    log_memory_plan(args)
