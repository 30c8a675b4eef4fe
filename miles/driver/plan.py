"""``--dry-run``: what a command would run, printed without starting Ray.

The placement, the trainer groups as a table with each group's hooks, each DP rank's work per rollout (denoiser
forwards and backwards for the rollout, every group's optimizer steps and its train-output hook, DMD2's scoring, so
a user sees every phase divided by the DP size), the schedule, the evaluation, the time estimate of
:mod:`miles.driver.estimate` and the memory plan of :mod:`miles.driver.memory_plan`. Everything a real run checks
before Ray starts has passed by then (:func:`miles.driver.preflight.validate_inputs`).
"""

import logging

import torch

from miles.config import GroupSpec, RunSpec
from miles.driver.estimate import log_estimate
from miles.driver.memory_plan import log_memory_plan
from miles.driver.validators import group_layout
from miles.driver.work import work_per_rank
from miles.methods import get_method
from miles.utils.profiling import profile_dir
from miles.utils.validation import context_parallel_size, dp_size, rollout_pairs, trainer_ranks

__all__ = ["HOOK_FLAGS", "LARGE_EVAL_IMAGES", "groups_table", "log_eval_plan", "log_plan", "work_per_rank"]

logger = logging.getLogger(__name__)

# Eval images per evaluation above which the dry run warns (they are gathered in the driver and tiled there).
LARGE_EVAL_IMAGES = 256


