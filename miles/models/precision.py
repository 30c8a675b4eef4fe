"""Mixed precision rules every denoiser follows, whoever runs it, so that one set of weights computes one function.

A denoiser runs in a low ``--train-dtype`` (bf16, fp16) in three ways:

* sharded over more than one DP rank: float32 master weights, all-gathered in the compute dtype by FSDP2's
  ``MixedPrecisionPolicy`` (:func:`miles.backends.fsdp_utils.model.shard_model`);
* unsharded (one DP rank): float32 weights under ``torch.autocast`` to the compute dtype;
* frozen (the teacher, a LoRA critic's base, an engine replica): stored in the compute dtype.

They compute the same function because each of them follows the same three rules (up to one difference that
autocast makes, :mod:`miles.backends.fsdp_utils.model`):

1. **Inputs.** The family casts the latents and the conditioning to the compute dtype (:func:`forward_dtype`); the
   timestep stays float32, as diffusers' pipelines pass it (bf16 would round a timestep of 937.5 to 936 and 750 to
   752). FSDP2's own input cast (``cast_forward_inputs``) is off for a denoiser for that reason.
2. **Modules a model keeps in float32.** A diffusers model class names them in ``_keep_in_fp32_modules`` (Wan:
   ``time_embedder``, ``scale_shift_table``, ``norm1``-``norm3``, ``rope``); a parameter or buffer is kept when one
   of those names is a component of its dotted name, diffusers' own rule in ``from_pretrained``. They are stored in
   float32 (:func:`cast_to_compute_dtype`, and diffusers' ``from_pretrained(torch_dtype=...)``), all-gathered in
   float32 (an FSDP unit of their own with a float32 policy) and computed in float32 (``torch.autocast`` is off
   inside them: :func:`exempt_from_autocast`).
3. **Buffers.** A floating buffer that is not kept is stored in the compute dtype, as ``from_pretrained`` stores a
   model loaded in that dtype (SD3's ``pos_embed``); the trainable float32 model's buffers too
   (:func:`cast_buffers`), since they are constants that FSDP2 never casts.

In float32 nothing here changes anything.
"""

import functools
import itertools
from collections.abc import Iterator

import torch
from torch import nn

__all__ = [
    "TRAIN_DTYPES",
    "cast_buffers",
    "cast_to_compute_dtype",
    "exempt_from_autocast",
    "forward_device_dtype",
    "forward_dtype",
    "keep_fp32_names",
    "kept_modules",
    "keeps_fp32",
    "resolve_dtype",
    "set_compute_dtype",
]

TRAIN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The compute dtype a sharded model's parameters are all-gathered in (its float32 master weights do not say it).
_COMPUTE_DTYPE = "_miles_compute_dtype"


def resolve_dtype(name: str) -> torch.dtype:
    """``--train-dtype`` name → torch dtype. Raises ValueError naming the flag on an unknown name."""
    if name not in TRAIN_DTYPES:
        raise ValueError(f"--train-dtype {name!r} is not one of {sorted(TRAIN_DTYPES)}")
    return TRAIN_DTYPES[name]


def _model(module: nn.Module) -> nn.Module:
    # A LoRA model's base seen as a model of its own (miles.models.lora.AdaptersDisabled) holds the model aside.
    return module.__dict__.get("lora_model", module)


def keep_fp32_names(model: nn.Module) -> tuple[str, ...]:
    """The model class's ``_keep_in_fp32_modules`` (diffusers' ``ModelMixin`` attribute), ``()`` for none."""
    return tuple(getattr(_model(model), "_keep_in_fp32_modules", None) or ())


def keeps_fp32(name: str, names: tuple[str, ...]) -> bool:
    """Whether the parameter, buffer or module of dotted ``name`` is kept in float32: one of ``names`` is a component
    of it (diffusers' rule: ``blocks.0.norm2.weight`` is kept for ``norm2``, ``blocks.0.norm2x.weight`` is not)."""
    return any(part in names for part in name.split("."))


