"""The memory planner: the bytes each trainer group holds on one DP rank, from the real model configs built on the
meta device (no weights, no GPU), and whether they fit a GPU. ``--dry-run`` prints it (:func:`log_memory_plan`);
``benchmarks/memory_plan.py`` makes the table of docs/performance.md.

Per group, for DP rank 0 (FSDP2 gives the first ranks the largest shards, so it holds the most):

Exact, counted from the parameters' shapes (a run logs the first four as ``memory/<role>-*_bytes``):

* **parameters**: the trainable modules in float32 (the denoiser, or only its LoRA adapters, plus modules a build
  hook adds, like the DMD2 GAN head), sharded over the DP ranks (FSDP2 shards dim 0 when there is more than one);
* **gradients**: float32, sharded like the parameters (after the reduce-scatter);
* **optimizer**: AdamW's two float32 moments per trainable element, sharded, and a 4-byte step count per tensor;
* **frozen**: the teacher in the compute dtype, sharded; with LoRA the group holds one base, the model its
  adapters sit on (the teacher is that base with the adapters disabled), and it is counted here;
* **EMA**: float32 shadows of the trainables' shards (``--ema-decay``; not among the logged figures);
* **buffers**: the models' buffers (SD3's position-embedding table: 0.23B elements in SD3.5-Medium), which FSDP
  does not shard: every rank holds them whole, in the compute dtype (those a model keeps in float32, Wan's rope
  tables, in float32: :mod:`miles.models.precision`), trainable or frozen (not among the logged figures).

Estimated, per phase:

* **gathered**: what the trainer materialises beside the shards. With more than one rank and the default
  ZeRO-2-like mode, a phase keeps each model whole in the compute dtype (model.py), and an optimizer window keeps
  unsharded gradients: float32 (FSDP2 accumulates unsharded gradients in the reduce dtype) plus the compute-dtype
  gradient of the micro-batch in flight. In the train window that is ``(T + B)·c + T·(4 + c)`` bytes (T trainable
  and B LoRA-base elements, c the compute dtype's size; ``T·4`` in float32); in an inference phase (rollout,
  scoring) the group's models whole, the teacher included. ZeRO-3 (``--fsdp-reshard-every-microbatch``) gathers
  the root's own parameters and two blocks at a time (the one running and the one prefetched), with one block's
  unsharded gradients. At one rank nothing is sharded, but autocast keeps a compute-dtype copy of the float32
  trainables for the backward (``T·c``).
* **activations**: :func:`miles.models.memory.activation_estimate` at the group's samples per forward.

The peak of a group is its largest phase: the train window (everything above plus the gradients, the gathered
train state and the activations) or an inference phase. Groups share each GPU one at a time (the others sleep in
host memory), so a GPU must hold the largest group's peak; a rank fits when that peak is at most
``(1 − HEADROOM)`` of the GPU, the rest left for the CUDA context, NCCL buffers, allocator fragmentation and the
estimates' error. Not counted: the rollout engine's text encoder (use the prompt cache), the VAE, eval sampling.
"""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from miles.models.lora import DEFAULT_LORA_TARGET_MODULES, adapter_parameters, add_lora_adapter
from miles.models.memory import ActivationEstimate, activation_estimate, full_config, meta_denoiser, shard_bytes
from miles.models.precision import keep_fp32_names, keeps_fp32

__all__ = [
    "GIB",
    "HEADROOM",
    "GroupMemory",
    "GroupSpec",
    "LoraSpec",
    "PlanSetting",
    "fit_line",
    "format_bytes",
    "gpu_memory_bytes",
    "log_memory_plan",
    "memory_table",
    "plan_group",
    "plan_run",
]

logger = logging.getLogger(__name__)

