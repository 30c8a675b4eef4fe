"""Model converters: changes to a trainable module made after it loads and before it is sharded.

The seam is torchtitan's ``ModelConverter`` (``components/quantization``, ``components/lora``): a converter rewrites
or wraps a module before ``fully_shard`` (LoRA adapters, low-precision layers, activation checkpointing) and says
which of the module's state a checkpoint keeps. A converter may freeze parameters (``requires_grad_(False)``): the
optimizer, the EMA, the gradient clip and the checkpoint see only the parameters left trainable.

A group's converters come from its args (:func:`build_converters`); gradient checkpointing is the built-in one.
"""

from typing import Protocol

from torch import nn

from miles.models.base import DENOISER

__all__ = ["GradientCheckpointing", "ModelConverter", "build_converters", "keeps_in_checkpoint"]


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


def build_converters(args) -> list[ModelConverter]:
    """The converters a group's args ask for, in the order they apply."""
    return [GradientCheckpointing()] if args.gradient_checkpointing else []


def keeps_in_checkpoint(converters: list[ModelConverter], key: str) -> bool:
    """Whether every converter lets a checkpoint keep ``key``."""
    return all(converter.keeps_in_checkpoint(key) for converter in converters)
