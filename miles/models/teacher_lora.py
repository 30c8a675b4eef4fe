"""A user's fine-tune as the teacher: ``--teacher-lora PATH[:WEIGHT]`` (repeatable).

Each LoRA is in diffusers' format (what ``save_lora_weights`` writes: a directory with
``pytorch_lora_weights.safetensors``, or the file itself; keys ``transformer.<module>.lora_A.weight`` /
``lora_B.weight``, the adapter config as metadata). Before Ray starts, the driver writes the teacher pipeline once
more under ``<output-dir>/teacher_lora/`` with the LoRAs fused into its ``transformer/``, through diffusers' adapter
API (peft): ``load_lora_adapter`` for each, ``set_adapters(names, weights)``, ``fuse_lora``, ``unload_lora``; the
other components are hard links to the teacher's files. So a fused weight is ``W + Σ_i w_i · (alpha_i / r_i) · B_i A_i``
(peft's merge), computed in float32, and every reader of the teacher (the critic's scoring, the regression pairs,
the memory plan) reads an ordinary pipeline.

By default the student and the critic start from it too: every group whose model source is the teacher's pipeline
(``--hf-checkpoint`` or ``--critic-load`` equal to ``--teacher-load``) starts from the fused pipeline, so the student
is distilled from, and starts at, the user's fine-tune. ``--teacher-lora-teacher-only`` keeps their sources as given.
A student of another pipeline keeps its own weights either way.
"""

import dataclasses
import logging
import os
import shutil
from argparse import Namespace
from pathlib import Path

import torch

from miles.models.pipeline_files import DENOISER
from miles.utils.paths import link_or_copy

__all__ = ["FUSED_DIR", "apply_teacher_loras", "fuse_loras", "parse_teacher_lora"]

logger = logging.getLogger(__name__)

# The fused teacher pipeline's folder under --output-dir.
FUSED_DIR = "teacher_lora"
# What diffusers' save_lora_weights names its file.
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


def parse_teacher_lora(value: str) -> tuple[str, float]:
    """``PATH[:WEIGHT]`` → ``(PATH, WEIGHT)``; the weight (default 1) is what follows the last ``:`` when it reads as
    a finite number, so a path that holds a ``:`` still works.

    Raises:
        ValueError: for an empty path.
    """
    path, sep, tail = value.rpartition(":")
    weight = 1.0
    if sep:
        try:
            weight = float(tail)
        except ValueError:
            path = value
        else:
            if weight != weight or abs(weight) == float("inf"):
                raise ValueError(f"--teacher-lora {value!r}: the weight must be a finite number")
    else:
        path = value
    if not path:
        raise ValueError(f"--teacher-lora {value!r} names no path; expected PATH[:WEIGHT]")
    return path, weight


def fuse_loras(family, pipeline: str | Path, loras: list[tuple[str, float]], out: str | Path) -> Path:
    """Write ``pipeline`` to ``out`` with ``loras`` (``[(path, weight), ...]``) fused into its ``transformer/``
    (module docstring), atomically (a temporary sibling renamed into place, replacing an earlier ``out``).

    Returns:
        ``out`` as a ``Path``.

    Raises:
        ValueError: for a LoRA diffusers cannot load into the denoiser (its message names the file), or one whose
            modules the denoiser does not have (peft then targets nothing).
    """
    from miles.utils.paths import replace_dir

    pipeline, out = Path(pipeline), Path(out)
    model = family.load_denoiser(pipeline, dtype=torch.float32)
    names = []
    for index, (path, weight) in enumerate(loras):
        name = f"teacher_lora_{index}"
        file = Path(path)
        if file.is_dir() and (file / LORA_WEIGHTS).is_file():
            file = file / LORA_WEIGHTS  # diffusers looks for the .bin in a folder unless told the name
        kwargs = {"weight_name": file.name} if file.is_file() else {}
        try:
            model.load_lora_adapter(str(file.parent if file.is_file() else file), adapter_name=name, **kwargs)
        except Exception as exc:  # diffusers, peft and safetensors each raise their own kinds for a bad file
            raise ValueError(f"--teacher-lora {path}: diffusers could not load it into the teacher: {exc}") from exc
        if name not in getattr(model, "peft_config", {}):
            raise ValueError(f"--teacher-lora {path}: no module of the teacher's {DENOISER} matches its keys")
        names.append(name)
        logger.info("teacher LoRA %s at weight %g", path, weight)
    model.set_adapters(names, [weight for _, weight in loras])
    model.fuse_lora(adapter_names=names)
    model.unload_lora()
    tmp = out.parent / f".{out.name}.miles-fuse.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(
        pipeline, tmp, copy_function=link_or_copy, ignore=lambda _, files: [f for f in files if f[0] == "."]
    )
    shutil.rmtree(tmp / DENOISER)
    model.save_pretrained(tmp / DENOISER)
    replace_dir(tmp, out, out.parent / f".{out.name}.miles-fuse.stale")
    return out


def apply_teacher_loras(args: Namespace) -> Path | None:
    """``--teacher-lora``: fuse the LoRAs into the teacher (:func:`fuse_loras`, under ``<output-dir>/teacher_lora``)
    and point ``--teacher-load`` at it, and ``--hf-checkpoint`` / ``--critic-load`` where they named the teacher's
    pipeline, unless ``--teacher-lora-teacher-only``. Run by the driver before the run's specs are built.

    Returns:
        The fused pipeline, or None without ``--teacher-lora``.

    Raises:
        ValueError: for a two-expert teacher (Wan 2.2 A14B: a LoRA per expert has no stock format here), or as
            :func:`fuse_loras`.
    """
    from miles.models import get_model_family

    if not args.teacher_lora:
        return None
    teacher = os.path.realpath(args.teacher_load)
    family = get_model_family(args.teacher_load, args.diffusion_model_family)
    if family.expert_boundary(args.teacher_load) is not None:
        raise ValueError(
            f"--teacher-lora fuses into the teacher's {DENOISER}/ only, but --teacher-load {args.teacher_load} has two "
            "experts (transformer_2): fuse your LoRAs into both experts' weights yourself and pass that pipeline"
        )
    loras = [parse_teacher_lora(value) for value in args.teacher_lora]
    fused = str(fuse_loras(family, args.teacher_load, loras, Path(args.output_dir) / FUSED_DIR))
    args.teacher_load = fused
    if not args.teacher_lora_teacher_only:

        def starts_from_teacher(value) -> bool:
            return bool(value) and os.path.realpath(value) == teacher

        if starts_from_teacher(args.hf_checkpoint):
            args.hf_checkpoint = fused
        if starts_from_teacher(args.critic_load):
            args.critic_load = fused
        # a method's settings, parsed once (DMD2Settings.critic_load), carry the critic's source too
        settings = args.method_settings
        if dataclasses.is_dataclass(settings) and starts_from_teacher(getattr(settings, "critic_load", None)):
            args.method_settings = dataclasses.replace(settings, critic_load=fused)
    return Path(fused)
