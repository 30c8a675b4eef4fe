"""Checks of a command that read the filesystem or import code, run by the driver before Ray starts.

``parse_args`` checks flag values only; these also open the files and hook modules the flags name, so that a typo
fails in seconds on one line (exit code 2) instead of inside a Ray worker, or after the training for
``--eval-function-path``. ``--dry-run`` runs them too: a dry run on the machine that holds the data and the
pipelines checks everything a real run checks before Ray starts.
"""

import argparse
import os
from pathlib import Path

from miles.config import UserHooks
from miles.utils.validation import reject

__all__ = ["validate_inputs"]


def _check_pipeline(flag: str, path: str, family_override: str | None) -> None:
    from miles.models import get_model_family

    if not os.path.isdir(path):
        reject(f"{flag} {path}: no such directory; pass a diffusers pipeline directory")
    from miles.models.base import read_scheduler_config

    try:
        family = get_model_family(path, family_override)
        family.latent_shape(path)
        # The trainer's σ grid and the export's scheduler come from it.
        read_scheduler_config(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        reject(f"{flag} {path} is not a usable pipeline directory: {exc}")


def _check_records(
    flag: str, path: str, input_key: str, image_key: str | None = None, latent_key: str | None = None
) -> list:
    from miles.rollout.data_source import JsonlPromptSource

    try:
        records = JsonlPromptSource(path, input_key=input_key, shuffle=False, flag=flag).records
    except (OSError, ValueError) as exc:
        reject(str(exc))
    if image_key is not None:
        for number, record in enumerate(records, start=1):
            if image_key not in record and not isinstance(record.get(latent_key), str):
                reject(
                    f"{flag} {path}: record {number} (prompt {record[input_key]!r}) has no image under --image-key "
                    f"{image_key!r} (nor a latent file under --latent-key {latent_key!r}); --train-only trains on "
                    "every record's image"
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
            reject(str(exc))


def _group_pipelines(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(flag, path)`` of every pipeline a trainer group loads: its init (``--hf-checkpoint``, the critic's
    ``--critic-load``) and its frozen teacher, each once, the student's first."""
    from miles.driver.arguments import group_paths

    return group_paths(args, ("hf_checkpoint", "teacher_load"))


def _check_real_data(args: argparse.Namespace, flag: str, path: str) -> list:
    """Real samples (the GAN's ``--dmd2-gan-real-data``): records with a prompt and an image or latent file; images
    written into the JSONL load and fit the model's latent."""
    from miles.models import get_model_family
    from miles.rollout.data_source import load_image_latent

    records = _check_records(flag, path, args.input_key)
    family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
    shape = family.latent_shape(args.hf_checkpoint)
    for number, record in enumerate(records, start=1):
        where = f"{flag} {path} record {number} (prompt {record[args.input_key]!r})"
        if args.image_key not in record and not isinstance(record.get(args.latent_key), str):
            reject(
                f"{where} has neither an image under --image-key {args.image_key!r} nor a latent file under "
                f"--latent-key {args.latent_key!r}"
            )
        value = record.get(args.image_key)
        if value is not None and not isinstance(value, str):
            try:
                load_image_latent(family, value, expected_shape=shape, where=where)
            except (OSError, ValueError, TypeError) as exc:
                reject(str(exc))
    return records


def _check_negative_cond(path: str) -> None:
    from miles.driver.preflight_models import safetensors_header

    if not os.path.isfile(path):
        reject(f"--negative-cond {path} does not exist; pass a .safetensors cond file (miles.rollout.prompt_cache)")
    try:
        safetensors_header(Path(path))
    except (OSError, ValueError) as exc:
        reject(f"--negative-cond {path} is not a readable safetensors file ({exc})")


def validate_inputs(args: argparse.Namespace, check_paths: bool = True) -> UserHooks:
    """Checks that read the filesystem or import code, run by the driver before Ray starts, so that a typo fails in
    seconds on one line instead of inside a Ray worker (or, for ``--eval-function-path``, after the training).

    - every hook path (``--custom-*-path``, ``--diffusion-step-strategy-path``, ``--eval-function-path``) imports
      and names a callable; ``--diffusion-model-family`` is a registered name or imports a complete family class;
    - ``--load`` holds a complete, readable newest checkpoint of this loss type (``preflight_checkpoint``);
    - with ``check_paths``: every group's init and teacher (``--hf-checkpoint``, ``--teacher-load``, the critic's
      ``--critic-load``) are pipeline directories of one family whose denoisers take the student's latents and
      prompt encodings, with readable, finite safetensors weights, and guidance scales
      the pipelines can take, and with ``--context-parallel-size`` denoisers diffusers can split (``preflight_models``);
      ``--prompt-data`` (and ``--eval-prompt-data`` with ``--eval-interval``, the GAN's ``--dmd2-gan-real-data``)
      are JSONL files whose records carry ``--input-key`` (errors name the file and line), and with
      ``--train-only`` every record has an image under ``--image-key`` (images written into the JSONL are loaded
      and must fit the model's latent shape); the image, latent and cached cond files the records name exist, and
      stored latents have the model's shape (``preflight_data``); ``--negative-cond`` is a readable safetensors
      file; the method's own checks of its inputs (``Method.check_inputs``); with ``--gpu-memory-gb``, text
      encoders that would not fit beside the actor group (no prompt cache) refuse the run, naming the prompt-cache
      command (``memory_plan.check_text_encoders_fit``);
    - with ``check_paths``: every output directory takes files, holds no other run's checkpoints unless resumed or
      ``--overwrite-save``, and has room for a checkpoint (``preflight_outputs``; a warning when the run's
      checkpoints may not fit).

    ``parse_args`` does not run these; the driver runs them all, in a ``--dry-run`` too (``check_paths=False`` leaves
    out the data, pipeline and output checks, for tests of the rest).

    Returns:
        The user's hooks, imported once (:func:`miles.driver.specs.resolve_hooks`): the driver builds the run's
        specs from them.

    Raises:
        ArgumentValidationError: at the first failed check; the message names the flag and the path.
    """
    from miles.driver.specs import resolve_hooks
    from miles.driver.validators import group_layout

    if args.diffusion_model_family:
        from miles.models import family_class

        try:
            family_class(args.diffusion_model_family)
        except ValueError as exc:
            reject(str(exc))
    hooks = resolve_hooks(args)
    if args.load:
        from miles.driver.preflight_checkpoint import check_load

        check_load(args, group_layout(args))
    if not check_paths:
        return hooks
    from miles.driver import preflight_models, preflight_outputs
    from miles.methods import get_method

    pipelines = _group_pipelines(args)
    if args.diffusion_model_family:
        # Before the family reads any config: a mismatch would otherwise surface as a missing key, or after Ray.
        from miles.models import family_class

        try:
            family = family_class(args.diffusion_model_family)
        except ValueError as exc:
            reject(str(exc))
        for label, path in pipelines:
            preflight_models.check_family_matches(label, path, family)
    for label, path in pipelines:
        _check_pipeline(label, path, args.diffusion_model_family)
    preflight_models.check_compatible(args, pipelines)
    preflight_models.check_context_parallel(args, pipelines)
    preflight_models.check_guidance(args)
    for label, path in pipelines:
        preflight_models.check_weights(label, path)
    from miles.driver.preflight_data import check_record_files
    from miles.models import get_model_family

    shape = get_model_family(args.hf_checkpoint, args.diffusion_model_family).latent_shape(args.hf_checkpoint)
    image_key = args.image_key if args.train_only else None
    records = _check_records("--prompt-data", args.prompt_data, args.input_key, image_key, args.latent_key)
    if args.train_only:
        _check_inline_images(args, records)
    check_record_files(args, "--prompt-data", args.prompt_data, records, shape if args.train_only else None)
    if args.eval_interval and args.eval_prompt_data:
        eval_records = _check_records("--eval-prompt-data", args.eval_prompt_data, args.input_key)
        check_record_files(args, "--eval-prompt-data", args.eval_prompt_data, eval_records, None)
    side_inputs = get_method(args).side_inputs(args)
    for side in side_inputs:
        side_records = _check_real_data(args, side.flag, side.path)
        check_record_files(args, side.flag, side.path, side_records, shape)
    # Files read at evaluations only (the GAN's held-out reals: not a side input, no record per sample).
    for data in get_method(args).eval_data(args):
        eval_real_records = _check_real_data(args, data.flag, data.path)
        check_record_files(args, data.flag, data.path, eval_real_records, shape)
    if args.negative_cond:
        _check_negative_cond(args.negative_cond)
    get_method(args).check_inputs(args)
    from miles.driver.memory_plan import check_text_encoders_fit

    check_text_encoders_fit(args)
    preflight_outputs.check_writable(args)
    preflight_outputs.check_save_dirs(args)
    preflight_outputs.check_disk_space(args)
    return hooks
