"""Checks of a command that read the filesystem or import code, run by the driver before Ray starts: one pass.

``parse_args`` checks flag values only (:mod:`miles.driver.validators`); :func:`validate_inputs` opens the files and
hook modules the flags name, so that a typo fails in seconds on one line (exit code 2) instead of inside a Ray
worker, or after the training for ``--eval-function-path``. Each check runs once, in the order a user needs the
answers: the code the command names, ``--load``, the pipelines, the data, the outputs. ``--dry-run`` runs them too:
a dry run on the machine that holds the data and the pipelines checks everything a real run checks before Ray.

The weights are read from the safetensors files of ``<pipeline>/transformer`` one tensor at a time (memory-mapped),
so a model of any size is checked with the memory of its largest tensor.
"""

import argparse
import os
from pathlib import Path

from miles.config import RunSpec
from miles.models.base import DENOISER
from miles.models.pipeline_files import SECOND_EXPERT
from miles.utils.validation import reject

__all__ = ["check_weights", "validate_inputs"]


def validate_inputs(args: argparse.Namespace, check_paths: bool = True) -> RunSpec:
    """Every check of the files and code a command names, in this order:

    1. every hook path (``--custom-*-path``, ``--diffusion-step-strategy-path``, the method's,
       ``--eval-function-path``) imports and names a callable (:func:`miles.driver.specs.resolve_hooks`); the run's
       specs are built from them (:func:`miles.driver.specs.build_run_spec`; ``--diffusion-model-family`` is a
       registered name or imports a complete family class), and every check below reads its groups and data there;
    2. ``--load`` holds a complete, readable newest checkpoint of this command (``preflight_checkpoint``);
    3. with ``check_paths``, the pipelines (:func:`_check_pipelines`): every group's init and teacher are pipeline
       directories of the student's family that take its latents and prompt encodings, can be guided as asked, and
       hold readable, finite safetensors weights;
    4. the data (``preflight_data``): ``--prompt-data``, ``--eval-prompt-data`` (with ``--eval-interval``) and the
       method's data files (the GAN's real data) are JSONL files whose records carry ``--input-key``; records that
       are trained on have an image (written into the JSONL: it loads and fits the model's latent) or a latent file
       of the model's shape; every cached cond (and ``--negative-cond``) is a whole safetensors file of the run's
       family, all of one prompt cache; then the method's own checks (``Method.check_inputs``) and, with
       ``--gpu-memory-gb``, text encoders that would not fit beside the actor group (``check_text_encoders_fit``);
    5. the outputs (``preflight_outputs``): every output directory takes files, lies in no pipeline, holds no
       other run's checkpoints unless resumed or ``--overwrite-save``, and has room for a checkpoint.

    ``check_paths=False`` stops after step 2 (a ``--dry-run`` for a cluster's paths, tests of the rest).

    Returns:
        The run's specs, built once (the hooks imported once): the driver plans or trains from them.

    Raises:
        ArgumentValidationError: at the first failed check; the message names the flag and the path.
    """
    from miles.driver.preflight_checkpoint import check_load
    from miles.driver.specs import build_run_spec, resolve_hooks
    from miles.driver.validators import group_paths

    run = build_run_spec(args, resolve_hooks(args))
    override = run.engine.family if args.diffusion_model_family else None
    groups = list(run.groups)
    _check_condition_image_key(run)
    if args.load:
        check_load(args, groups)
    if not check_paths:
        return run
    from miles.driver import preflight_outputs
    from miles.driver.memory_plan import check_text_encoders_fit
    from miles.driver.preflight_data import DataCheck, check_negative_cond
    from miles.methods import get_method

    method = get_method(args)
    pipelines = group_paths(args, ("hf_checkpoint", "teacher_load"), groups)
    family, shape = _check_pipelines(args, pipelines, override, run.engine.family, method.guided_pipelines(args))
    spec = run.engine.data
    data = DataCheck(family, shape, spec, args.hf_checkpoint)
    train = "--train-only trains on every record's image" if spec.train_only else ""
    data.records("--prompt-data", spec.prompt_data, train)
    if args.eval_interval and args.eval_prompt_data:
        data.records("--eval-prompt-data", args.eval_prompt_data)
    # The method's data files: those dealt beside the prompts (the GAN's real data) and those read at evaluations.
    for side in [*method.side_inputs(args), *method.eval_data(args)]:
        data.records(side.flag, side.path, "each of its records is trained on")
    if run.engine.negative_cond:
        check_negative_cond(data, run.engine.negative_cond)
    method.check_inputs(args)
    check_text_encoders_fit(args)
    preflight_outputs.check_outputs(args, groups, pipelines)
    return run


