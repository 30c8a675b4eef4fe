"""The validators of ``train_diffusion.py``'s arguments, and the paths a command names.

``parse_args`` (:mod:`miles.driver.arguments`) runs :func:`validate_args` after filling the defaults. Validators only
reject: each rejection is one line naming the flags and the fix (``ArgumentValidationError``, exit code 2). Each
method checks its own flags in its ``validate``; this module checks the generic ones, and that a method's flags are
set only under its loss type.
"""

import argparse
import os
from typing import Any

from miles.config import GroupSpec, UserHooks
from miles.driver.cluster import check_ray_address
from miles.methods import METHODS, get_method
from miles.utils.paths import check_export_target
from miles.utils.validation import (
    check_number,
    context_parallel_size,
    dp_size,
    flag,
    reject,
    rollout_pairs,
    trainer_ranks,
)

__all__ = [
    "NUMBER_RULES",
    "group_layout",
    "group_paths",
    "method_flag_dests",
    "run_paths",
    "unused",
    "validate_args",
    "validate_batch_args",
    "validate_keep_best",
    "validate_lora_args",
    "validate_method_flags",
    "validate_number_args",
]


def _method_flag_defaults() -> dict[str, dict[str, Any]]:
    """``{loss type: {dest: default}}`` of the flags each method adds (its own argument group)."""
    owned = {}
    for name, method in METHODS.items():
        probe = argparse.ArgumentParser(add_help=False)
        method.add_arguments(probe)
        owned[name] = {action.dest: action.default for action in probe._actions}
    return owned


def method_flag_dests() -> dict[str, set[str]]:
    """``{loss type: the dests of the flags its method adds}``."""
    return {name: set(defaults) for name, defaults in _method_flag_defaults().items()}


def validate_context_parallel_args(args: argparse.Namespace) -> None:
    """``--context-parallel-size``: a positive divisor of the trainer ranks, with the actor ranks generating (the
    engine replicas of ``--rollout-num-gpus`` sample whole sequences each). The model's side (a ``_cp_plan``, a token
    and head count it divides) is checked on the pipeline (:func:`miles.driver.preflight.validate_inputs`)."""
    cp = context_parallel_size(args)
    if cp < 1:
        reject(f"--context-parallel-size must be >= 1, got {cp}")
    if cp == 1:
        return
    ranks = trainer_ranks(args)
    if ranks % cp:
        reject(
            f"--context-parallel-size {cp} must divide the trainer ranks (--actor-num-nodes x "
            f"--actor-num-gpus-per-node = {ranks}); DP size = ranks / context-parallel size"
        )
    if args.rollout_num_gpus:
        reject(
            f"--context-parallel-size {cp} needs the actor ranks to generate (--rollout-num-gpus 0): engine replicas "
            "sample without context parallelism"
        )


