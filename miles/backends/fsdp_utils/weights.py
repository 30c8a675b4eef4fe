"""Give a model built on the meta device its memory and its weights, each rank reading only its own shards.

:func:`miles.backends.fsdp_utils.model.load_trainable_denoiser` builds a denoiser on the meta device, converts and
shards it, then calls :func:`load_weights` (torchtitan's and torchtune's order: meta, parallelise, ``to_empty``,
load). A sharded parameter is FSDP2's ``Shard(0)`` DTensor: the rank holds rows ``[r·c, r·c + n)`` of dim 0 (chunks
of ``c = ⌈d0 / world⌉`` rows, as ``torch.chunk`` cuts them), and reads exactly those rows with safetensors'
``get_slice``, straight into its shard. So no process ever holds a tensor it does not keep: a rank's host memory
at start-up is its shards (on the CPU) plus one tensor's rows in flight, and a GPU holds the rank's shards only.

Tensors that are real before :func:`load_weights` and that no file holds keep their values: a LoRA adapter's
initial weights (created on the CPU by the converter), buffers a module computes at construction (a rotary table),
a tensor a converter made. Every other tensor must be in the files.
"""

import logging
import re
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from miles.models.base import denoiser_weight_index

__all__ = ["checkpoint_names", "load_weights", "local_rows"]

logger = logging.getLogger(__name__)


def checkpoint_names(model: nn.Module) -> dict[nn.Module, str]:
    """Each module of ``model`` → its qualified name, taken before a converter wraps layers: the names the weight
    files use. A converter that wraps a module keeps the module object (peft's LoRA layer holds it as
    ``base_layer``), so :func:`load_weights` finds a file's tensor through its module, whatever its new name."""
    return {module: name for name, module in model.named_modules()}


def _state_entries(model: nn.Module) -> list[tuple[str, nn.Module, str, bool]]:
    """``(name, owning module, local name, in the state dict)`` of every parameter and buffer. A tensor two modules
    share appears under both names (``to_empty`` unties them; the second then finds no value in the files)."""
    entries = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for local, param in module._parameters.items():
            if param is not None:
                entries.append((prefix + local, module, local, True))
        for local, buffer in module._buffers.items():
            if buffer is not None:
                entries.append((prefix + local, module, local, local not in module._non_persistent_buffers_set))
    return entries


def _tensor(module: nn.Module, local: str) -> torch.Tensor:
    return module._parameters[local] if local in module._parameters else module._buffers[local]


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, slice | None]:
    """This rank's part of ``tensor`` and the dim-0 rows of the full tensor it holds.

    Returns:
        ``(local, rows)``: a plain tensor or a replicated DTensor is all local (``rows`` None); a DTensor sharded
        ``Shard(0)`` on a 1-D mesh (FSDP2's layout) gives its local shard and ``slice(start, stop)``, empty for a rank
        past the last row.

    Raises:
        NotImplementedError: for any other placement.
    """
    if not isinstance(tensor, DTensor):
        return tensor, None
    local, placements = tensor.to_local(), tensor.placements
    if all(isinstance(placement, Replicate) for placement in placements):
        return local, None
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise NotImplementedError(f"cannot read a tensor placed as {placements} from a file (only Shard(0) on 1-D)")
    mesh = tensor.device_mesh
    rows = tensor.shape[0]
    chunk = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    stop = start + local.shape[0]
    # FSDP2 cuts dim 0 as torch.chunk does (fully_shard's _chunk_with_empty); anything else would mis-place rows.
    assert stop == min(
        start + chunk, rows
    ), f"shard of {local.shape[0]} rows at {start} of {rows} is not torch.chunk's"
    return local, slice(start, stop)


def _read_into(target: torch.Tensor, file: Path, key: str) -> None:
    """Copy the rows of tensor ``key`` of ``file`` that this rank holds into ``target`` (cast to its dtype)."""
    from safetensors import safe_open

    local, rows = local_rows(target)
    # One open per tensor: safetensors maps the whole file, and every page a read touches stays in this process's
    # RSS until the file is closed (a rank reading half of each tensor through one open touched the whole file).
    with safe_open(file, framework="pt", device="cpu") as f:
        stored = f.get_slice(key)
        shape = tuple(stored.get_shape())
        if shape != tuple(target.shape):
            raise ValueError(f"{file}: tensor {key!r} has shape {shape}, the model's is {tuple(target.shape)}")
        if local.numel() == 0:
            return
        values = f.get_tensor(key) if rows is None else stored[rows]
        # Cast on the host, then one copy to the device: no device buffer of the file's dtype.
        local.copy_(values.to(local.dtype))


def load_weights(
    model: nn.Module,
    files: list[Path],
    device: torch.device,
    names: dict[nn.Module, str],
    ignore_unexpected: list[str] | tuple[str, ...] = (),
) -> None:
    """Give every parameter and buffer of ``model`` memory on ``device`` and its value: from the safetensors
    ``files`` when they hold it (this rank's rows only, cast to the tensor's dtype), else the value it has now.

    The model may be sharded (``fully_shard`` on the meta device) or plain (a group of one, unwrapped: then this is
    where the whole model comes to its device, one tensor at a time).

    Args:
        names: :func:`checkpoint_names` of the model before its converters ran.
        ignore_unexpected: regular expressions of file tensors the model may lack without a warning (diffusers'
            ``_keys_to_ignore_on_load_unexpected``).

    Raises:
        RuntimeError: for a tensor on the meta device that no file holds (checked before anything is allocated).
        ValueError: for a file tensor whose shape differs from the model's.
    """
    index = denoiser_weight_index(files)
    entries = _state_entries(model)
    from_file: dict[str, str] = {}
    for name, module, local, in_state in entries:
        owner = names.get(module)
        key = None if owner is None else (f"{owner}.{local}" if owner else local)
        if in_state and key in index:
            from_file[name] = key
    missing = [name for name, module, local, _ in entries if _tensor(module, local).is_meta and name not in from_file]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise RuntimeError(f"{files[0].parent}: the weight files hold no value for {shown}")
    unexpected = sorted(set(index) - set(from_file.values()))
    unexpected = [key for key in unexpected if not any(re.search(pattern, key) for pattern in ignore_unexpected)]
    if unexpected:
        logger.warning("%s: weights the model has no place for, not loaded: %s", files[0].parent, unexpected)
    # Aliases of the values to keep: to_empty gives every tensor new storage, these hold the old one.
    kept = {name: _tensor(module, local).detach() for name, module, local, _ in entries if name not in from_file}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, module, local, _ in entries:
            target = _tensor(module, local)
            if name in from_file:
                _read_into(target, index[from_file[name]], from_file[name])
            else:
                target.copy_(kept.pop(name))
