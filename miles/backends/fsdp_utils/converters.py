"""Model converters: changes to a trainable module made after it loads and before it is sharded.

The seam is torchtitan's ``ModelConverter`` (``components/quantization``, ``components/lora``): a converter rewrites
or wraps a module before ``fully_shard`` (LoRA adapters, low-precision layers, activation checkpointing) and says
which of the module's state a checkpoint keeps. A converter may freeze parameters (``requires_grad_(False)``): the
optimizer, the EMA, the gradient clip and the checkpoint see only the parameters left trainable.

A group's converters come from its spec (:func:`build_converters`): gradient checkpointing and LoRA.
"""

from typing import Protocol

import torch
from torch import nn

from miles.config import GroupSpec
from miles.models.base import DENOISER
from miles.models.lora import ADAPTER_NAME, LoraSettings, adapter_parameters, add_lora_adapter
from miles.models.precision import cast_to_compute_dtype, resolve_dtype

__all__ = [
    "GradientCheckpointing",
    "LoraAdapter",
    "ModelConverter",
    "build_converters",
    "keeps_in_checkpoint",
    "lora_converter",
]


class ModelConverter(Protocol):
    """One change applied to a group's trainable modules before sharding."""

    def convert(self, name: str, module: nn.Module) -> None:
        """Change ``module`` (the trainable component ``name``: the denoiser ``"transformer"``, or a module a method
        built) in place, before it is moved to the device and sharded."""

    def keeps_in_checkpoint(self, key: str) -> bool:
        """Whether a checkpoint holds the state entry ``key`` (``"<component>.<parameter name>"``); a converter that
        freezes a base it can reload from ``--hf-checkpoint`` leaves the base out."""


class GradientCheckpointing:
    """``--gradient-checkpointing``: diffusers' per-block activation checkpointing of the denoiser
    (``torch.utils.checkpoint``, non-reentrant), set before sharding so the recomputation runs inside each block's
    FSDP unit (torchtitan applies activation checkpointing before ``fully_shard`` too)."""

    def __init__(self, component: str = DENOISER) -> None:
        self.component = component

    def convert(self, name: str, module: nn.Module) -> None:
        if name == self.component:
            module.enable_gradient_checkpointing()

    def keeps_in_checkpoint(self, key: str) -> bool:
        return True


class LoraAdapter:
    """``--lora-rank`` (``--critic-lora-rank`` for the critic): a peft LoRA adapter on the denoiser, added through
    diffusers' adapter API before sharding (torchtitan's ``components/lora`` converter does the same).

    The base weights are frozen and cast to the compute dtype (nothing updates them, so they need no float32 master
    copy), except those the model keeps in float32 (``_keep_in_fp32_modules``, :mod:`miles.models.precision`); the
    adapter's ``lora_A`` / ``lora_B`` stay float32 and are all the optimizer, the EMA and the gradient clip
    see. A checkpoint keeps only the adapter of the denoiser (and every other trainable module, e.g. the GAN head):
    the base reloads from ``--hf-checkpoint``.

    Args:
        settings: rank, alpha, target modules, dropout.
        compute_dtype: the dtype of the frozen base (``--train-dtype``).
    """

    def __init__(self, settings: LoraSettings, compute_dtype: torch.dtype, component: str = DENOISER) -> None:
        self.settings, self.compute_dtype, self.component = settings, compute_dtype, component

    def convert(self, name: str, module: nn.Module) -> None:
        if name != self.component:
            return
        # What from_pretrained(torch_dtype=...) gives: the modules the model keeps in float32 (Wan's time embedder,
        # norms and modulation tables) stay float32, as in the teacher the base also serves as.
        cast_to_compute_dtype(module, self.compute_dtype)
        add_lora_adapter(
            module,
            ADAPTER_NAME,
            self.settings.rank,
            alpha=self.settings.alpha,
            target_modules=self.settings.target_modules,
            dropout=self.settings.dropout,
            adapter_device="cpu",  # real initial values on a base still on the meta device
        )
        for _, param in adapter_parameters(module, ADAPTER_NAME):
            param.data = param.data.float()

    def keeps_in_checkpoint(self, key: str) -> bool:
        if not key.startswith(self.component + "."):
            return True
        return f".{ADAPTER_NAME}." in key


def build_converters(spec: GroupSpec) -> list[ModelConverter]:
    """The converters a group's spec asks for, in the order they apply: LoRA first (gradient checkpointing then
    wraps the blocks that hold the adapters)."""
    converters: list[ModelConverter] = []
    if spec.lora is not None:
        converters.append(LoraAdapter(spec.lora, resolve_dtype(spec.dtype)))
    if spec.gradient_checkpointing:
        converters.append(GradientCheckpointing())
    return converters


def lora_converter(converters: list[ModelConverter]) -> LoraAdapter | None:
    """The group's LoRA converter, if it has one."""
    return next((converter for converter in converters if isinstance(converter, LoraAdapter)), None)


def keeps_in_checkpoint(converters: list[ModelConverter], key: str) -> bool:
    """Whether every converter lets a checkpoint keep ``key``."""
    return all(converter.keeps_in_checkpoint(key) for converter in converters)
