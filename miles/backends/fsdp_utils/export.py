"""Write a trained denoiser as a diffusers pipeline directory, atomically (the trainer's ``--save-hf`` export).

The directory is a copy of the source pipeline (``--hf-checkpoint``) whose ``transformer/`` holds the trained
weights and whose scheduler records the student's sampling schedule; it appears at its path in one rename, so a
crash leaves either the old directory or the new one, never half of one.
"""

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from miles.backends.fsdp_utils import checkpoint
from miles.models.base import DENOISER
from miles.utils.paths import check_export_target, replace_dir
from miles.utils.validation import CheckpointWriteError

__all__ = ["write_pipeline"]


def write_pipeline(
    src: Path,
    out: Path,
    family: Any,
    state_dict: dict[str, torch.Tensor],
    schedule: dict[str, Any] | None,
    *,
    overwrite: bool,
    run_paths: list[tuple[str, str]],
) -> None:
    """Write ``src``'s pipeline with ``state_dict`` as its denoiser to ``out``.

    Hidden entries of ``src`` (a recipe's ``.miles_stage_complete.json``, ``.git``) are left out; the other files are
    hard-linked when possible (text encoders and VAE are unchanged). With ``schedule`` (keyword arguments of
    :func:`miles.models.sampling_schedule.write_sampling_schedule`) the scheduler config records the student's
    rule and σ grid, and for a family with ``stock_scheduler`` becomes that stock diffusers scheduler; with None
    (an SFT export) the source's scheduler stays as copied.

    Args:
        src: the source pipeline directory.
        out: the export directory; checked by :func:`miles.utils.paths.check_export_target` against ``run_paths``
            (``(flag, path)`` of every directory the run reads or writes) before the copy and again right before
            the rename (it may have appeared during the training).
        family: the model family (``load_denoiser``, ``stock_scheduler``, ``stock_scheduler_config``).
        state_dict: the denoiser's full float32 state dict.
        overwrite: ``--overwrite-save-hf``.

    Raises:
        ArgumentValidationError: if ``out`` may not be written (see ``check_export_target``).
        CheckpointWriteError: if the directory cannot be written (a full disk); nothing at ``out`` changed.
    """
    from miles.models.sampling_schedule import write_sampling_schedule

    check_export_target(out, src, overwrite, run_paths)
    # A name of this project's own, so that no user's directory is mistaken for a leftover.
    tmp = out.parent / f".{out.name}.miles-export.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, tmp, copy_function=_link_or_copy, ignore=_hidden)
        model = family.load_denoiser(str(src), dtype=torch.float32)
        model.load_state_dict(state_dict)
        shutil.rmtree(tmp / DENOISER)
        model.save_pretrained(tmp / DENOISER)
        if schedule is not None:
            write_sampling_schedule(
                tmp,
                **schedule,
                stock_scheduler=family.stock_scheduler,
                stock_config=family.stock_scheduler_config,
            )
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"could not export the student to {out}: {checkpoint.describe_os_error(exc, out.parent)}; "
            "nothing at that path changed"
        ) from exc
    try:
        check_export_target(out, src, overwrite, run_paths)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out, out.parent / f".{out.name}.miles-export.stale")


def _hidden(directory: str, names: list[str]) -> list[str]:
    return [name for name in names if name.startswith(".")]


def _link_or_copy(src: str, dst: str) -> str:
    # Pipelines hold GBs of text encoders and VAE that the export does not change: hard-link them when possible.
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst
