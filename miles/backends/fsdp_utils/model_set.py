"""A trainer group's model set: what it trains, what it only runs, and what updates and checkpoints them.

``build_model_set`` loads, in this order (the global RNG is seeded before, so a method's randomly initialised
module is the same on every rank and every run):

1. the trainable denoiser of the group's model source (``GroupSpec.init``: ``--hf-checkpoint``, the critic's
   ``--critic-load``; float32 master weights), built on the meta device, changed by the
   group's converters, sharded over the mesh, and only then read from its files, each rank its own shards
   (:mod:`miles.backends.fsdp_utils.model`); with ``--lora-rank`` a frozen base in the compute dtype and float32
   adapters;
2. the frozen teacher (``GroupSpec.teacher``), if any, in the compute dtype (both experts of a two-expert pipeline,
   :class:`miles.models.experts.ExpertSwitch`); when the group's denoiser is a LoRA on the teacher's own weights (the
   DMD2 critic with ``--critic-lora-rank``) and the teacher is one network, no second copy: the teacher is the
   denoiser with its adapters disabled (:class:`miles.models.lora.AdaptersDisabled`), one base per group;
3. the modules a method builds on the denoiser (its ``build_modules`` hook: the DMD2 GAN's discriminator head),
   converted and sharded like the denoiser;

then one AdamW over every trainable parameter, its LR schedule, and the EMA (the spec's). Parameters a converter
froze are left out of the optimizer, the EMA, the gradient clip and (as the converter says) the checkpoint.
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.checkpoint import ModulesState, RNGState, SchedulerState
from miles.backends.fsdp_utils.context_parallel import enable_context_parallel
from miles.backends.fsdp_utils.converters import ModelConverter, keeps_in_checkpoint, lora_converter
from miles.backends.fsdp_utils.ema import ParameterEMA
from miles.backends.fsdp_utils.model import load_frozen_denoiser, load_trainable_denoiser, reshard, shard_model
from miles.backends.fsdp_utils.optimizer import build_lr_scheduler, build_optimizer
from miles.config import GroupSpec, hook_name
from miles.models.lora import AdaptersDisabled
from miles.utils.validation import HookResultError

__all__ = ["DENOISER", "ModelSet", "build_model_set", "local_bytes", "shares_teacher_base"]

logger = logging.getLogger(__name__)

# The trainable denoiser's component name: PreparedBatch.component and TrainContext.models use it.
from miles.models.base import DENOISER  # noqa: E402  (re-exported)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of a tensor (its shard of a DTensor)."""
    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return tensor.numel() * tensor.element_size()