def log_plan(args, run: RunSpec | None = None) -> str | None:
    """Log the trainer groups, their placement, the work per rank, the schedule and the memory plan, without
    starting Ray. The placement and the sleep rule are the cluster's, with the GPUs the command asks for, also on a
    machine without GPUs (a login node), which the plan then says.

    Args:
        run: the run's specs (the groups with the user's hooks); default: the groups as the flags lay them out.

    Returns:
        None, or the line the dry run fails with when the memory plan does not fit the GPU
        (:func:`miles.driver.memory_plan.log_memory_plan`).
    """
    from miles.driver.run_dir import read_latest
    from miles.driver.schedule import needs_sleep, should_save

    configs = list(run.groups) if run is not None else group_layout(args)
    # The plan is the GPU cluster's: a login node without GPUs plans the bundles and sleeps the cluster will have.
    use_gpu = True
    ranks = dp_size(args)
    logger.info(
        "placement: %d bundles of {GPU: 1, CPU: c} (one per trainer rank: --actor-num-nodes %d x "
        "--actor-num-gpus-per-node %d GPUs; c = --num-cpus-per-rank or a node's CPUs / its ranks); the %d trainer "
        "groups share them, one group at a time",
        trainer_ranks(args),
        args.actor_num_nodes,
        args.actor_num_gpus_per_node,
        len(configs),
    )
    if not torch.cuda.is_available():
        logger.info(
            "placement: planned for GPUs; this machine has none (a run here would take %d bundles of {CPU: c} and no "
            "group would sleep)",
            trainer_ranks(args),
        )
    cp = context_parallel_size(args)
    if cp > 1:
        logger.info(
            "context parallel: %d DP ranks x %d Ulysses ranks; FSDP shards over all %d, each CP group shares one "
            "sample's sequence",
            ranks,
            cp,
            trainer_ranks(args),
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
    for line in groups_table(args, configs):
        logger.info("%s", line)
    for name, source in args.flow_shift_origin.items():
        logger.info("flow shift: %s %s", name, source)
    for line in get_method(args).plan_lines(args):
        logger.info("%s", line)
    logger.info("work per DP rank per rollout (DP size %d, %d pairs per rank):", ranks, rollout_pairs(args) // ranks)
    for who, phase in work_per_rank(args, configs):
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
        _short_list(saves),
        args.save_hf,
    )
    if args.profile_rollouts is not None:
        first, end = args.profile_rollouts[0], min(args.profile_rollouts[1], args.num_rollout)
        logger.info("profile: rollouts %d..%d on every rank, traces in %s", first, end - 1, profile_dir(args))
    log_eval_plan(args)
    log_estimate(args, args.num_rollout - start, configs)
    return log_memory_plan(args, configs)


def _short_list(values: list[int], shown: int = 8) -> str:
    """``[249, 499, ..., 2999]`` for a long list (its first ``shown`` and its last), else the list as it is."""
    if len(values) <= shown + 1:
        return str(values)
    return "[" + ", ".join(map(str, values[:shown])) + f", ... ({len(values)} in all), {values[-1]}]"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


# The flags that name a group's hooks for the actor: how the dry run labels each group's hooks.
HOOK_FLAGS = {
    "prepare": "--custom-prepare-train-batch-path",
    "loss": "--custom-loss-function-path",
    "train_input": "--custom-train-input-function-path",
    "train_output": "--custom-train-output-function-path",
    "build_modules": "--custom-build-modules-path",
    "trainer": "--custom-trainer-path",
}


def _group_settings(group: GroupSpec) -> list[list[str]]:
    """A group's hooks and the settings beside the table's, each ``[flag, value]`` (labelled by the flag that sets
    it for the actor)."""
    rows = [[HOOK_FLAGS[name], value] for name, value in group.hooks.names().items()]
    if group.lora is not None:
        rows += [["--lora-rank", str(group.lora.rank)], ["--lora-alpha", f"{group.lora.alpha:g}"]]
    if group.ema is not None:
        rows.append(["--ema-decay", f"{group.ema.decay:g}"])
    if group.train_output_before_step is not None:
        rows.append(["--train-output-before-step", str(group.train_output_before_step)])
    return rows


def groups_table(args, groups: list[GroupSpec] | None = None) -> list[str]:
    """The trainer groups as a table, in training order: init, teacher, learning rate, optimizer steps per rollout,
    save and load directories; then each group's hooks (by name) and its LoRA, EMA and scoring step, one per line
    (``--flag value``, labelled by the flag that sets it for the actor).

    Args:
        groups: the run's groups; default: as the flags lay them out (the method's hooks, no user hook imported).
    """
    groups = group_layout(args) if groups is None else groups
    rows = [["group", "init", "teacher", "lr", "steps/rollout", "save", "load"]]  # "-": none
    for group in groups:
        rows.append(
            [
                group.role,
                str(group.init or "-"),
                str(group.teacher or "-"),
                f"{group.optimizer.lr:g}" if group.trains else "-",  # a frozen group (the reward's) takes no step
                str(group.steps_per_rollout),
                str(group.checkpoint.save or "-"),
                str(group.checkpoint.load or "-"),
            ]
        )
    lines = [f"trainer groups ({len(groups)}, in training order):", *_table(rows)]
    for group in groups:
        settings = _group_settings(group)
        if not settings:
            lines.append(f"  group {group.role}: no hooks of its own (the user's)")
            continue
        lines.append(f"  group {group.role}:")
        lines += ["  " + line for line in _table(settings)]
    return lines


def log_eval_plan(args) -> None:
    """One line on the evaluation: how many prompts and images, from which file, and where ``--keep-best`` keeps
    the best rollout; a warning when the eval set is the training prompts or large enough that gathering and tiling
    its images in the driver costs memory."""
    from miles.driver.evaluation import eval_prompt_indices, load_eval_records

    if not args.eval_interval:
        logger.info("eval: none (no --eval-interval)")
        return
    path = args.eval_prompt_data or args.prompt_data
    try:
        records = load_eval_records(args)
        from miles.rollout.data_source import read_jsonl_records

        total = len(read_jsonl_records(path, args.input_key, "--eval-prompt-data"))
    except (OSError, ValueError) as exc:
        logger.info("eval: cannot read %s (%s)", path, exc)
        return
    prompts = len(eval_prompt_indices(total, args.eval_max_prompts))
    logger.info(
        "eval: every %d rollouts, %d prompts of %s (%d in the file; --eval-max-prompts %d) x %d samples = %d images",
        args.eval_interval,
        prompts,
        path,
        total,
        args.eval_max_prompts,
        args.eval_n_samples_per_prompt,
        len(records),
    )
    if args.keep_best:
        from miles.driver.keep_best import best_export_dir, parse_keep_best

        metric, mode = parse_keep_best(args.keep_best)
        kept = ([f"its checkpoint spared in {args.save}"] if args.save else []) + (
            [f"its student exported to {best_export_dir(args.save_hf)}"] if args.save_hf else []
        )
        logger.info("keep best: the rollout of the %s %s, %s", "lowest" if mode == "min" else "highest", metric,
                    " and ".join(kept))  # fmt: skip
    if not args.eval_prompt_data:
        logger.warning("eval: no --eval-prompt-data, so the eval prompts are training prompts (--prompt-data)")
    if len(records) > LARGE_EVAL_IMAGES:
        logger.warning(
            "eval: %d images per evaluation all travel to the driver; lower --eval-max-prompts or "
            "--eval-n-samples-per-prompt (more than %d is large)",
            len(records),
            LARGE_EVAL_IMAGES,
        )