def validate_batch_args(args: argparse.Namespace) -> None:
    """Reject batch sizes that do not split exactly: nothing is ever dropped silently."""
    for name, value in (
        ("--num-rollout", args.num_rollout),
        ("--rollout-batch-size", args.rollout_batch_size),
    ):
        if value is None:
            reject(f"{name} is required (a positive integer)")
        if value < 1:
            reject(f"{name} must be a positive integer, got {value}")
    for name, value in (
        ("--n-samples-per-prompt", args.n_samples_per_prompt),
        ("--num-steps-per-rollout", args.num_steps_per_rollout),
        ("--micro-batch-size", args.micro_batch_size),
        ("--actor-num-nodes", args.actor_num_nodes),
        ("--actor-num-gpus-per-node", args.actor_num_gpus_per_node),
        ("--diffusion-num-steps", args.diffusion_num_steps),
    ):
        if value < 1:
            reject(f"{name} must be >= 1, got {value}")
    validate_context_parallel_args(args)
    total = rollout_pairs(args)
    if args.global_batch_size is None or args.global_batch_size * args.num_steps_per_rollout != total:
        if total % args.num_steps_per_rollout == 0:
            fix = f"set --global-batch-size to {total // args.num_steps_per_rollout} or change --num-steps-per-rollout"
        else:
            # No whole global batch exists, so suggesting one would be a fractional, unusable value.
            fix = f"pick a --num-steps-per-rollout that divides {total}, or change --rollout-batch-size"
        reject(
            f"--rollout-batch-size x --n-samples-per-prompt ({args.rollout_batch_size} x {args.n_samples_per_prompt}"
            f" = {total}) must equal --global-batch-size x --num-steps-per-rollout ({args.global_batch_size} x "
            f"{args.num_steps_per_rollout}); {fix}"
        )
    if args.rollout_batch_size % dp_size(args):
        reject(
            f"--rollout-batch-size {args.rollout_batch_size} must be a multiple of the DP size {dp_size(args)} "
            "(--actor-num-nodes x --actor-num-gpus-per-node / --context-parallel-size): every rank generates an "
            "equal share of the prompts"
        )
    if args.rollout_num_gpus and dp_size(args) % args.rollout_num_gpus:
        reject(
            f"--rollout-num-gpus {args.rollout_num_gpus} must divide the DP size {dp_size(args)}: each engine "
            "replica generates the shards of a run of DP ranks"
        )
    per_step = dp_size(args) * args.micro_batch_size
    if args.global_batch_size % per_step != 0:
        reject(
            f"--global-batch-size {args.global_batch_size} must be a multiple of DP size x --micro-batch-size "
            f"({dp_size(args)} x {args.micro_batch_size} = {per_step}) so every rank runs the same micro-batches"
        )


def validate_args(args: argparse.Namespace) -> None:
    """Run every validator; raise ``ArgumentValidationError`` at the first rejection."""
    if not args.hf_checkpoint:
        reject("--hf-checkpoint is required (the student pipeline directory)")
    if not args.prompt_data:
        reject("--prompt-data is required (a JSONL file of prompts, with images for --train-only)")
    if args.custom_expand_samples_to_train_pairs_path is None and get_method(args).converter(args) is None:
        reject(f"--loss-type {args.loss_type} needs --custom-expand-samples-to-train-pairs-path (the converter)")
    validate_method_flags(args)
    validate_batch_args(args)
    if not args.distributed_timeout_minutes > 0:
        reject(f"--distributed-timeout-minutes must be > 0, got {args.distributed_timeout_minutes}")
    check_ray_address(args.ray_address, connect=False)
    if args.profile_rollouts is not None and args.profile_rollouts[0] >= args.num_rollout:
        start, end = args.profile_rollouts
        reject(
            f"--profile-rollouts {start}:{end} starts after the run's last rollout (--num-rollout {args.num_rollout})"
        )
    if args.profile_dir is not None and (not args.profile_dir or args.profile_rollouts is None):
        reject("--profile-dir names where --profile-rollouts writes its traces: give both, with a path")
    if args.train_output_before_step is not None and not (
        0 <= args.train_output_before_step < args.num_steps_per_rollout
    ):
        reject(
            f"--train-output-before-step must be in [0, --num-steps-per-rollout {args.num_steps_per_rollout}), "
            f"got {args.train_output_before_step}"
        )
    if args.diffusion_timesteps is not None:
        t = args.diffusion_timesteps
        if not t or any(not 0 < x <= 1000 for x in t) or any(b >= a for a, b in zip(t, t[1:])):
            reject(f"--diffusion-timesteps must be strictly descending values in (0, 1000], got {t}")
    if not 0 <= args.sft_uncond_prob < 1:
        reject(f"--sft-uncond-prob must be in [0, 1), got {args.sft_uncond_prob}")
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        reject("--save-interval needs --save and must be >= 1")
    if args.overwrite_save and not args.save:
        reject("--overwrite-save needs --save (the directory to start afresh in)")
    if args.gpu_memory_gb is not None and not args.dry_run:
        reject("--gpu-memory-gb is read by --dry-run's memory plan only: add --dry-run, or remove it")
    groups = group_layout(args)
    if args.overwrite_save and args.load:
        # Any group's save directory that any group loads from (--save X_critic beside --load X, too).
        loads = {os.path.realpath(group.checkpoint.load): group.role for group in groups if group.checkpoint.load}
        for name, path in group_paths(args, ("save",), groups):
            role = loads.get(os.path.realpath(path))
            if role is not None:
                reject(
                    f"--overwrite-save would remove {name} {path}, the {role} group's checkpoints that --load "
                    f"{args.load} resumes from; drop one of them"
                )
    if args.save_hf:
        # Never in, over or under a directory the run reads or writes; an existing pipeline only when asked.
        check_export_target(args.save_hf, args.hf_checkpoint, args.overwrite_save_hf, run_paths(args, groups))
    validate_keep_best(args)
    validate_number_args(args)
    unused(
        args,
        {"eval_prompt_data": None, "eval_max_prompts": 100, "eval_n_samples_per_prompt": 1},
        args.eval_interval,
        "is read by the evaluations only: set --eval-interval N to evaluate every N rollouts, or remove it",
    )
    validate_lora_args(args)
    get_method(args).validate(args)