GIB = 2**30
# Share of a GPU's memory the plan leaves free (CUDA context, NCCL buffers, fragmentation, estimate error).
HEADROOM = 0.10
# AdamW (torch.optim.AdamW, not fused): exp_avg and exp_avg_sq like the parameter, a float32 scalar "step" per tensor.
ADAM_MOMENTS = 2
ADAM_STEP_BYTES = 4
MASTER_BYTES = 4  # float32 master weights, gradients, moments and EMA shadows


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter of one group: its rank and the module-name suffixes it targets."""

    rank: int
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGET_MODULES


@dataclass(frozen=True)
class GroupSpec:
    """One trainer group as the planner sees it.

    Attributes:
        role: the group's role (``"actor"``, ``"critic"``).
        config: the group's denoiser config (diffusers, with ``_class_name``); with LoRA, the base's.
        teacher: the config of a frozen teacher held beside a full-weight denoiser, or None. With LoRA it is ignored:
            the teacher is the base itself with the adapters disabled, so the group holds one base.
        lora: the group's adapter, or None for full weights.
        build_extra: ``fn(denoiser) -> {name: module}`` of trainable modules built on the denoiser (the GAN head);
            called on the meta device.
        ema: whether the group keeps an EMA of its trainables.
        batch: samples per trainer forward (the micro-batch, times 3 for the DMD2 GAN critic).
    """

    role: str
    config: dict
    teacher: dict | None = None
    lora: LoraSpec | None = None
    build_extra: Callable[[nn.Module], dict[str, nn.Module]] | None = None
    ema: bool = False
    batch: int = 1


@dataclass(frozen=True)
class PlanSetting:
    """What every group of a run shares: DP size, compute dtype, tokens per sample, the memory knobs."""

    dp_size: int
    compute_dtype: torch.dtype
    image_tokens: int
    text_tokens: int
    gradient_checkpointing: bool = False
    reshard_every_microbatch: bool = False
    rank: int = 0


@dataclass(frozen=True)
class GroupMemory:
    """Bytes one DP rank of a group holds (see the module docstring for each figure)."""

    role: str
    trainable_numel: int
    frozen_numel: int
    parameters: int
    gradients: int
    optimizer: int
    frozen: int
    ema: int
    buffers: int
    gathered_train: int
    gathered_inference: int
    activations: ActivationEstimate

    @property
    def resting(self) -> int:
        """Bytes held between phases (moved to the host while the group sleeps)."""
        return self.parameters + self.optimizer + self.frozen + self.ema + self.buffers

    @property
    def train_peak(self) -> int:
        return self.resting + self.gradients + self.gathered_train + self.activations.peak

    @property
    def peak(self) -> int:
        return max(self.train_peak, self.resting + self.gathered_inference)

    def fits(self, gpu_bytes: float) -> bool:
        """Whether the peak leaves :data:`HEADROOM` of a GPU of ``gpu_bytes`` free."""
        return self.peak <= (1 - HEADROOM) * gpu_bytes

    def logged(self) -> dict[str, int]:
        """The figures a run logs as ``memory/<role>-<name>_bytes`` (``FSDPTrainRayActor.memory_bytes``)."""
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "frozen": self.frozen}  # fmt: skip


def _blocks(model: nn.Module) -> list[nn.Module]:
    # The modules FSDP shards one by one under ZeRO-3: diffusers' _no_split_modules (the families' blocks()).
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def _zero3_gathered(model: nn.Module, include: Callable[[nn.Parameter], bool]) -> tuple[int, int]:
    """Elements of the parameters ``include`` selects that ZeRO-3 holds whole at once: ``(parameters, gradients)``
    = ``(root + two blocks, root + one block)``, at most the model."""
    blocks = [sum(p.numel() for p in block.parameters() if include(p)) for block in _blocks(model)]
    total = sum(p.numel() for p in model.parameters() if include(p))
    root, largest = total - sum(blocks), max(blocks, default=0)
    return min(total, root + 2 * largest), min(total, root + largest)


def _gathered(
    model: nn.Module, teacher: nn.Module | None, trainable_ids: set[int], extra_numel: int, setting: PlanSetting
) -> tuple[int, int]:
    """``(train window, inference phase)`` bytes a rank materialises beside its shards (the module docstring).

    Args:
        model: the group's denoiser (its trainables are ``trainable_ids``; the rest is a LoRA base).
        teacher: a separate frozen teacher, or None.
        extra_numel: elements of the trainable modules built beside the denoiser (each its own FSDP unit).
    """
    c = setting.compute_dtype.itemsize
    # Gradients of a window: float32 unsharded (FSDP2 accumulates in the reduce dtype) + the micro-batch's own.
    grad_bytes = MASTER_BYTES + (c if c != MASTER_BYTES else 0)
    trainable = extra_numel + sum(p.numel() for p in model.parameters() if id(p) in trainable_ids)
    if setting.dp_size == 1:
        # Unsharded: autocast caches a compute-dtype copy of each float32 trainable until the backward.
        return (trainable * c if c != MASTER_BYTES else 0), 0
    teacher_numel = sum(p.numel() for p in teacher.parameters()) if teacher is not None else 0
    if not setting.reshard_every_microbatch:
        whole = sum(p.numel() for p in model.parameters()) + extra_numel
        return whole * c + trainable * grad_bytes, (whole + teacher_numel) * c
    trainable_params, trainable_grads = _zero3_gathered(model, lambda p: id(p) in trainable_ids)
    base_params, _ = _zero3_gathered(model, lambda p: id(p) not in trainable_ids)
    teacher_params = _zero3_gathered(teacher, lambda p: True)[0] if teacher is not None else 0
    units = extra_numel + trainable_params + base_params
    return units * c + (extra_numel + trainable_grads) * grad_bytes, (units + teacher_params) * c


def _buffer_bytes(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Bytes of ``model``'s buffers as a group stores them (:func:`miles.models.precision.cast_buffers`)."""
    names = keep_fp32_names(model)
    sizes = [MASTER_BYTES if keeps_fp32(name, names) else compute_dtype.itemsize for name, _ in model.named_buffers()]
    return sum(buffer.numel() * size for (_, buffer), size in zip(model.named_buffers(), sizes))


