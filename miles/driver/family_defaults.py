"""Defaults a model family gives flags the user left unset: the flow shifts and the negative prompt.

``--diffusion-flow-shift`` (the student's sampling grid) and ``--fsdp-flow-shift`` (the trainer's 1000-point grid:
SFT noise levels, DMD2 scoring) default to the student pipeline's ``ModelFamily.flow_shift`` (the shift its stock
pipeline samples with at its resolution: ``e^mu`` for Qwen-Image and FLUX.1-dev at their token count, the
scheduler config's ``shift`` for SD3), and to :data:`DEFAULT_FLOW_SHIFT` where the family has none (``digits``) or
the pipeline cannot be read here (a ``--dry-run`` for a cluster's paths; preflight names an unreadable pipeline of a
real run). Where each value came from is kept in ``args.flow_shift_origin`` for the dry run's plan.

``--negative-prompt`` defaults to the student pipeline's ``ModelFamily.stock_negative_prompt``, the one its stock
pipeline runs CFG against when the caller gives none (``""``; Qwen-Image's model card ``" "``); where it came from is
kept in ``args.negative_prompt_origin`` (the dry run's plan, the log line of the rank that encodes it).
"""

import argparse

__all__ = ["DEFAULT_FLOW_SHIFT", "fill_flow_shifts", "fill_negative_prompt"]

DEFAULT_FLOW_SHIFT = 3.0


def _family_shift(args: argparse.Namespace, num_steps: int | None) -> tuple[float, str]:
    """``(shift, where it came from)`` for an unset flag (``num_steps``: the step count it samples with, if any)."""
    from miles.models import get_model_family

    path = args.hf_checkpoint
    try:
        family = get_model_family(path, args.diffusion_model_family)
        shift = family.flow_shift(path, num_steps=num_steps)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return DEFAULT_FLOW_SHIFT, f"the default (the pipeline {path} could not be read here: {exc})"
    if shift is None:
        return DEFAULT_FLOW_SHIFT, f"the default (the {family.name} family has no flow shift of its own)"
    where = f"its stock pipeline's shift at {path}'s resolution"
    # FLUX.2-klein's shift also depends on the step count (compute_empirical_mu): the student's grid and the
    # trainer's 1000-point grid then get two values, and each line says which step count made it.
    other = family.flow_shift(path, num_steps=None if num_steps else args.diffusion_num_steps)
    if other is not None and float(other) != float(shift):
        if num_steps:
            where += f" for the student's {num_steps} steps; the shift depends on the step count"
        else:
            where += " for the stock call's default step count, the teacher's; the student's grid takes its own"
    return float(shift), f"the {family.name} family's ({where})"


def _shift(args: argparse.Namespace, value: float | None, num_steps: int | None) -> tuple[float, str]:
    """A flow-shift flag's value and the dry run's line on it: as set, or the family's for ``num_steps``."""
    if value is not None:
        return value, f"{value:g}: set on the command line"
    shift, source = _family_shift(args, num_steps)
    return shift, f"{shift:g}: {source}"


def fill_flow_shifts(args: argparse.Namespace) -> None:
    """Set each unset flow-shift flag to the family's shift (module docstring), in place, and record
    ``args.flow_shift_origin``: ``{"--diffusion-flow-shift": "3 (the default ...)", ...}``."""
    args.diffusion_flow_shift, engine = _shift(args, args.diffusion_flow_shift, args.diffusion_num_steps)
    args.fsdp_flow_shift, trainer = _shift(args, args.fsdp_flow_shift, None)
    args.flow_shift_origin = {"--diffusion-flow-shift": engine, "--fsdp-flow-shift": trainer}


def fill_negative_prompt(args: argparse.Namespace) -> None:
    """Set an unset ``--negative-prompt`` to the student pipeline's family's stock negative prompt (``""`` where the
    pipeline cannot be read here), in place, and record ``args.negative_prompt_origin``."""
    if args.negative_prompt is not None:
        args.negative_prompt_origin = "set on the command line"
        return
    from miles.models import get_model_family

    path = args.hf_checkpoint
    try:
        family = get_model_family(path, args.diffusion_model_family)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        args.negative_prompt = ""
        args.negative_prompt_origin = f"the default (the pipeline {path} could not be read here: {exc})"
        return
    args.negative_prompt = family.stock_negative_prompt
    args.negative_prompt_origin = f"the {family.name} family's (its stock pipeline's default)"