def unused(args: argparse.Namespace, defaults: dict[str, Any], enabled: Any, why: str) -> None:
    """The flags of a feature that is off (not ``enabled``) change nothing: one set away from its default
    (``{dest: default}``) is rejected as ``"<flag> <why>"``."""
    if not enabled:
        for dest, default in defaults.items():
            if getattr(args, dest) != default:
                reject(f"{flag(dest)} {why}")


def validate_keep_best(args: argparse.Namespace) -> None:
    """``--keep-best METRIC:min|max`` names a direction, evaluations to pick from and somewhere to keep the rollout;
    its export ``<--save-hf>-best`` follows ``--save-hf``'s rules, except that a resume may replace the best export
    of the same figure it continues from."""
    from miles.driver.keep_best import best_export_dir, parse_keep_best, read_best_export

    if args.keep_best is None:
        return
    metric, mode = parse_keep_best(args.keep_best)
    if not args.eval_interval:
        reject(f"--keep-best {args.keep_best} picks a rollout by its evaluations: set --eval-interval, or remove it")
    if not (args.save or args.save_hf):
        reject(
            f"--keep-best {args.keep_best} keeps the best rollout in --save (its checkpoint) or --save-hf (exported "
            "to <save-hf>-best): set one of them"
        )
    if args.save_hf:
        earlier = read_best_export(args.save_hf) if args.load else None
        resumed = earlier is not None and (earlier.get("metric"), earlier.get("mode")) == (metric, mode)
        best = best_export_dir(args.save_hf)
        paths = [*run_paths(args), ("--save-hf", args.save_hf)]
        check_export_target(
            best, args.hf_checkpoint, args.overwrite_save_hf or resumed, paths, name="--keep-best's export"
        )


def validate_lora_args(args: argparse.Namespace) -> None:
    """The student's ``--lora-*`` flags (:func:`miles.models.lora.check_lora_flags`); a LoRA flag without
    ``--lora-rank`` is rejected, as it would change nothing."""
    from miles.models.lora import LoraFlags, check_lora_flags

    unused(
        args,
        {"lora_alpha": None, "lora_target_modules": None, "lora_dropout": 0.0},
        args.lora_rank,
        "is read with --lora-rank > 0 only (the student trains full weights): add --lora-rank",
    )
    check_lora_flags(
        "--",
        LoraFlags(args.lora_rank, args.lora_alpha, args.lora_target_modules, args.lora_dropout),
        args.hf_checkpoint,
    )
    if args.save_hf_lora and not (args.save_hf and args.lora_rank):
        reject("--save-hf-lora writes the student's adapter beside --save-hf: it needs --save-hf and --lora-rank")
    validate_teacher_lora_args(args)
    if args.lora_rank and args.rollout_num_gpus:
        reject(
            "--lora-rank with --rollout-num-gpus is not supported yet (the engine replicas load full weights): "
            "drop --rollout-num-gpus to generate on the actor ranks"
        )


