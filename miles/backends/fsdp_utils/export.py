"""Write a trained denoiser as a diffusers pipeline directory, atomically (the trainer's ``--save-hf`` export).

The directory is a copy of the source pipeline (``--hf-checkpoint``) whose ``transformer/`` holds the trained
weights (the only denoiser: a two-expert source's second expert is dropped) and whose scheduler records the
student's sampling schedule; it appears at its path in one rename, so a
crash leaves either the old directory or the new one, never half of one.
"""

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from miles.backends.fsdp_utils import checkpoint
from miles.models.base import DENOISER
from miles.models.lora import ADAPTER_NAME, LoraSettings, adapter_parameters, add_lora_adapter, merge_lora
from miles.utils.paths import KEEP_BEST_FILE, LORA_EXPORT_DIR, check_export_target, link_or_copy, replace_dir
from miles.utils.validation import CheckpointWriteError

__all__ = ["LORA_DIR", "write_pipeline"]

# The adapter's subdirectory of a --save-hf-lora export; an earlier export's is replaced with the pipeline.
LORA_DIR = LORA_EXPORT_DIR


def write_pipeline(
    src: Path,
    out: Path,
    family: Any,
    state_dict: dict[str, torch.Tensor],
    schedule: dict[str, Any] | None,
    *,
    overwrite: bool,
    run_paths: list[tuple[str, str]],
    lora: LoraSettings | None = None,
    save_lora: bool = False,
    keep_best: dict[str, Any] | None = None,
    name: str = "--save-hf",
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
        family: the model family (``load_denoiser``, ``stock_scheduler``, ``stock_scheduler_config``,
            ``write_one_denoiser_index``).
        state_dict: the denoiser's full float32 state dict; with ``lora``, that of the LoRA model (only its adapter
            entries are read: the base is ``src``'s own float32 weights, which training left frozen).
        overwrite: ``--overwrite-save-hf``.
        lora: the student's LoRA (``--lora-rank``): ``transformer/`` then holds the merged weights
            ``W + (alpha / r)·B·A`` (:func:`miles.models.lora.merge_lora`), which stock diffusers loads as today.
        save_lora: ``--save-hf-lora``: also write the adapter alone to ``<out>/lora/`` in diffusers' LoRA format
            (``pytorch_lora_weights.safetensors``, keys ``transformer.<module>.lora_A.weight`` and the adapter config
            as metadata), which ``pipe.load_lora_weights(out / "lora")`` loads on the base pipeline.
        keep_best: ``--keep-best``'s record of this export (the figure, its value, the rollout), written into it as
            ``keep_best.json`` so that it is renamed into place with the pipeline.
        name: what the messages call the export (``--keep-best``'s export).

    Raises:
        ArgumentValidationError: if ``out`` may not be written (see ``check_export_target``).
        CheckpointWriteError: if the directory cannot be written (a full disk); nothing at ``out`` changed.
    """
    from miles.models.sampling_schedule import write_sampling_schedule

    check_export_target(out, src, overwrite, run_paths, name=name)
    # A name of this project's own, so that no user's directory is mistaken for a leftover.
    tmp = out.parent / f".{out.name}.miles-export.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, tmp, copy_function=link_or_copy, ignore=_hidden)
        model = family.load_denoiser(str(src), dtype=torch.float32)
        if lora is None:
            model.load_state_dict(state_dict)
        else:
            _load_adapter(model, lora, state_dict)
            if save_lora:
                _write_adapter(model, tmp / LORA_DIR)
            merge_lora(model)
        shutil.rmtree(tmp / DENOISER)
        model.save_pretrained(tmp / DENOISER)
        # one trained network: a two-expert source's second expert goes (WanFamily.write_one_denoiser_index)
        family.write_one_denoiser_index(tmp)
        if schedule is not None:
            write_sampling_schedule(
                tmp,
                **schedule,
                stock_scheduler=family.stock_scheduler,
                stock_config=family.stock_scheduler_config,
            )
        if keep_best is not None:
            (tmp / KEEP_BEST_FILE).write_text(json.dumps(keep_best, indent=2) + "\n")
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"could not export the student to {out}: {checkpoint.describe_os_error(exc, out.parent)}; "
            "nothing at that path changed"
        ) from exc
    try:
        check_export_target(out, src, overwrite, run_paths, name=name)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out, out.parent / f".{out.name}.miles-export.stale")


def _load_adapter(model: torch.nn.Module, lora: LoraSettings, state_dict: dict[str, torch.Tensor]) -> None:
    """Add the student's adapter to ``model`` (the source's float32 denoiser) and load its trained entries."""
    add_lora_adapter(
        model, ADAPTER_NAME, lora.rank, alpha=lora.alpha, target_modules=lora.target_modules, dropout=lora.dropout
    )
    adapter = {key: value for key, value in state_dict.items() if f".{ADAPTER_NAME}." in key}
    expected = {name for name, _ in adapter_parameters(model, ADAPTER_NAME)}
    if set(adapter) != expected:
        raise ValueError(
            f"the trained LoRA state has {len(adapter)} adapter entries, the export's adapter {len(expected)}; "
            "the --lora-* flags differ from the training's"
        )
    model.load_state_dict(adapter, strict=False)


def _write_adapter(model: torch.nn.Module, out: Path) -> None:
    """The adapter alone in diffusers' LoRA format: peft's state dict without the adapter name, under the
    ``transformer.`` prefix, with the ``LoraConfig`` as safetensors metadata (so alpha ≠ rank loads right)."""
    from diffusers.loaders import SD3LoraLoaderMixin
    from peft.utils import get_peft_model_state_dict

    layers = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    metadata = model.peft_config[ADAPTER_NAME].to_dict()
    # Every DiT pipeline's loader reads this transformer-only layout; SD3's writer is one of them.
    SD3LoraLoaderMixin.save_lora_weights(
        out, transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata
    )


def _hidden(directory: str, names: list[str]) -> list[str]:
    return [name for name in names if name.startswith(".")]
