"""Load a denoiser through its model family and shard it with FSDP2.

Start-up order (torchtitan's and torchtune's): the family builds the denoiser on the meta device
(``ModelFamily.build_meta_denoiser``), its converters (:mod:`miles.backends.fsdp_utils.converters`: LoRA, activation
checkpointing) change it, ``fully_shard`` shards it, and only then does each rank get memory for its own shards and
read its rows of each tensor from the safetensors files (:mod:`miles.backends.fsdp_utils.weights`). No process ever
holds a whole model it does not keep: a rank's host memory at start-up is one tensor's rows in flight, its GPU its
shards. A group of one is not wrapped and reads the whole model onto its device, tensor by tensor.

With one DP rank the module is not wrapped at all, as torchtitan does with ``dp_shard = 1``: sharding over one rank
only adds copies and hooks (a digits step measured 1.7× slower wrapped). Mixed precision then comes from
``torch.autocast`` instead of FSDP's ``MixedPrecisionPolicy`` (torchtitan's ``maybe_enable_amp``). Both follow the
rules of :mod:`miles.models.precision` (the timestep stays float32, ``_keep_in_fp32_modules``, buffers), so they
compute the same function, with one difference: autocast runs the matmuls in bf16 from the float32 weights but leaves
a parameter used outside a matmul (a norm's weight: SD3.5's and Wan's q/k RMSNorm) in float32, where FSDP2 gathers it
in bf16. A model without such parameters (SD3, FLUX.1) is bit-identical at 1 and N ranks; the tiny Wan with random
weights differs by 0.5 % of the velocity, bf16 rounding.

Two sharding modes (``--fsdp-reshard-every-microbatch``):

* default, ZeRO-2-like: the model is one FSDP unit (``fully_shard`` of the root) whose parameters stay gathered from
  the first forward of a phase (a no-grad pass, or an optimizer window of micro-batches) until the trainer reshards
  it at the phase's end; a window reduce-scatters its gradients once, after its last micro-batch
  (:func:`window_sync`). One all-gather and one reduce-scatter per optimizer step: on two CPU ranks over gloo a
  window of 5 micro-batches measured 2.3× faster than FSDP2's default below.
* ``--fsdp-reshard-every-microbatch``, ZeRO-3: ``fully_shard`` each transformer block, then the root (torchtitan's
  ``apply_fsdp``; the blocks are diffusers' ``_no_split_modules``); each block's parameters are gathered just for
  its own forward and backward and gradients are reduce-scattered every micro-batch. The peak holds one block's
  full parameters instead of the model's, at three times the collectives.
"""

import contextlib
import logging
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from miles.backends.fsdp_utils.converters import ModelConverter
from miles.backends.fsdp_utils.weights import checkpoint_names, load_weights
from miles.models.base import DENOISER, SECOND_EXPERT
from miles.models.experts import ExpertSwitch
from miles.models.precision import (
    TRAIN_DTYPES,
    cast_buffers,
    exempt_from_autocast,
    keep_fp32_names,
    kept_modules,
    resolve_dtype,
    set_compute_dtype,
)

__all__ = [
    "TRAIN_DTYPES",
    "compute_context",
    "is_sharded",
    "load_frozen_denoiser",
    "load_trainable_denoiser",
    "reshard",
    "resolve_dtype",
    "shard_model",
    "window_sync",
]

logger = logging.getLogger(__name__)


def is_sharded(model: nn.Module) -> bool:
    """True for a ``fully_shard``-ed module."""
    return isinstance(model, FSDPModule)


