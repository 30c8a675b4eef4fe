"""From the parsed command line to the run's specs (:mod:`miles.config`), once, before Ray starts.

::

    args  = parse_args(argv)                       # the flags, validated
    hooks = resolve_hooks(args)                    # every --custom-*-path (and the method's own) imported once
    run   = build_run_spec(args, hooks)            # RunSpec: EngineSpec + the method's GroupSpecs

A hook path that is empty, does not import or is not what its flag takes fails here on one line naming the flag and
the path (exit code 2). Nothing below the driver imports a hook path again: the specs hold the functions.
"""

import argparse
from collections.abc import Callable

from miles.config import DataSpec, EngineSpec, ExportSpec, GroupHooks, ProfileSpec, RunSpec, UserHooks
from miles.methods import get_method
from miles.utils.misc import load_function
from miles.utils.profiling import profile_dir
from miles.utils.validation import context_parallel_size, dp_size, flag, reject

__all__ = ["build_run_spec", "hook_flags", "resolve_hooks"]


def hook_flags(args: argparse.Namespace) -> dict[str, str | None]:
    """Every hook flag of the command, ``{dest: dotted path or None}``, in the order they are checked: the generic
    ``--custom-*-path`` ones, the step strategy, the method's own (``Method.hook_flags``), the eval hook."""
    return {
        "custom_expand_samples_to_train_pairs_path": args.custom_expand_samples_to_train_pairs_path,
        "custom_train_input_function_path": args.custom_train_input_function_path,
        "custom_prepare_train_batch_path": args.custom_prepare_train_batch_path,
        "custom_loss_function_path": args.custom_loss_function_path,
        "custom_train_output_function_path": args.custom_train_output_function_path,
        "custom_build_modules_path": args.custom_build_modules_path,
        "custom_trainer_path": args.custom_trainer_path,
        "diffusion_step_strategy_path": args.diffusion_step_strategy_path,
        **get_method(args).hook_flags(args),
        "eval_function_path": args.eval_function_path,
    }


def _trainer_class(path: str, cls: Callable) -> type:
    from miles.backends.fsdp_utils.trainer import GroupTrainer

    if not (isinstance(cls, type) and issubclass(cls, GroupTrainer)):
        reject(f"--custom-trainer-path {path} is {cls!r}, not a subclass of {GroupTrainer.__qualname__}")
    return cls


def resolve_hooks(args: argparse.Namespace) -> UserHooks:
    """Import every hook path the command names, once.

    Raises:
        ArgumentValidationError: for an empty path, one that does not import or names no callable (the message
            names the flag, the path and what failed), or a ``--custom-trainer-path`` that is no ``GroupTrainer``.
    """
    paths = hook_flags(args)
    loaded: dict[str, Callable] = {}
    for dest, path in paths.items():
        if path == "":
            # An empty value would otherwise fall back to nothing, or to the method's hook, silently.
            reject(f"{flag(dest)} is empty; pass a dotted path 'package.module.function' or drop it")
        if path:
            try:
                loaded[dest] = load_function(path)
            except ValueError as exc:
                reject(f"{flag(dest)}: {exc}")
    if "custom_trainer_path" in loaded:
        _trainer_class(paths["custom_trainer_path"], loaded["custom_trainer_path"])
    method_dests = set(get_method(args).hook_flags(args))
    return UserHooks(
        group=GroupHooks(
            prepare=loaded.get("custom_prepare_train_batch_path"),
            loss=loaded.get("custom_loss_function_path"),
            train_input=loaded.get("custom_train_input_function_path"),
            train_output=loaded.get("custom_train_output_function_path"),
            build_modules=loaded.get("custom_build_modules_path"),
            trainer=loaded.get("custom_trainer_path"),
        ),
        converter=loaded.get("custom_expand_samples_to_train_pairs_path"),
        step_strategy=loaded.get("diffusion_step_strategy_path"),
        eval=loaded.get("eval_function_path"),
        method={dest: fn for dest, fn in loaded.items() if dest in method_dests},
    )


def data_spec(args: argparse.Namespace) -> DataSpec:
    """The prompts and the data keys of the command."""
    same = (
        "prompt_data input_key image_key condition_image_key latent_key cond_key train_only rollout_batch_size "
        "n_samples_per_prompt"
    )
    values = {name: vars(args)[name] for name in same.split()}  # the fields named as their flags
    return DataSpec(**values, seed=args.rollout_seed, shuffle=args.rollout_shuffle)


def engine_spec(args: argparse.Namespace, hooks: UserHooks, family: type) -> EngineSpec:
    """The student's sampler: the user's converter and step strategy where set, the method's elsewhere (a command
    with neither converter is refused by ``parse_args``)."""
    method = get_method(args)
    timesteps = args.diffusion_timesteps
    same = "negative_prompt negative_prompt_origin negative_cond micro_batch_size"
    return EngineSpec(
        **{name: vars(args)[name] for name in same.split()},  # the fields named as their flags
        family=family,
        pipeline=args.hf_checkpoint,
        converter=hooks.converter or method.converter(args),
        num_steps=args.diffusion_num_steps,
        flow_shift=args.diffusion_flow_shift,
        timesteps=tuple(timesteps) if timesteps else None,
        guidance_scale=args.diffusion_guidance_scale,
        step_rule=args.diffusion_step_rule,
        step_strategy=hooks.step_strategy or method.step_strategy(args),
        encode_negative=bool(args.encode_negative_prompt),
        dtype=args.train_dtype,
        seed=args.rollout_seed,
        data=data_spec(args),
    )


def family_class(args: argparse.Namespace) -> type | None:
    """The model family class of the command: ``--diffusion-model-family``, else the registered family of the
    student pipeline's ``model_index.json``; None when that cannot be read here (a ``--dry-run`` for a cluster's
    paths: preflight refuses a real run's unreadable pipeline).

    Raises:
        ArgumentValidationError: for a ``--diffusion-model-family`` that is no registered name and imports no
            complete family class.
    """
    from miles.models.registry import family_class as by_name
    from miles.models.registry import family_class_for_pipeline

    if args.diffusion_model_family:
        try:
            return by_name(args.diffusion_model_family)
        except ValueError as exc:
            reject(str(exc))
    try:
        return family_class_for_pipeline(args.hf_checkpoint)
    except (OSError, ValueError):
        return None


def build_run_spec(args: argparse.Namespace, hooks: UserHooks | None = None) -> RunSpec:
    """The run's specs from the parsed (validated) command; ``hooks`` default: :func:`resolve_hooks`.

    Raises:
        ArgumentValidationError: for a bad hook path or ``--diffusion-model-family``.
    """
    hooks = resolve_hooks(args) if hooks is None else hooks
    family = family_class(args)
    profile = None
    if args.profile_rollouts is not None:
        profile = ProfileSpec(rollouts=tuple(args.profile_rollouts), directory=str(profile_dir(args)))
    return RunSpec(
        args=args,
        engine=engine_spec(args, hooks, family),
        groups=tuple(get_method(args).groups(args, hooks)),
        dp_size=dp_size(args),
        context_parallel_size=context_parallel_size(args),
        export=ExportSpec(path=args.save_hf, overwrite=args.overwrite_save_hf, save_lora=args.save_hf_lora),
        profile=profile,
        log_level=args.log_level,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        eval_hook=hooks.eval,
    )