def plan_group(spec: GroupSpec, setting: PlanSetting) -> GroupMemory:
    """The bytes DP rank ``setting.rank`` of group ``spec`` holds, from its configs on the meta device.

    Raises:
        ValueError: for a config diffusers cannot build, a LoRA target list that matches nothing, or a denoiser
            class without an activation layout (:func:`miles.models.memory.activation_estimate`).
    """
    dp, rank = setting.dp_size, setting.rank
    model = meta_denoiser(spec.config)
    if spec.lora is not None:
        add_lora_adapter(model, spec.role, spec.lora.rank, target_modules=spec.lora.target_modules)
        trainable = [param for _, param in adapter_parameters(model, spec.role)]
    else:
        trainable = list(model.parameters())
    trainable_ids = {id(param) for param in trainable}
    base = [param for param in model.parameters() if id(param) not in trainable_ids]
    teacher = meta_denoiser(spec.teacher) if spec.teacher is not None and spec.lora is None else None
    extra_modules = {}
    if spec.build_extra is not None:
        with torch.device("meta"):
            extra_modules = spec.build_extra(model)
    trainable_shapes = [tuple(p.shape) for p in trainable]
    trainable_shapes += [tuple(p.shape) for module in extra_modules.values() for p in module.parameters()]
    frozen = base + (list(teacher.parameters()) if teacher is not None else [])
    frozen_shapes = [tuple(p.shape) for p in frozen]
    c = setting.compute_dtype.itemsize
    # A denoiser's buffers are stored in the compute dtype, those it keeps in float32 in float32, trainable or frozen
    # (miles.models.precision); the modules a method builds keep their float32 ones.
    buffers = _buffer_bytes(model, setting.compute_dtype)
    buffers += sum(b.numel() for module in extra_modules.values() for b in module.buffers()) * MASTER_BYTES
    if teacher is not None:
        buffers += _buffer_bytes(teacher, setting.compute_dtype)

    params = shard_bytes(trainable_shapes, dp, rank, MASTER_BYTES)
    t_full = sum(math.prod(shape) for shape in trainable_shapes)
    gathered_train, gathered_inference = _gathered(
        model, teacher, trainable_ids, t_full - sum(p.numel() for p in trainable), setting
    )
    activations = activation_estimate(
        full_config(model),
        setting.image_tokens,
        setting.text_tokens,
        spec.batch,
        c,
        setting.gradient_checkpointing,
    )
    return GroupMemory(
        role=spec.role,
        trainable_numel=t_full,
        frozen_numel=sum(p.numel() for p in frozen),
        parameters=params,
        gradients=params,
        optimizer=ADAM_MOMENTS * params + ADAM_STEP_BYTES * len(trainable_shapes),
        frozen=shard_bytes(frozen_shapes, dp, rank, c),
        ema=params if spec.ema else 0,
        buffers=buffers,
        gathered_train=gathered_train,
        gathered_inference=gathered_inference,
        activations=activations,
    )


def format_bytes(count: float) -> str:
    """``1536 → "1.5 KiB"``: binary units, three significant figures."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:.3g} {unit}"
    return f"{int(count)} B"


def format_count(count: int) -> str:
    """``2_243_000_000 → "2.24B"``: parameter counts."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(count)


def _group_lora(group_args) -> LoraSpec | None:
    from miles.models.lora import lora_settings

    settings = lora_settings(group_args)
    return None if settings is None else LoraSpec(settings.rank, settings.target_modules)