def shard_model(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    compute_dtype: torch.dtype | None,
    reshard_after_forward: bool = True,
    cast_forward_inputs: bool = False,
) -> nn.Module:
    """Apply ``fully_shard`` to each block, then the root, on the 1-D data-parallel ``mesh``; the modules the model
    keeps in float32 (``_keep_in_fp32_modules``, :mod:`miles.models.precision`) get units of their own with a float32
    policy first.

    A unit all-gathers its parameters in one dtype and reduce-scatters gradients of one dtype, so a module kept in
    float32 (Wan's ``time_embedder``, ``norm2``) is a unit of its own, and a module that directly holds a kept
    parameter (Wan's blocks and root hold ``scale_shift_table``) becomes a float32 unit whose children are units of
    the compute dtype. Without a low compute dtype (None, float32) there is nothing to keep and no extra unit.

    Args:
        compute_dtype: the dtype parameters are all-gathered in for the forward (``MixedPrecisionPolicy``), with
            gradients reduced in float32; None keeps the parameters' own dtype (a frozen model already stored in
            the compute dtype, its kept modules in float32).
        reshard_after_forward: free the gathered parameters after each forward (FSDP2's default); False keeps them
            until :func:`reshard` or the end of a backward.
        cast_forward_inputs: FSDP2's cast of the floating forward inputs to ``compute_dtype``. Off for a denoiser:
            its family casts latents and conditioning and keeps the timestep float32 (FSDP2's cast would round a
            timestep of 937.5 to 936 in bf16); on for a module a method builds (the DMD2 GAN head), which has no
            family to cast for it.

    Returns:
        The same module, now an ``FSDPModule`` whose parameters are sharded DTensors.
    """
    policy = MixedPrecisionPolicy(
        param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=cast_forward_inputs
    )
    fp32 = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=cast_forward_inputs
    )
    units: dict[nn.Module, MixedPrecisionPolicy] = {block: policy for block in blocks}
    if compute_dtype is not None and compute_dtype != torch.float32:
        units.update(_fp32_units(model, policy, fp32))
    units[model] = units.get(model, policy)
    # Reversed pre-order: every unit is wrapped before any unit above it, as fully_shard requires.
    for _, module in reversed(list(model.named_modules())):
        if module in units:
            fully_shard(module, mesh=mesh, mp_policy=units[module], reshard_after_forward=reshard_after_forward)
    set_compute_dtype(model, compute_dtype)
    return model


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _fp32_units(
    model: nn.Module, policy: MixedPrecisionPolicy, fp32: MixedPrecisionPolicy
) -> dict[nn.Module, MixedPrecisionPolicy]:
    """The units :func:`shard_model` adds for the modules ``model`` keeps in float32: each kept module that holds
    parameters (``fp32``), and each module that directly holds kept parameters (``fp32``) with its children that hold
    parameters (``policy``; containers such as ``nn.ModuleList`` are never called, so their items instead). Logs a
    warning for a module that directly holds kept and other parameters: they stay together in the compute dtype."""
    names = keep_fp32_names(model)
    kept = kept_modules(model)
    units = {module: fp32 for _, module in kept if _holds_parameters(module)}
    for name, module in model.named_modules():
        if any(name == outer or name.startswith(outer + ".") for outer, _ in kept):
            continue
        own = [param_name for param_name, _ in module.named_parameters(recurse=False)]
        held = [param_name for param_name in own if param_name in names]
        if not held:
            continue
        if len(held) != len(own):
            logger.warning(
                "%s holds parameters kept in float32 (%s) beside others; FSDP gathers them all in the compute dtype",
                name or type(model).__name__,
                ", ".join(held),
            )
            continue
        units[module] = fp32
        for child in _called_children(module):
            units.setdefault(child, policy)
    return units


def _called_children(module: nn.Module) -> list[nn.Module]:
    """The children of ``module`` that hold parameters, through containers (``nn.ModuleList``, ``nn.ModuleDict``:
    never called themselves, so a unit on one would never gather)."""
    children = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            children += _called_children(child)
        elif _holds_parameters(child):
            children.append(child)
    return children


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def reshard(model: nn.Module) -> None:
    """Free every unsharded parameter of ``model`` (each FSDP unit's ``reshard`` is not recursive); no-op for a
    plain module. FSDP2 leaves a root unsharded after a forward without backward, so every ``no_grad`` use of a
    sharded model ends here, or sleep would move full weights."""
    for module in _fsdp_modules(model):
        module.reshard()


def window_sync(model: nn.Module, last_micro_batch: bool) -> None:
    """Before each micro-batch of an optimizer window: reduce-scatter gradients and reshard parameters only after
    the window's last backward; the others accumulate unsharded gradients on gathered parameters. No-op for a
    plain module."""
    if is_sharded(model):
        model.set_requires_gradient_sync(last_micro_batch)
        model.set_reshard_after_backward(last_micro_batch)


def compute_context(model: nn.Module, compute_dtype: torch.dtype, device: torch.device):
    """The context a forward of ``model`` runs in: ``torch.autocast`` to ``compute_dtype`` for an unsharded model
    trained in low precision (FSDP casts sharded parameters itself), else a no-op. The modules the model keeps in
    float32 run with autocast off (:func:`miles.models.precision.exempt_from_autocast`, set at load)."""
    if is_sharded(model) or compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype)