@dataclass
class ModelSet:
    """One group's models and their update state.

    Attributes:
        trainable: the trainable components by name: the denoiser (:data:`DENOISER`) and the modules a method built.
        frozen: frozen models by component name (``{"transformer": teacher}``), ``{}`` without ``--teacher-load``.
        optimizer: AdamW over :meth:`trainable_parameters`; scheduler: its LR schedule.
        ema: the EMA of the trainable parameters, or None.
        converters: the converters applied before sharding (their checkpoint filter applies to every save).
    """

    trainable: nn.ModuleDict
    frozen: dict[str, nn.Module]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: ParameterEMA | None = None
    converters: list[ModelConverter] = field(default_factory=list)

    @property
    def denoiser(self) -> nn.Module:
        return self.trainable[DENOISER]

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates (a converter may have frozen others)."""
        return [param for param in self.trainable.parameters() if param.requires_grad]

    def frozen_parameters(self) -> list[nn.Parameter]:
        """Every frozen parameter once: the frozen models' and a LoRA base's (a teacher that is the base with its
        adapters disabled shares the base's tensors)."""
        seen, params = set(), []
        models = [*self.frozen.values(), self.trainable]
        for param in (p for model in models for p in model.parameters() if not p.requires_grad):
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
        return params

    def modules(self) -> list[nn.Module]:
        """Every module of the set, trainable first."""
        return [*self.trainable.values(), *self.frozen.values()]

    def states(self, fresh: frozenset[str] = frozenset(), ema: bool = True) -> dict[str, Stateful]:
        """The checkpoint's ``Stateful`` things by name: modules and optimizer, the EMA, the LR schedule, the RNG.

        Args:
            fresh: built modules a load leaves as built (the checkpoint has none of them: phase 1 -> phase 2).
            ema: False leaves the EMA out (a load from a checkpoint that kept none).
        """
        keep = None
        if self.converters:
            converters = self.converters

            def keep(key: str) -> bool:
                return keeps_in_checkpoint(converters, key)

        states: dict[str, Stateful] = {"train": ModulesState(self.trainable, self.optimizer, keep, fresh)}
        if self.ema is not None and ema:
            states["ema"] = self.ema
        states["scheduler"] = SchedulerState(self.scheduler)
        states["rng"] = RNGState()
        return states

    def reshard(self) -> None:
        """Free every gathered parameter (sharded models stay gathered through a phase; see ``model.py``)."""
        for module in self.modules():
            reshard(module)

    def memory_bytes(self, gradient_bytes: int = 0) -> dict[str, int]:
        """Bytes this rank holds at rest: trainable parameters (its shards; with LoRA the adapters), ``gradient_bytes``
        (the last step's), the optimizer state and the frozen weights (the teacher, a LoRA base; each tensor once)."""
        optim = sum(
            local_bytes(value)
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        return {
            "parameters": sum(local_bytes(p) for p in self.trainable_parameters()),
            "gradients": gradient_bytes,
            "optimizer": optim,
            "frozen": sum(local_bytes(p) for p in self.frozen_parameters()),
        }


def _built_modules(
    spec: GroupSpec,
    args: Any,
    denoiser: nn.Module,
    converters: list[ModelConverter],
    device: torch.device,
    dtype: torch.dtype,
    mesh: DeviceMesh | None,
) -> dict[str, nn.Module]:
    """Call the group's module builder (``fn(args, models) -> {name: nn.Module}``, ``--custom-build-modules-path``)
    on the loaded denoiser, then convert, place and shard each module it returns like the denoiser (one FSDP unit
    each)."""
    path = hook_name(spec.hooks.build_modules)
    built = spec.hooks.build_modules(args, {DENOISER: denoiser})
    if not isinstance(built, dict) or not all(
        isinstance(name, str) and isinstance(module, nn.Module) for name, module in built.items()
    ):
        raise HookResultError(
            f"--custom-build-modules-path {path} returned {type(built).__name__}; expected a dict of "
            "name -> torch.nn.Module"
        )
    if DENOISER in built:
        raise ValueError(f"--custom-build-modules-path {path} returned a module named {DENOISER!r}, the denoiser's")
    for name, module in built.items():
        module.train().requires_grad_(True)
        for converter in converters:
            converter.convert(name, module)
        module.to(device)
        if mesh is not None and mesh.size() > 1:
            # A built module has no family to cast its inputs (the DMD2 GAN head's pooled prompt embedding): FSDP does.
            shard_model(
                module,
                [],
                mesh,
                dtype,
                reshard_after_forward=spec.reshard_every_microbatch,
                cast_forward_inputs=True,
            )
    return built


def shares_teacher_base(spec: GroupSpec, converters: list[ModelConverter]) -> bool:
    """Whether the group's denoiser is a LoRA on the teacher's weights (its init is its teacher), so that the
    teacher is its base with the adapters disabled instead of a second loaded copy."""
    if lora_converter(converters) is None or not spec.teacher:
        return False
    return os.path.realpath(spec.init) == os.path.realpath(spec.teacher)


def build_model_set(
    spec: GroupSpec,
    family: Any,
    device: torch.device,
    dtype: torch.dtype,
    mesh: DeviceMesh | None,
    converters: list[ModelConverter],
    args: Any = None,
    cp_mesh: DeviceMesh | None = None,
) -> ModelSet:
    """Load and build a group's model set (module docstring).

    Args:
        spec: the group's spec: ``init``, ``teacher``, its module builder (``hooks.build_modules``), optimizer,
            schedule and EMA, ``reshard_every_microbatch``.
        mesh: the group's 1-D data-parallel mesh; None for a group of one (nothing is wrapped).
        converters: applied to every trainable module before sharding, in order.
        args: the command's flags, the module builder's first argument (its documented signature).
        cp_mesh: this rank's context-parallel mesh, or None: the denoiser and the separate teacher then split each
            sample's sequence over it (:func:`~miles.backends.fsdp_utils.context_parallel.enable_context_parallel`;
            a LoRA teacher is the denoiser itself).

    Raises:
        HookResultError / ValueError: for a module builder that returns something else than named modules.
        ValueError: if no parameter is left trainable, or the denoiser has no context-parallel plan.
    """
    # Gathered through each phase, reduce-scattered once per optimizer step (see model.py), unless memory is short.
    reshard_after_forward = spec.reshard_every_microbatch
    denoiser = load_trainable_denoiser(
        family, spec.init, mesh, device, dtype, converters, reshard_after_forward=reshard_after_forward
    )
    enable_context_parallel(denoiser, cp_mesh, fsdp_ranks=mesh.size() if mesh is not None else 1)
    frozen = {}
    # A two-expert teacher (Wan 2.2 A14B) is never the LoRA base: the base is one network, the teacher two.
    two_experts = bool(spec.teacher) and family.expert_boundary(spec.teacher) is not None
    if spec.teacher and not two_experts and shares_teacher_base(spec, converters):
        frozen[DENOISER] = AdaptersDisabled(denoiser)
    elif spec.teacher:
        frozen[DENOISER] = load_frozen_denoiser(
            family, spec.teacher, mesh, device, dtype, reshard_after_forward=reshard_after_forward
        )
        enable_context_parallel(frozen[DENOISER], cp_mesh)
    trainable = nn.ModuleDict({DENOISER: denoiser})
    if spec.hooks.build_modules is not None:
        for name, module in _built_modules(spec, args, denoiser, converters, device, dtype, mesh).items():
            trainable[name] = module
    optimizer = build_optimizer(list(trainable.values()), spec.optimizer)
    scheduler = build_lr_scheduler(optimizer, spec.schedule, spec.optimizer.lr)
    ema = None
    if spec.ema is not None:
        ema = ParameterEMA(
            trainable, spec.ema.decay, min_decay=spec.ema.min_decay, update_after_step=spec.ema.update_after_step
        )
    return ModelSet(trainable, frozen, optimizer, scheduler, ema, list(converters))