def kept_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of ``model`` whose own name is one of its :func:`keep_fp32_names`, as ``(dotted
    name, module)`` in ``named_modules`` order (a kept module inside another is covered by it)."""
    names = keep_fp32_names(model)
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and name.split(".")[-1] in names and not any(name.startswith(outer + ".") for outer, _ in found):
            found.append((name, module))
    return found


def _floating(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    return ((name, tensor) for name, tensor in tensors if tensor.is_floating_point())


@torch.no_grad()
def cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every floating buffer of ``model`` that is not kept in float32 in ``dtype`` (rule 3 of the module
    docstring), in place; kept buffers become float32."""
    names = keep_fp32_names(model)
    for name, buffer in _floating(model.named_buffers()):
        owner, _, attr = name.rpartition(".")
        target = torch.float32 if keeps_fp32(name, names) else dtype
        if buffer.dtype != target:
            model.get_submodule(owner)._buffers[attr] = buffer.to(target)


@torch.no_grad()
def cast_to_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Store ``model``'s floating parameters and buffers in ``dtype``, those it keeps in float32 (rule 2) in float32,
    in place: what ``from_pretrained(torch_dtype=dtype)`` gives. A frozen base (LoRA) uses it; parameters keep their
    identity (``param.data`` changes), so a module that holds them sees the cast."""
    names = keep_fp32_names(model)
    for name, param in _floating(model.named_parameters()):
        target = torch.float32 if keeps_fp32(name, names) else dtype
        if param.dtype != target:
            param.data = param.data.to(target)
    cast_buffers(model, dtype)


def set_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Record the dtype a sharded ``model``'s parameters are all-gathered in (None: their own dtype), for
    :func:`forward_dtype`; :func:`miles.backends.fsdp_utils.model.shard_model` calls it."""
    setattr(model, _COMPUTE_DTYPE, dtype)


def _autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled`` for a device type autocast may not know (``meta`` raises): False there."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def forward_dtype(denoiser: nn.Module) -> torch.dtype:
    """The dtype a family casts ``denoiser``'s latents and conditioning to before its forward (rule 1; never the
    timestep, which stays float32): the autocast dtype inside ``torch.autocast`` on the parameters' device, else the
    dtype a sharded model's parameters are all-gathered in, else that of its first floating parameter that is not
    kept in float32 (diffusers' ``ModelMixin.dtype``).

    Raises:
        ValueError: for a model without floating parameters.
    """
    model = _model(denoiser)
    params = _floating(model.named_parameters())
    first = next(params, None)
    if first is None:
        raise ValueError(f"{type(model).__name__} has no floating parameters to take a compute dtype from")
    device_type = first[1].device.type
    if _autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    recorded = getattr(model, _COMPUTE_DTYPE, None)
    if recorded is not None:
        return recorded
    names = keep_fp32_names(model)
    return next(
        (param.dtype for name, param in itertools.chain([first], params) if not keeps_fp32(name, names)),
        first[1].dtype,
    )


def forward_device_dtype(denoiser: nn.Module) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` of ``denoiser``'s floating forward inputs: its parameters' device and
    :func:`forward_dtype`. Every family's ``predict_velocity`` casts its latents and conditioning with it."""
    return next(denoiser.parameters()).device, forward_dtype(denoiser)


def _autocast_off(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        device_type = tensors[0].device.type if tensors else "cpu"
        if not torch.is_autocast_enabled(device_type):
            return forward(*args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return forward(*args, **kwargs)

    run._miles_autocast_off = True
    return run


def exempt_from_autocast(model: nn.Module) -> None:
    """Run every module ``model`` keeps in float32 (:func:`kept_modules`) with ``torch.autocast`` off, so that an
    unsharded float32 model under autocast computes them in float32 as a sharded or frozen one does (rule 2).
    diffusers casts their inputs itself (Wan's time embedding to ``time_embedder``'s dtype; ``FP32LayerNorm``).
    Idempotent; outside autocast the modules run unchanged."""
    for _, module in kept_modules(model):
        if not getattr(module.forward, "_miles_autocast_off", False):
            module.forward = _autocast_off(module.forward)