def _load(
    family,
    path: str,
    mesh: DeviceMesh | None,
    device: torch.device,
    *,
    load_dtype: torch.dtype,
    compute_dtype: torch.dtype | None,
    trainable: bool,
    converters: Sequence[ModelConverter] = (),
    component: str = DENOISER,
    reshard_after_forward: bool = True,
) -> nn.Module:
    # Parameters on the meta device until they are sharded: no process holds a whole model it does not keep (loading
    # first put a full float32 copy in every process's host memory and the whole model on every GPU).
    model = family.build_meta_denoiser(path, dtype=load_dtype, component=component)
    model.train(trainable)
    model.requires_grad_(trainable)
    if trainable:
        for name in family.unused_parameters(model):  # no gradient, so no optimizer state a resume could load
            model.get_parameter(name).requires_grad_(False)
    names = checkpoint_names(model)  # the files' names, before a converter wraps layers
    # Before fully_shard: a converter may wrap layers, freeze the base or checkpoint blocks, and each block's
    # recomputation then runs inside its own FSDP unit.
    for converter in converters:
        converter.convert(component, model)
    if trainable and converters:
        # Again after the converters: a LoRA adapter on such a layer (Qwen-Image's last to_add_out) gets no gradient
        # either, and the optimizer state a resume loads would lack it ("Missing key in checkpoint state_dict").
        for name in family.unused_parameters(model):
            model.get_parameter(name).requires_grad_(False)
    if mesh is not None and mesh.size() > 1:
        # Per-block units only pay off when they are freed after each use (ZeRO-3); otherwise one unit is cheapest.
        blocks = family.blocks(model) if reshard_after_forward else []
        shard_model(model, blocks, mesh, compute_dtype, reshard_after_forward)
    # Each rank's shards (or, unwrapped, the whole model) on the device, read from the files tensor by tensor.
    ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    load_weights(model, family.denoiser_weight_files(path, component), device, names, ignore_unexpected=ignore)
    # miles.models.precision, once the weights are in: buffers in the compute dtype (a frozen model is loaded in it),
    # the modules the model keeps in float32 out of autocast.
    cast_buffers(model, compute_dtype or load_dtype)
    exempt_from_autocast(model)
    return model


def load_trainable_denoiser(
    family,
    path: str,
    mesh: DeviceMesh | None,
    device: torch.device,
    compute_dtype: torch.dtype,
    converters: Sequence[ModelConverter] = (),
    reshard_after_forward: bool = True,
) -> nn.Module:
    """The trainable denoiser of pipeline ``path``: float32 master weights (the optimizer's), in train mode, with
    grads, changed by ``converters`` (:mod:`miles.backends.fsdp_utils.converters`), then sharded over the mesh when
    it has more than one rank (``mesh`` None: a group of one, unwrapped), then loaded onto ``device`` (each rank its
    shards; the module docstring).

    Raises:
        FileNotFoundError: for a pipeline without ``transformer/config.json`` or safetensors weights.
        RuntimeError: for a parameter the weight files do not hold (and no converter initialised).
        ValueError: for a weight whose shape differs from the config's model.
    """
    model = _load(
        family,
        path,
        mesh,
        device,
        load_dtype=torch.float32,
        compute_dtype=compute_dtype,
        trainable=True,
        converters=converters,
        reshard_after_forward=reshard_after_forward,
    )
    n_params = sum(p.numel() for p in model.parameters())
    logger.debug("loaded trainable denoiser from %s (%d parameters)", path, n_params)
    return model


def load_frozen_denoiser(
    family,
    path: str,
    mesh: DeviceMesh | None,
    device: torch.device,
    compute_dtype: torch.dtype,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """A frozen denoiser (e.g. ``--teacher-load``) stored in the compute dtype (no float32 master copy: nothing
    updates it; modules the class keeps in float32 stay float32, as ``from_pretrained`` keeps them), built and
    sharded before it is loaded like the trainable one, eval mode, no grads.

    A two-expert pipeline (``family.expert_boundary(path)`` not None: Wan 2.2 A14B) gives both experts, each loaded
    and sharded so, behind one :class:`~miles.models.experts.ExpertSwitch` that runs each sample's expert as the stock
    pipeline chooses it.

    Callers run it under ``torch.no_grad`` and :func:`reshard` it afterwards.
    """

    def load(component: str) -> nn.Module:
        return _load(
            family,
            path,
            mesh,
            device,
            load_dtype=compute_dtype,
            compute_dtype=None,
            trainable=False,
            component=component,
            reshard_after_forward=reshard_after_forward,
        )

    boundary = family.expert_boundary(path)
    if boundary is None:
        model = load(DENOISER)
    else:
        model = ExpertSwitch(load(DENOISER), load(SECOND_EXPERT), boundary)
    logger.debug("loaded frozen denoiser from %s in %s (expert boundary %s)", path, compute_dtype, boundary)
    return model
