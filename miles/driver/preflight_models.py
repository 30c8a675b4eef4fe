"""Preflight of the models: every denoiser's weights open and are finite, and the groups' pipelines fit together.

Run by the driver before Ray starts (:func:`miles.driver.preflight.validate_inputs`). The weights are read from the
safetensors files of ``<pipeline>/transformer`` one tensor at a time (memory-mapped), so a model of any size is
checked with the memory of its largest tensor.
"""

import argparse
import json
import logging
import struct
from pathlib import Path

from miles.models.base import DENOISER
from miles.utils.validation import reject

__all__ = [
    "check_compatible",
    "check_context_parallel",
    "check_guidance",
    "check_weights",
    "denoiser_numel",
    "safetensors_header",
]

logger = logging.getLogger(__name__)

# Bytes per element of the safetensors dtypes a denoiser is stored in.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I8": 1}


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (``{name: {"dtype", "shape", "data_offsets"}}``), checked against the
    file's size.

    Raises:
        ValueError: if the file is too short, its header is not JSON, or its tensors run past the end of the file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            raise ValueError(f"header of {length} bytes runs past the end of the {size}-byte file (truncated?)")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ValueError(f"header is not JSON ({exc})") from None
    end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise ValueError(f"tensors need {8 + length + end} bytes but the file holds {size} (truncated?)")
    return header


def _weight_files(flag: str, pipeline: str) -> list[Path]:
    folder = Path(pipeline) / DENOISER
    files = sorted(folder.glob("*.safetensors"))
    if not files and any(folder.glob("*.bin")):
        # Each trainer rank reads only its own rows of each tensor, which safetensors allows and pickles do not.
        reject(
            f"{flag} {pipeline}: {folder} holds .bin weights only; miles loads safetensors: save the model again "
            "with save_pretrained(..., safe_serialization=True)"
        )
    if not files:
        reject(f"{flag} {pipeline}: {folder} holds no weights file (*.safetensors); is the pipeline complete?")
    return files


def denoiser_numel(pipeline: str) -> int:
    """Parameters of the pipeline's denoiser, from its safetensors headers (0 when it has none)."""
    total = 0
    for path in sorted((Path(pipeline) / DENOISER).glob("*.safetensors")):
        for key, info in safetensors_header(path).items():
            if key != "__metadata__":
                numel = 1
                for dim in info["shape"]:
                    numel *= dim
                total += numel
    return total


def check_weights(flag: str, pipeline: str) -> None:
    """Every safetensors file of the pipeline's denoiser opens and holds finite values only.

    Raises:
        ArgumentValidationError: naming the flag, the file and the first non-finite tensor.
    """
    import torch
    from safetensors import safe_open

    for path in _weight_files(flag, pipeline):
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
            reject(
                f"{flag} {pipeline}: {path.name} tensor {bad[0]} holds {bad[1]} non-finite values (NaN/inf); "
                "refusing to train from it"
            )


def _signature(flag: str, pipeline: str, family) -> dict:
    try:
        return family.compatibility_signature(pipeline)
    except (OSError, ValueError, KeyError) as exc:
        reject(f"{flag} {pipeline}: cannot read the {family.name} family's compatibility figures ({exc})")


def check_family_matches(flag: str, pipeline: str, family) -> None:
    """A family named by ``--diffusion-model-family`` must load the pipeline class ``pipeline``'s model_index.json
    names (one of its ``pipeline_classes``); a family that declares none is trusted.

    Raises:
        ArgumentValidationError: one line naming both flags, the pipeline's class and the family's classes.
    """
    from miles.models.registry import pipeline_class_name

    try:
        class_name = pipeline_class_name(pipeline)
    except (OSError, ValueError) as exc:
        reject(f"{flag} {pipeline}: {exc}")
    classes = tuple(getattr(family, "pipeline_classes", ()) or ())
    if classes and class_name not in classes:
        reject(
            f"--diffusion-model-family {family.name} does not match {flag} {pipeline}: its model_index.json names "
            f"{class_name}, and the {family.name} family loads {', '.join(classes)}; drop the flag (the family is "
            "read from model_index.json) or name the family of that pipeline"
        )


