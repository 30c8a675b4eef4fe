"""Load a denoiser through its model family and shard it with FSDP2.

``fully_shard`` each transformer block, then the root (torchtitan's ``apply_fsdp``; the blocks are diffusers'
``_no_split_modules``): each block's parameters are all-gathered just for its own forward/backward, and the root
holds what is left (patch/time/text embeddings, the final norm and projection).
"""

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

__all__ = ["TRAIN_DTYPES", "resolve_dtype", "shard_model", "load_trainable_denoiser", "load_frozen_denoiser"]

logger = logging.getLogger(__name__)

TRAIN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """``--train-dtype`` name → torch dtype. Raises ValueError naming the flag on an unknown name."""
    if name not in TRAIN_DTYPES:
        raise ValueError(f"--train-dtype {name!r} is not one of {sorted(TRAIN_DTYPES)}")
    return TRAIN_DTYPES[name]


def shard_model(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, compute_dtype: torch.dtype) -> nn.Module:
    """Apply ``fully_shard`` to each block, then the root, on the 1-D data-parallel ``mesh``.

    Parameters stay float32 (the master copy the optimizer updates); with a lower ``compute_dtype`` they are
    all-gathered in that dtype for the forward and gradients are reduced in float32 (``MixedPrecisionPolicy``).

    Returns:
        The same module, now an ``FSDPModule`` whose parameters are sharded DTensors.
    """
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _load(family, path: str, mesh: DeviceMesh, device: torch.device, compute_dtype: torch.dtype) -> nn.Module:
    model = family.load_denoiser(path, dtype=torch.float32)
    # fully_shard keeps each parameter's device; moving first lets it shard straight onto the training device.
    model.to(device)
    return shard_model(model, family.blocks(model), mesh, compute_dtype)


def load_trainable_denoiser(
    family, path: str, mesh: DeviceMesh, device: torch.device, compute_dtype: torch.dtype
) -> nn.Module:
    """The trainable denoiser of pipeline ``path`` (``<path>/transformer``), sharded, in train mode, with grads."""
    model = _load(family, path, mesh, device, compute_dtype)
    model.train()
    model.requires_grad_(True)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded trainable denoiser from %s (%d parameters, sharded over %d ranks)", path, n_params, mesh.size()
    )
    return model


def load_frozen_denoiser(
    family, path: str, mesh: DeviceMesh, device: torch.device, compute_dtype: torch.dtype
) -> nn.Module:
    """A frozen denoiser (e.g. ``--teacher-load``): sharded like the trainable one, eval mode, no grads.

    Callers run it under ``torch.no_grad`` and must ``reshard()`` it afterwards: FSDP2 leaves a root unsharded after a
    forward that has no backward.
    """
    model = _load(family, path, mesh, device, compute_dtype)
    model.eval()
    model.requires_grad_(False)
    logger.info("loaded frozen denoiser from %s", path)
    return model