def validate_teacher_lora_args(args: argparse.Namespace) -> None:
    """``--teacher-lora PATH[:WEIGHT]``: each needs ``--teacher-load`` and an existing path with a finite weight
    (:func:`miles.models.teacher_lora.parse_teacher_lora`), a whole safetensors file (or a ``save_lora_weights``
    folder holding one) of LoRA tensors, so that a dry run refuses what the fuse would; whether the teacher has the
    modules its keys name is found when it is fused. ``--teacher-lora-teacher-only`` needs a LoRA."""
    from miles.driver.preflight_data import safetensors_header
    from miles.models.teacher_lora import LORA_WEIGHTS, parse_teacher_lora

    if args.teacher_lora_teacher_only and not args.teacher_lora:
        reject("--teacher-lora-teacher-only changes where --teacher-lora goes: add --teacher-lora")
    for value in args.teacher_lora or ():
        if not args.teacher_load:
            reject(f"--teacher-lora {value} is fused into the teacher: add --teacher-load")
        try:
            path, _ = parse_teacher_lora(value)
        except ValueError as exc:
            reject(str(exc))
        if not os.path.exists(path):
            reject(f"--teacher-lora {value}: {path} does not exist (a save_lora_weights folder or its .safetensors)")
        file = os.path.join(path, LORA_WEIGHTS) if os.path.isdir(path) else path
        try:
            header = safetensors_header(file)
        except (OSError, ValueError) as exc:
            reject(
                f"--teacher-lora {value}: {file} is not a readable safetensors file ({exc}); pass a save_lora_weights "
                "folder or its .safetensors"
            )
        if not any("lora" in key for key in header):
            reject(f"--teacher-lora {value}: {file} holds no LoRA tensors (no key names lora_A / lora_B)")


def group_layout(args: argparse.Namespace) -> list[GroupSpec]:
    """The run's trainer groups as the flags lay them out (the method's :meth:`~miles.methods.base.Method.groups`
    with the method's own hooks only: no user hook path is imported here), for their paths and sizes."""
    return get_method(args).groups(args, UserHooks())


# The spec's path of each generic path flag (the dests group_paths takes).
_PATHS = {"hf_checkpoint": "init", "teacher_load": "teacher", "load": "load", "save": "save"}


def group_paths(
    args: argparse.Namespace, dests: tuple[str, ...], groups: list[GroupSpec] | None = None
) -> list[tuple[str, str]]:
    """``(flag, path)`` of the paths ``dests`` name over all trainer groups, each path once, the actor's first
    where groups share one. Each is labelled as its group's spec names it (:meth:`GroupSpec.path_label`): the
    critic's init is ``--critic-load`` (or the ``--teacher-load`` it defaults to), its save directory "the critic
    group's --save". ``groups``: :func:`group_layout`'s, when already laid out."""
    groups = sorted(group_layout(args) if groups is None else groups, key=lambda group: group.role != "actor")
    paths, seen = [], set()
    for group in groups:
        for dest in dests:
            value = group.paths()[_PATHS[dest]]
            if not value or os.path.realpath(value) in seen:
                continue
            seen.add(os.path.realpath(value))
            paths.append((group.path_label(_PATHS[dest]), value))
    return paths


def run_paths(args: argparse.Namespace, groups: list[GroupSpec] | None = None) -> list[tuple[str, str]]:
    """``(flag, path)`` of every model, checkpoint and run directory the command reads or writes, over all its
    trainer groups in training order (a group's ``--save`` may be a sibling such as ``<save>_critic``, its init the
    method's ``--critic-load``); ``groups``: :func:`group_layout`'s, when already laid out."""
    paths = []
    for group in group_layout(args) if groups is None else groups:
        for name, value in group.paths().items():
            if value:
                generic = GroupSpec.PATH_FLAGS[name]
                paths.append((generic if group.role == "actor" else f"the {group.role} group's {generic}", value))
    if args.output_dir:
        paths.append(("--output-dir", args.output_dir))
    return paths