def plan_run(args, lora: dict[str, LoraSpec] | None = None) -> tuple[PlanSetting, list[GroupMemory]]:
    """The plan of a parsed command: every trainer group of its method, on DP rank 0.

    Args:
        lora: a LoRA adapter per role (``{"actor": ..., "critic": ...}``, a missing role trains full weights); None
            reads each group's ``--lora-*`` flags (``--critic-lora-*`` for the critic).

    Raises:
        FileNotFoundError, ValueError: for a pipeline without a readable transformer config, or one the planner
            cannot lay out.
    """
    from miles.backends.fsdp_utils.model import resolve_dtype
    from miles.methods import compute_trainer_configs, get_method
    from miles.models import get_model_family
    from miles.models.base import DENOISER
    from miles.models.memory import transformer_config
    from miles.utils.misc import load_function
    from miles.utils.trainer_config import compute_trainer_args, trains
    from miles.utils.validation import dp_size

    method = get_method(args)
    family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
    student = transformer_config(args.hf_checkpoint)
    # The patch covers the last axes: (H, W) for an image DiT, (F, H, W) for Wan's (1, 2, 2); channels come first.
    latent = family.latent_shape(args.hf_checkpoint)
    patch = student.get("patch_size", 1)
    patch = [int(p) for p in patch] if isinstance(patch, (list, tuple)) else [int(patch)] * 2
    image_tokens = math.prod(size // p for size, p in zip(latent[-len(patch) :], patch))
    setting = PlanSetting(
        dp_size=dp_size(args),
        compute_dtype=resolve_dtype(args.train_dtype),
        image_tokens=image_tokens,
        text_tokens=family.text_tokens(args.hf_checkpoint),
        gradient_checkpointing=args.gradient_checkpointing,
        reshard_every_microbatch=args.fsdp_reshard_every_microbatch,
    )
    plans = []
    for trainer in compute_trainer_configs(args):
        group_args = compute_trainer_args(args, trainer)
        if not trains(group_args):
            continue  # a frozen group (the DMD2 reward group) holds no denoiser; its hook's model is not planned
        build_extra = None
        if group_args.custom_build_modules_path:
            builder = load_function(group_args.custom_build_modules_path)

            def build_extra(model, builder=builder, group_args=group_args):
                return builder(group_args, {DENOISER: model})

        spec = GroupSpec(
            role=trainer.role,
            config=transformer_config(group_args.hf_checkpoint),
            teacher=transformer_config(group_args.teacher_load) if group_args.teacher_load else None,
            lora=_group_lora(group_args) if lora is None else lora.get(trainer.role),
            build_extra=build_extra,
            ema=bool(group_args.ema_decay),
            batch=method.train_forward_batch(group_args),
        )
        plans.append(plan_group(spec, setting))
    return setting, plans


def gpu_memory_bytes(args) -> float | None:
    """``--gpu-memory-gb`` in bytes, else the first CUDA device's total memory, else None (no fit check)."""
    if args.gpu_memory_gb is not None:
        return args.gpu_memory_gb * GIB
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return None


def memory_table(setting: PlanSetting, plans: list[GroupMemory], gpu_bytes: float | None = None) -> list[str]:
    """The plan as text lines: a header, one row per group, the fit verdict when ``gpu_bytes`` is given."""
    mode = "unsharded (1 rank)"
    if setting.dp_size > 1:
        mode = "ZeRO-3 per block" if setting.reshard_every_microbatch else "ZeRO-2-like (whole models per phase)"
    dtype = str(setting.compute_dtype).removeprefix("torch.")
    lines = [
        f"memory per GPU, DP rank {setting.rank} of {setting.dp_size}: {dtype} compute, {setting.image_tokens} image "
        f"+ {setting.text_tokens} text tokens per sample, gradient checkpointing "
        f"{'on' if setting.gradient_checkpointing else 'off'}, {mode}"
    ]
    header = ["group", "# trainable", "# frozen", "parameters", "gradients", "optimizer", "frozen", "EMA",
              "buffers", "gathered*", "activations*", "peak*"]  # fmt: skip
    rows = [
        [plan.role, format_count(plan.trainable_numel), format_count(plan.frozen_numel),
         *(format_bytes(n) for n in (plan.parameters, plan.gradients, plan.optimizer, plan.frozen, plan.ema,
                                     plan.buffers, max(plan.gathered_train, plan.gathered_inference),
                                     plan.activations.peak, plan.peak))]
        for plan in plans
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines += ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    lines.append("  * estimates (gathered models and gradients of a phase, activations); the rest is exact")
    if gpu_bytes is not None:
        lines.append(fit_line(plans, gpu_bytes))
    return lines


def fit_line(plans: list[GroupMemory], gpu_bytes: float) -> str:
    """Whether every group fits a GPU of ``gpu_bytes``, on one line naming the largest peak."""
    worst = max(plans, key=lambda plan: plan.peak)
    verdict = "fits" if worst.fits(gpu_bytes) else "does NOT fit"
    return (
        f"GPU of {format_bytes(gpu_bytes)}: {verdict} (largest peak {format_bytes(worst.peak)}, {worst.role} "
        f"group; the plan keeps {HEADROOM:.0%} free: {format_bytes((1 - HEADROOM) * gpu_bytes)})"
    )


def log_memory_plan(args) -> None:
    """Log the run's memory plan (``--dry-run``); a plan that cannot be made is one warning, not a failure."""
    try:
        setting, plans = plan_run(args)
    # A family without text_tokens or a config the planner has no layout for must not fail the dry run's checks.
    except (AttributeError, NotImplementedError, OSError, KeyError, ValueError) as exc:
        logger.warning("memory plan: not available (%s: %s)", type(exc).__name__, exc)
        return
    for line in memory_table(setting, plans, gpu_memory_bytes(args)):
        logger.info("%s", line)
