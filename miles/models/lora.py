"""LoRA adapters on a diffusers denoiser through ``peft``: the default target modules and one way to add an adapter.

The trainer's LoRA converter and the memory planner (:mod:`miles.driver.memory_plan`) both add adapters through
:func:`add_lora_adapter`, so the planner counts exactly the parameters a run trains.
"""

import torch
from torch import nn

__all__ = ["DEFAULT_LORA_TARGET_MODULES", "add_lora_adapter", "adapter_parameters"]

# Module-name suffixes peft matches (``name == target`` or ``name.endswith("." + target)``): the attention
# projections of both token streams and the MLP projections of the diffusers DiTs. Modules a model lacks are skipped.
DEFAULT_LORA_TARGET_MODULES = (
    # attention: image stream, then the text stream of MMDiT blocks (SD3, FLUX, FLUX.2, Qwen-Image)
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    # GELU MLPs: ff / ff_context (SD3, FLUX), img_mlp / txt_mlp (Qwen-Image)
    "net.0.proj",
    "net.2",
    # FLUX single-stream blocks' MLP input
    "proj_mlp",
    # FLUX.2: SwiGLU MLPs, and the single-stream blocks' fused QKV + MLP input
    "linear_in",
    "linear_out",
    "to_qkv_mlp_proj",
)
# Not targeted: FLUX's single-block ``proj_out`` and FLUX.2's single-block ``attn.to_out`` share their suffixes with
# modules that are no single Linear elsewhere (the final ``proj_out``, SD3's ``attn.to_out`` ModuleList).


def add_lora_adapter(
    model: nn.Module,
    adapter_name: str,
    rank: int,
    *,
    alpha: float | None = None,
    target_modules: tuple[str, ...] | list[str] = DEFAULT_LORA_TARGET_MODULES,
    dropout: float = 0.0,
) -> nn.Module:
    """Add a LoRA adapter named ``adapter_name`` to a diffusers model (``ModelMixin.add_adapter`` with a
    ``peft.LoraConfig``); peft freezes the base weights, the adapter's ``lora_A`` / ``lora_B`` require grad.

    Works on a model on the meta device: the adapter's tensors are then created on the meta device too (no memory).

    Args:
        rank: the LoRA rank r (> 0).
        alpha: ``lora_alpha`` (the update is scaled by alpha / r); None means r (scale 1).
        target_modules: module-name suffixes (see :data:`DEFAULT_LORA_TARGET_MODULES`).
        dropout: ``lora_dropout``.

    Returns:
        ``model``, now with the adapter.

    Raises:
        ValueError: if ``rank`` is not positive or no module of the model matches ``target_modules``.
    """
    from peft import LoraConfig

    if rank <= 0:
        raise ValueError(f"LoRA rank must be > 0, got {rank}")
    targets = list(target_modules)
    config = LoraConfig(
        r=rank, lora_alpha=rank if alpha is None else alpha, target_modules=targets, lora_dropout=dropout
    )
    # Checked here: a failed peft injection leaves a diffusers model half-configured for adapters.
    if not any(name == t or name.endswith("." + t) for name, _ in model.named_modules() for t in targets):
        raise ValueError(f"no module of {type(model).__name__} matches the LoRA target modules {targets}")
    # New adapter tensors go where the base weights are (the meta device stays weightless).
    with torch.device(next(model.parameters()).device):
        model.add_adapter(config, adapter_name=adapter_name)
    return model


def adapter_parameters(model: nn.Module, adapter_name: str) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of one adapter's LoRA weights (peft names them ``...lora_A.<adapter>.weight``)."""
    return [(name, param) for name, param in model.named_parameters() if f".{adapter_name}." in f".{name}."]