def check_compatible(args: argparse.Namespace, pipelines: list[tuple[str, str]]) -> None:
    """The teacher and the critic take the student's latents and prompt encodings: their denoisers must share the
    student's (the first pipeline's) family and the figures of its ``compatibility_signature`` (for SD3: latent
    channels and size, text-encoder widths; digits adds the token length).

    Args:
        pipelines: ``(flag, path)`` of every group's pipelines, the student's ``--hf-checkpoint`` first.

    Raises:
        ArgumentValidationError: naming both flags and the differing figure.
    """
    from miles.models import get_model_family

    (student_flag, student), *others = pipelines
    if not others:
        return
    family = get_model_family(student, args.diffusion_model_family)
    reference = _signature(student_flag, student, family)
    for other_flag, other in others:
        other_family = get_model_family(other, args.diffusion_model_family)
        if other_family.name != family.name:
            reject(
                f"{other_flag} {other} is a {other_family.name} pipeline but {student_flag} {student} is "
                f"{family.name}; every group must use the student's model family"
            )
        signature = _signature(other_flag, other, other_family)
        for label, value in signature.items():
            if value != reference.get(label):
                reject(
                    f"{other_flag} {other} does not fit {student_flag} {student}: {label} {value} vs "
                    f"{reference.get(label)}; it must take the student's latents and prompt encodings"
                )


def check_context_parallel(args: argparse.Namespace, pipelines: list[tuple[str, str]]) -> None:
    """With ``--context-parallel-size`` > 1, every group's denoiser (the frozen teacher too) has diffusers'
    ``_cp_plan`` (Wan, FLUX, FLUX.2, Qwen-Image; not SD3 nor the digits model) and one sample's image/video tokens,
    its text tokens where the plan splits them and its attention heads divide by it (:func:`miles.backends.fsdp_utils.context_parallel.check_context_parallel`).

    Raises:
        ArgumentValidationError: one line naming the flag, the pipeline and the figure.
    """
    from miles.backends.fsdp_utils.context_parallel import check_context_parallel as check
    from miles.backends.fsdp_utils.context_parallel import heads_of, model_class_of
    from miles.models import get_model_family
    from miles.utils.validation import context_parallel_size

    cp = context_parallel_size(args)
    if cp == 1:
        return
    for label, path in pipelines:
        family = get_model_family(path, args.diffusion_model_family)
        config = json.loads((Path(path) / DENOISER / "config.json").read_text())
        image, text = family.tokens_per_sample(path) if hasattr(family, "tokens_per_sample") else (0, None)
        try:
            check(model_class_of(config), image, heads_of(config), cp, text)
        except ValueError as exc:
            reject(f"{label} {path}: {exc}")


def check_guidance(args: argparse.Namespace) -> None:
    """Each pipeline can be guided as asked: ``--dmd2-teacher-guidance-scale`` (where the method has it) at most the
    teacher's ``ModelFamily.max_guidance_scale``, ``--diffusion-guidance-scale`` at most the student's (a
    FLUX.1-schnell checkpoint takes no guidance; a step-distilled FLUX.2-klein runs no CFG).

    Raises:
        ArgumentValidationError: one line naming the flag, its value, the pipeline and its limit.
    """
    from miles.methods import get_method
    from miles.models import get_model_family

    checks = [("--diffusion-guidance-scale", args.diffusion_guidance_scale, "--hf-checkpoint", args.hf_checkpoint)]
    checks += get_method(args).guided_pipelines(args)
    for scale_flag, scale, path_flag, path in checks:
        family = get_model_family(path, args.diffusion_model_family)
        limit = family.max_guidance_scale(path)
        if limit is not None and scale > limit:
            reject(
                f"{scale_flag} {scale:g} does not fit {path_flag} {path}: the {family.name} pipeline takes guidance "
                f"up to {limit:g} (a guidance- or step-distilled checkpoint); set {scale_flag} {limit:g} or use "
                "the undistilled base model"
            )