def _check_condition_image_key(run: RunSpec) -> None:
    """``--condition-image-key`` names the reference image of an edit model's records; set for a family without
    references it would change nothing, which is refused like every flag read by nothing."""
    from miles.config import DataSpec
    from miles.models.capabilities import ImageConditioned, supports

    key, family = run.engine.data.condition_image_key, run.engine.family
    if family is not None and key != DataSpec.condition_image_key and not supports(family, ImageConditioned):
        reject(
            f"--condition-image-key {key} is read by an image-conditioned family only (qwen_image_edit); the "
            f"{family.name} family takes no reference image: remove it"
        )


def _check_pipelines(
    args: argparse.Namespace,
    pipelines: list[tuple[str, str]],
    override: type | None,
    student_class: type | None,
    guided: list,
):
    """Each pipeline a group loads, the student's ``--hf-checkpoint`` first: a directory; of the family
    ``--diffusion-model-family`` names (one of its ``pipeline_classes``; a family that declares none is trusted);
    usable (its latent shape and scheduler config read: the trainer's σ grid and the export's scheduler come from
    it); of the student's family with the figures of its ``compatibility_signature`` (SD3: latent channels and size,
    text-encoder widths; digits adds the token length); with ``--context-parallel-size``, denoisers diffusers can
    split (:func:`_check_context_parallel`). Then each guidance scale at most its pipeline's
    ``max_guidance_scale`` (``--diffusion-guidance-scale`` the student's, the method's ``guided``: DMD2's teacher; a
    FLUX.1-schnell checkpoint takes no guidance), and every denoiser's weights (:func:`check_weights`).

    Args:
        student_class: the student's family class as the specs resolved it (None: unreadable there; read here again).

    Returns:
        ``(family, latent shape)`` of the student.

    Raises:
        ArgumentValidationError: one line naming the flag, the path and the figure or file at fault.
    """
    from miles.models import get_model_family
    from miles.models.base import read_scheduler_config
    from miles.models.registry import pipeline_class_name

    families, signatures, experts = {}, {}, set()
    for label, path in pipelines:
        if not os.path.isdir(path):
            reject(f"{label} {path}: no such directory; pass a diffusers pipeline directory")
        if override is not None and getattr(override, "pipeline_classes", ()):
            try:
                class_name = pipeline_class_name(path)
            except (OSError, ValueError) as exc:
                reject(f"{label} {path}: {exc}")
            if class_name not in override.pipeline_classes:
                reject(
                    f"--diffusion-model-family {override.name} does not match {label} {path}: its model_index.json "
                    f"names {class_name}, and the {override.name} family loads {', '.join(override.pipeline_classes)}"
                    "; drop the flag (the family is read from model_index.json) or name the family of that pipeline"
                )
        try:
            known = student_class if path == pipelines[0][1] else None
            families[path] = family = known(path) if known else get_model_family(path, args.diffusion_model_family)
            shape = tuple(family.latent_shape(path))
            read_scheduler_config(path)
            # A two-expert pipeline (Wan 2.2 A14B) needs a usable boundary; its second expert's weights are checked
            # below with the first's.
            if family.expert_boundary(path) is not None:
                experts.add(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            reject(f"{label} {path} is not a usable pipeline directory: {exc}")
        student_label, student = pipelines[0]
        if path == student:
            student_shape = shape
        elif family.name != families[student].name:
            reject(
                f"{label} {path} is a {family.name} pipeline but {student_label} {student} is "
                f"{families[student].name}; every group must use the student's model family"
            )
        if len(pipelines) == 1:
            continue  # a lone student fits itself
        try:
            signatures[path] = family.compatibility_signature(path)
        except (OSError, ValueError, KeyError) as exc:
            reject(f"{label} {path}: cannot read the {family.name} family's compatibility figures ({exc})")
        for figure, value in signatures[path].items():
            if value != signatures[student].get(figure):
                reject(
                    f"{label} {path} does not fit {student_label} {student}: {figure} {value} vs "
                    f"{signatures[student].get(figure)}; it must take the student's latents and prompt encodings"
                )
    checks = [("--diffusion-guidance-scale", args.diffusion_guidance_scale, "--hf-checkpoint", args.hf_checkpoint)]
    for scale_flag, scale, path_flag, path in checks + guided:
        family = families.get(path) or get_model_family(path, args.diffusion_model_family)
        limit = family.max_guidance_scale(path)
        if limit is not None and scale > limit:
            reject(
                f"{scale_flag} {scale:g} does not fit {path_flag} {path}: the {family.name} pipeline takes guidance "
                f"up to {limit:g} (a guidance- or step-distilled checkpoint); set {scale_flag} {limit:g} or use "
                "the undistilled base model"
            )
    _check_context_parallel(args, pipelines, families)
    for label, path in pipelines:
        check_weights(label, path)
        if path in experts:
            check_weights(label, path, SECOND_EXPERT)
    return families[args.hf_checkpoint], student_shape


def _check_context_parallel(args: argparse.Namespace, pipelines: list[tuple[str, str]], families: dict) -> None:
    """With ``--context-parallel-size`` > 1, every group's denoiser (the frozen teacher too) has diffusers'
    ``_cp_plan`` (Wan, FLUX, FLUX.2, Qwen-Image; not SD3 nor the digits model) and one sample's image/video tokens,
    its text tokens where the plan splits them and its attention heads divide by it
    (:func:`miles.backends.fsdp_utils.context_parallel.check_context_parallel`).

    Raises:
        ArgumentValidationError: one line naming the flag, the pipeline and the figure.
    """
    from miles.backends.fsdp_utils.context_parallel import check_context_parallel, heads_of, model_class_of
    from miles.models.base import read_json
    from miles.utils.validation import context_parallel_size

    cp = context_parallel_size(args)
    if cp == 1:
        return
    for label, path in pipelines:
        family = families[path]
        config = read_json(Path(path) / DENOISER / "config.json", f"{label} transformer config")
        image, text = family.tokens_per_sample(path) if hasattr(family, "tokens_per_sample") else (0, None)
        try:
            check_context_parallel(model_class_of(config), image, heads_of(config), cp, text)
        except ValueError as exc:
            reject(f"{label} {path}: {exc}")


def check_weights(flag: str, pipeline: str, component: str = DENOISER) -> None:
    """Every safetensors file of the pipeline's denoiser (``component``: a two-expert pipeline's ``transformer_2``)
    opens and holds finite values only.

    Raises:
        ArgumentValidationError: naming the flag, the file and the first non-finite tensor; for a denoiser with
            ``.bin`` weights only (each trainer rank reads only its own rows of each tensor, which safetensors
            allows and pickles do not), or none.
    """
    import torch
    from safetensors import safe_open

    from miles.driver.preflight_data import safetensors_header

    folder = Path(pipeline) / component
    files = sorted(folder.glob("*.safetensors"))
    if not files and any(folder.glob("*.bin")):
        reject(
            f"{flag} {pipeline}: {folder} holds .bin weights only; miles loads safetensors: save the model again "
            "with save_pretrained(..., safe_serialization=True)"
        )
    if not files:
        reject(f"{flag} {pipeline}: {folder} holds no weights file (*.safetensors); is the pipeline complete?")
    for path in files:
        bad = None
        try:
            header = safetensors_header(path)
            with safe_open(str(path), framework="pt") as f:
                for key in (name for name in header if name != "__metadata__"):
                    tensor = f.get_tensor(key)
                    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                        bad = (key, int((~torch.isfinite(tensor)).sum()))
                        break
        except (OSError, ValueError, RuntimeError) as exc:
            reject(f"{flag} {pipeline}: {path} is not a readable safetensors file ({exc})")
        if bad is not None:
            where = path.name if component == DENOISER else f"{component}/{path.name}"
            reject(
                f"{flag} {pipeline}: {where} tensor {bad[0]} holds {bad[1]} non-finite values (NaN/inf); "
                "refusing to train from it"
            )