def validate_method_flags(args: argparse.Namespace) -> None:
    """A method's own flags are read only under its loss type: a value set for another one is rejected."""
    for name, defaults in _method_flag_defaults().items():
        if name == args.loss_type:
            continue
        for dest in sorted(defaults):
            if getattr(args, dest, None) != defaults[dest]:
                reject(
                    f"--{dest.replace('_', '-')} is only read by --loss-type {name} (got --loss-type "
                    f"{args.loss_type}); remove it"
                )


# Every generic numeric flag: dest -> check_number's bounds (None values, flags left unset, are skipped). Batch
# sizes and counts are validate_batch_args'; each method checks its own flags in its validate().
NUMBER_RULES: dict[str, dict] = {
    "lr": {"low": 0},
    "min_lr": {"low": 0},
    "adam_beta1": {"low": 0, "high": 1, "high_open": True},
    "adam_beta2": {"low": 0, "high": 1, "high_open": True},
    "adam_eps": {"low": 0, "low_open": True},
    "weight_decay": {"low": 0},
    "clip_grad": {"low": 0},
    "lr_warmup_steps": {"low": 0},
    "max_skipped_steps": {"low": 1},
    "ema_decay": {"low": 0, "high": 1, "low_open": True, "high_open": True, "hint": "(e.g. 0.99)"},
    "ema_min_decay": {"low": 0, "high": 1, "high_open": True},
    "ema_update_after_step": {"low": 0},
    "fsdp_flow_shift": {"low": 0, "low_open": True, "hint": "(e.g. 3.0)"},
    "diffusion_flow_shift": {"low": 0, "low_open": True, "hint": "(e.g. 3.0)"},
    "diffusion_guidance_scale": {"low": 0, "hint": "(1 = no CFG)"},
    "sft_uncond_prob": {"low": 0, "high": 1, "high_open": True},
    "rollout_num_gpus": {"low": 0},
    "num_cpus_per_rank": {"low": 1},
    "gpu_memory_gb": {"low": 0, "low_open": True, "hint": "(e.g. 80)"},
    "global_batch_size": {"low": 1},
    "save_interval": {"low": 1},
    "save_keep_last": {"low": 1},
    "save_keep_every": {"low": 1},
    "eval_interval": {"low": 1},
    "eval_n_samples_per_prompt": {"low": 1},
    "eval_max_prompts": {"low": 1},
    # Seeds feed torch.manual_seed and torch.Generator.manual_seed, which take signed 64-bit integers.
    "seed": {"low": 0, "high": 2**63 - 1},
    "rollout_seed": {"low": 0, "high": 2**63 - 1},
}


def validate_number_args(args: argparse.Namespace) -> None:
    """Reject numbers that no run can use: NaN or infinite values (argparse's ``float`` takes ``nan`` and ``inf``),
    values outside their range (:data:`NUMBER_RULES`), ``--min-lr`` above ``--lr``, which would otherwise fail
    inside a Ray worker, or silently train the wrong way (``--clip-grad nan`` turns clipping off)."""
    for dest, bounds in NUMBER_RULES.items():
        value = getattr(args, dest, None)
        if value is not None:
            check_number(flag(dest), value, **bounds)
    if args.min_lr > args.lr:
        reject(f"--min-lr {args.min_lr} must be <= --lr {args.lr} (the cosine schedule decays from --lr to it)")
    if args.ema_decay is None and (args.ema_min_decay != 0.0 or args.ema_update_after_step != 0):
        reject("--ema-min-decay and --ema-update-after-step shape the EMA's warm-up: add --ema-decay")
    if args.ema_decay is None and not args.ema_for_eval:
        reject(
            "--no-ema-for-eval evaluates the live weights instead of the EMA's: without --ema-decay there is no EMA"
        )
    if args.ema_decay is not None and args.ema_min_decay > args.ema_decay:
        reject(f"--ema-min-decay {args.ema_min_decay} must be <= --ema-decay {args.ema_decay} (the warm-up's floor)")
    if args.save_keep_every is not None and args.save_keep_last is None:
        reject("--save-keep-every only spares checkpoints that --save-keep-last would prune: add --save-keep-last")
