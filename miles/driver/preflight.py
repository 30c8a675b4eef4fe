"""Checks of a command that read the filesystem or import code, run by the driver before Ray starts.

``parse_args`` checks flag values only; these also open the files and hook modules the flags name, so that a typo
fails in seconds on one line (exit code 2) instead of inside a Ray worker, or after the training for
``--eval-function-path``. They are separate so that ``--dry-run`` can check a command meant for a machine that holds
the data (``check_paths=False``).
"""

import argparse
import os

from miles.utils.arguments import ArgumentValidationError

__all__ = ["HOOK_FLAGS", "validate_inputs"]


def _reject(message: str) -> None:
    raise ArgumentValidationError(message)


HOOK_FLAGS = (
    "custom_expand_samples_to_train_pairs_path",
    "custom_train_input_function_path",
    "custom_prepare_train_batch_path",
    "custom_loss_function_path",
    "custom_train_output_function_path",
    "diffusion_step_strategy_path",
    "eval_function_path",
)


def _check_pipeline(flag: str, path: str, family_override: str | None) -> None:
    from miles.models import get_model_family

    if not os.path.isdir(path):
        _reject(f"{flag} {path}: no such directory; pass a diffusers pipeline directory")
    try:
        family = get_model_family(path, family_override)
        family.latent_shape(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _reject(f"{flag} {path} is not a usable pipeline directory: {exc}")


def _check_records(flag: str, path: str, input_key: str, image_key: str | None = None) -> list:
    from miles.rollout.data_source import JsonlPromptSource

    try:
        records = JsonlPromptSource(path, input_key=input_key, shuffle=False).records
    except (OSError, ValueError) as exc:
        _reject(str(exc).replace("--prompt-data", flag, 1) if flag != "--prompt-data" else str(exc))
    if image_key is not None:
        for number, record in enumerate(records, start=1):
            if image_key not in record:
                _reject(
                    f"{flag} {path}: record {number} (prompt {record[input_key]!r}) has no image under --image-key "
                    f"{image_key!r}; --train-only trains on every record's image"
                )
    return records


def _check_inline_images(args: argparse.Namespace, records: list) -> None:
    """``--train-only``: every image written into the JSONL (not a file path) loads and fits the model's latent."""
    from miles.models import get_model_family
    from miles.rollout.data_source import load_image_latent

    family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
    shape = family.latent_shape(args.hf_checkpoint)
    for number, record in enumerate(records, start=1):
        value = record[args.image_key]
        if isinstance(value, str):
            continue  # image files are read by the RolloutManager, which names the sample on failure
        try:
            load_image_latent(
                family,
                value,
                expected_shape=shape,
                where=f"--prompt-data {args.prompt_data} record {number} (prompt {record[args.input_key]!r})",
            )
        except (OSError, ValueError, TypeError) as exc:
            _reject(str(exc))


def validate_inputs(args: argparse.Namespace, check_paths: bool = True) -> None:
    """Checks that read the filesystem or import code, run by the driver before Ray starts, so that a typo fails in
    seconds on one line instead of inside a Ray worker (or, for ``--eval-function-path``, after the training).

    - every hook path (``--custom-*-path``, ``--diffusion-step-strategy-path``, ``--eval-function-path``) imports
      and names a callable;
    - ``--load`` holds a complete newest checkpoint;
    - with ``check_paths``: ``--hf-checkpoint``, ``--teacher-load`` and ``--critic-load`` are pipeline directories,
      ``--prompt-data`` (and ``--eval-prompt-data`` with ``--eval-interval``) are JSONL files whose records carry
      ``--input-key``, and with ``--train-only`` every record has an image under ``--image-key`` (images written
      into the JSONL are loaded and must fit the model's latent shape).

    ``parse_args`` does not run these: a ``--dry-run`` may validate a command meant for a machine that holds the data.

    Raises:
        ArgumentValidationError: at the first failed check; the message names the flag and the path.
    """
    from miles.utils.misc import load_function

    for name in HOOK_FLAGS:
        path = getattr(args, name, None)
        if path:
            try:
                load_function(path)
            except ValueError as exc:
                _reject(f"--{name.replace('_', '-')}: {exc}")
    if args.load:
        from miles.backends.fsdp_utils.checkpoint import read_data_state

        try:
            actor_latest = read_data_state(args.load)[0]
        except (OSError, ValueError, RuntimeError) as exc:
            _reject(str(exc) if str(exc).startswith("--load") else f"--load {args.load}: {exc}")
        if args.loss_type == "dmd2":
            from miles.utils.trainer_config import sibling_dir

            critic = sibling_dir(args.load, "_critic")
            try:
                critic_latest = read_data_state(critic)[0]
            except (OSError, ValueError, RuntimeError) as exc:
                detail = str(exc).removeprefix("--load ")
                _reject(f"--load {args.load} of --loss-type dmd2 also loads the critic's checkpoint: {detail}")
            if critic_latest != actor_latest:
                # A crash between the two groups' saves of one rollout; the older checkpoints stay on disk.
                common = min(critic_latest, actor_latest)
                _reject(
                    f"--load {args.load} holds rollout {actor_latest} but the critic's {critic} holds rollout "
                    f"{critic_latest} (a crash between the two saves?); write {common} into the newer one's 'latest' "
                    f"file to resume both from rollout {common}"
                )
    if not check_paths:
        return
    for flag in ("hf_checkpoint", "teacher_load", "critic_load"):
        path = getattr(args, flag)
        if path:
            _check_pipeline(f"--{flag.replace('_', '-')}", path, args.diffusion_model_family)
    records = _check_records(
        "--prompt-data", args.prompt_data, args.input_key, args.image_key if args.train_only else None
    )
    if args.train_only:
        _check_inline_images(args, records)
    if args.eval_interval and args.eval_prompt_data:
        _check_records("--eval-prompt-data", args.eval_prompt_data, args.input_key)
