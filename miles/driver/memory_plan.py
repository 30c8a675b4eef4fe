"""The memory planner: the bytes each trainer group holds on one DP rank, from the real model configs built on the
meta device (no weights, no GPU), and whether they fit a GPU. ``--dry-run`` prints it (:func:`log_memory_plan`);
``benchmarks/memory_plan.py`` makes the table of docs/performance.md.

Per group, for DP rank 0 (FSDP2 gives the first ranks the largest shards, so it holds the most):

Exact, counted from the parameters' shapes (a run logs the first four as ``memory/<role>-*_bytes``):

* **parameters**: the trainable modules in float32 (the denoiser, or only its LoRA adapters, plus modules a build
  hook adds, like the DMD2 GAN head), sharded over the DP ranks (FSDP2 shards dim 0 when there is more than one);
* **gradients**: float32, sharded like the parameters (after the reduce-scatter);
* **optimizer**: AdamW's two float32 moments per trainable element, sharded, and a 4-byte step count per tensor;
* **frozen**: the teacher in the compute dtype, sharded, both experts of a two-expert teacher (Wan 2.2 A14B); with
  LoRA the group holds one base, the model its adapters sit on (a one-network teacher is that base with the
  adapters disabled; a two-expert teacher is held beside it), and it is counted here;
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
* **activations**: :func:`miles.models.memory.activation_estimate` of the family's activation layout per token and
  block (:class:`~miles.models.capabilities.MemoryLayout`, which also gives the tokens per sample) at the group's
  samples per forward. The planner knows no family: one that declares ``MemoryLayout`` gets a plan.

The peak of a group is its largest phase: the train window (everything above plus the gradients, the gathered
train state and the activations) or an inference phase. Groups share each GPU one at a time (the others sleep in
host memory), so a GPU must hold the largest group's peak; a rank fits when that peak is at most
``(1 − HEADROOM)`` of the GPU, the rest left for the CUDA context, NCCL buffers, allocator fragmentation and the
estimates' error.

Text encoders: without a prompt cache for every prompt the actor ranks encode (and for the negative prompt), each
actor rank loads the family's text encoders whole, in the compute dtype, and keeps them with the actor group's state
(asleep with it): :func:`text_encoder_memory` counts their weights from the safetensors headers, and the actor's
peak with them must fit too (:func:`check_text_encoders_fit`, or encode the prompts once with ``python -m
miles.rollout.prompt_cache``). Not counted: the VAE, eval sampling.

Start-up (estimated), per group in training order: the groups initialise one after the other, each built on the
meta device, sharded, then read from its files one tensor at a time, each rank its own rows
(:mod:`miles.backends.fsdp_utils.model`); with shared GPUs each sleeps in host memory before the next one loads.

* **GPU**: the shards as loaded (parameters, frozen, EMA, buffers; the optimizer state only when ``--load``
  resumes it), plus what is briefly held twice: the buffers while ``to_empty`` replaces them, and the LoRA adapters
  and built modules (the GAN head) whole before ``fully_shard`` shards them;
* **host per process**: the tensors built real on the host (buffers, LoRA adapters, built modules, all whole), the
  largest tensor's rows in flight (read in at most 4 bytes per element and cast), and the resting state of the
  groups initialised before it, asleep in host memory; **per node**: that times the trainer ranks of a node.

Host memory per node (:func:`host_memory_per_node`): while groups take turns on the GPUs, every group's optimizer
state and EMA sit in pinned buffers for the whole run, and a sleeping group's parameters, frozen models and buffers
in pageable memory.
"""

import logging
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from miles.models.capabilities import MemoryLayout
from miles.models.lora import DEFAULT_LORA_TARGET_MODULES, adapter_parameters, add_lora_adapter
from miles.models.memory import (
    ActivationEstimate,
    activation_estimate,
    full_config,
    meta_denoiser,
    shard_bytes,
    shard_numel,
)
from miles.models.precision import keep_fp32_names, keeps_fp32

__all__ = [
    "GIB",
    "HEADROOM",
    "GroupMemory",
    "GroupSpec",
    "LoraSpec",
    "PlanSetting",
    "TextEncoderMemory",
    "check_text_encoders_fit",
    "fit_line",
    "format_bytes",
    "gpu_memory_bytes",
    "host_memory_line",
    "host_memory_per_node",
    "log_memory_plan",
    "memory_table",
    "plan_group",
    "plan_run",
    "startup_table",
    "text_encoder_line",
    "text_encoder_memory",
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
        teacher_2: the config of the teacher's second expert (Wan 2.2 A14B's ``transformer_2``), or None. A
            two-expert teacher is held whole beside the denoiser, LoRA or not (it is never the LoRA base).
        lora: the group's adapter, or None for full weights.
        build_extra: ``fn(denoiser) -> {name: module}`` of trainable modules built on the denoiser (the GAN head);
            called on the meta device.
        ema: whether the group keeps an EMA of its trainables.
        batch: samples per trainer forward (the micro-batch, times 3 for the DMD2 GAN critic).
    """

    role: str
    config: dict
    teacher: dict | None = None
    teacher_2: dict | None = None
    lora: LoraSpec | None = None
    build_extra: Callable[[nn.Module], dict[str, nn.Module]] | None = None
    ema: bool = False
    batch: int = 1


@dataclass(frozen=True)
class PlanSetting:
    """What every group of a run shares: DP size, compute dtype, the model family (its activation layout) and its
    tokens per sample, the memory knobs, the trainer ranks per node and whether the run resumes (``--load``: the
    optimizer state then loads at start-up).

    ``context_parallel`` (``--context-parallel-size``): FSDP shards over ``dp_size × context_parallel`` ranks
    (:attr:`shard_ranks`), and each rank's activations are those of ``image_tokens / context_parallel`` image tokens
    (Ulysses splits the sequence) and of the text tokens, split too where the class's ``_cp_plan`` splits them
    (FLUX, FLUX.2, Qwen-Image; not Wan)."""

    dp_size: int
    compute_dtype: torch.dtype
    image_tokens: int
    text_tokens: int
    gradient_checkpointing: bool = False
    reshard_every_microbatch: bool = False
    rank: int = 0
    ranks_per_node: int = 1
    resume: bool = False
    context_parallel: int = 1
    family: MemoryLayout = field(kw_only=True)

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP shards over: DP × CP."""
        return self.dp_size * self.context_parallel


@dataclass(frozen=True)
class GroupMemory:
    """Bytes one DP rank of a group holds (see the module docstring for each figure); ``startup`` is its GPU bytes
    while the group initialises, ``startup_host`` the host bytes of its own load (without the groups asleep)."""

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
    startup: int = 0
    startup_host: int = 0

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
    model: nn.Module, teachers: list[nn.Module], trainable_ids: set[int], extra_numel: int, setting: PlanSetting
) -> tuple[int, int]:
    """``(train window, inference phase)`` bytes a rank materialises beside its shards (the module docstring).

    Args:
        model: the group's denoiser (its trainables are ``trainable_ids``; the rest is a LoRA base).
        teachers: the separate frozen teacher's networks (two for a two-expert teacher), or none.
        extra_numel: elements of the trainable modules built beside the denoiser (each its own FSDP unit).
    """
    c = setting.compute_dtype.itemsize
    # Gradients of a window: float32 unsharded (FSDP2 accumulates in the reduce dtype) + the micro-batch's own.
    grad_bytes = MASTER_BYTES + (c if c != MASTER_BYTES else 0)
    trainable = extra_numel + sum(p.numel() for p in model.parameters() if id(p) in trainable_ids)
    if setting.shard_ranks == 1:
        # Unsharded: autocast caches a compute-dtype copy of each float32 trainable until the backward.
        return (trainable * c if c != MASTER_BYTES else 0), 0
    teacher_numel = sum(p.numel() for teacher in teachers for p in teacher.parameters())
    if not setting.reshard_every_microbatch:
        whole = sum(p.numel() for p in model.parameters()) + extra_numel
        return whole * c + trainable * grad_bytes, (whole + teacher_numel) * c
    trainable_params, trainable_grads = _zero3_gathered(model, lambda p: id(p) in trainable_ids)
    base_params, _ = _zero3_gathered(model, lambda p: id(p) not in trainable_ids)
    # each expert's root stays gathered after its no-grad forward until the phase ends: their sum, an upper bound
    teacher_params = sum(_zero3_gathered(teacher, lambda p: True)[0] for teacher in teachers)
    units = extra_numel + trainable_params + base_params
    return units * c + (extra_numel + trainable_grads) * grad_bytes, (units + teacher_params) * c


def _buffer_bytes(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Bytes of ``model``'s buffers as a group stores them (:func:`miles.models.precision.cast_buffers`)."""
    names = keep_fp32_names(model)
    sizes = [MASTER_BYTES if keeps_fp32(name, names) else compute_dtype.itemsize for name, _ in model.named_buffers()]
    return sum(buffer.numel() * size for (_, buffer), size in zip(model.named_buffers(), sizes))


def plan_group(spec: GroupSpec, setting: PlanSetting) -> GroupMemory:
    """The bytes rank ``setting.rank`` (of the ``setting.shard_ranks`` FSDP ranks) of group ``spec`` holds, from its
    configs on the meta device.

    Raises:
        ValueError: for a config diffusers cannot build, or a LoRA target list that matches nothing.
    """
    from miles.backends.fsdp_utils.context_parallel import splits_text

    dp, rank = setting.shard_ranks, setting.rank
    model = meta_denoiser(spec.config)
    if spec.lora is not None:
        add_lora_adapter(model, spec.role, spec.lora.rank, target_modules=spec.lora.target_modules)
        trainable = [param for _, param in adapter_parameters(model, spec.role)]
    else:
        trainable = list(model.parameters())
    trainable_ids = {id(param) for param in trainable}
    base = [param for param in model.parameters() if id(param) not in trainable_ids]
    teachers = []
    if spec.teacher is not None and (spec.lora is None or spec.teacher_2 is not None):
        teachers.append(meta_denoiser(spec.teacher))
    if spec.teacher_2 is not None:
        teachers.append(meta_denoiser(spec.teacher_2))
    extra_modules = {}
    if spec.build_extra is not None:
        with torch.device("meta"):
            extra_modules = spec.build_extra(model)
    trainable_shapes = [tuple(p.shape) for p in trainable]
    trainable_shapes += [tuple(p.shape) for module in extra_modules.values() for p in module.parameters()]
    frozen = base + [param for teacher in teachers for param in teacher.parameters()]
    frozen_shapes = [tuple(p.shape) for p in frozen]
    c = setting.compute_dtype.itemsize
    # A denoiser's buffers are stored in the compute dtype, those it keeps in float32 in float32, trainable or frozen
    # (miles.models.precision); the modules a method builds keep their float32 ones.
    buffers = _buffer_bytes(model, setting.compute_dtype)
    buffers += sum(b.numel() for module in extra_modules.values() for b in module.buffers()) * MASTER_BYTES
    buffers += sum(_buffer_bytes(teacher, setting.compute_dtype) for teacher in teachers)

    params = shard_bytes(trainable_shapes, dp, rank, MASTER_BYTES)
    t_full = sum(math.prod(shape) for shape in trainable_shapes)
    extra_numel = t_full - sum(p.numel() for p in trainable)
    gathered_train, gathered_inference = _gathered(model, teachers, trainable_ids, extra_numel, setting)
    optimizer = ADAM_MOMENTS * params + ADAM_STEP_BYTES * len(trainable_shapes)
    frozen_bytes = shard_bytes(frozen_shapes, dp, rank, c)
    ema = params if spec.ema else 0
    # Start-up: tensors built real on the host before sharding (the files hold none of them): buffers, a LoRA
    # adapter, the modules a method builds; the tensors read from the files, one at a time (file ≤ 4 bytes + cast).
    host_built = buffers + (t_full if spec.lora is not None else extra_numel) * MASTER_BYTES
    read = [(tuple(p.shape), MASTER_BYTES) for p in (trainable if spec.lora is None else [])]
    read += [(tuple(p.shape), c) for p in frozen]
    in_flight = max((shard_numel(shape, dp, rank) * (MASTER_BYTES + size) for shape, size in read), default=0)
    startup = params + frozen_bytes + ema + buffers + (optimizer if setting.resume else 0)
    startup += host_built  # held twice for a moment: buffers across to_empty, adapters and built modules unsharded
    activations = activation_estimate(
        setting.family.activation_layout(full_config(model)),
        setting.image_tokens // setting.context_parallel,
        setting.text_tokens // (setting.context_parallel if splits_text(type(model)) else 1),
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
        optimizer=optimizer,
        frozen=frozen_bytes,
        ema=ema,
        buffers=buffers,
        gathered_train=gathered_train,
        gathered_inference=gathered_inference,
        activations=activations,
        startup=startup,
        startup_host=host_built + in_flight,
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


def second_expert_config(family, pipeline: str) -> dict | None:
    """``<pipeline>/transformer_2/config.json`` of a two-expert pipeline (``family.expert_boundary`` not None: Wan
    2.2 A14B), else None."""
    from miles.models.base import SECOND_EXPERT
    from miles.models.pipeline_files import read_json

    if family.expert_boundary(pipeline) is None:
        return None
    return read_json(Path(pipeline) / SECOND_EXPERT / "config.json", f"{SECOND_EXPERT} config")


def plan_run(
    args, lora: dict[str, LoraSpec] | None = None, groups: list | None = None
) -> tuple[PlanSetting, list[GroupMemory]]:
    """The plan of a parsed command: every trainer group of its method, on DP rank 0.

    Args:
        lora: a LoRA adapter per role (``{"actor": ..., "critic": ...}``, a missing role trains full weights); None
            takes each group's own (its spec's, from ``--lora-*``, ``--critic-lora-*`` for the critic).
        groups: the run's groups (``RunSpec.groups``: the user's module builder included); default: as the flags
            lay them out (:func:`miles.driver.validators.group_layout`).

    Raises:
        FileNotFoundError, ValueError: for a pipeline without a readable transformer config, or one the planner
            cannot lay out.
    """
    from miles.backends.fsdp_utils.model import resolve_dtype
    from miles.driver.validators import group_layout
    from miles.methods import get_method
    from miles.models import get_model_family, require
    from miles.models.base import DENOISER
    from miles.models.memory import transformer_config
    from miles.utils.validation import context_parallel_size, dp_size

    method = get_method(args)
    family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
    require(family, MemoryLayout, "the memory plan")
    image_tokens, text_tokens = family.tokens_per_sample(args.hf_checkpoint)
    setting = PlanSetting(
        dp_size=dp_size(args),
        compute_dtype=resolve_dtype(args.train_dtype),
        image_tokens=image_tokens,
        text_tokens=text_tokens,
        gradient_checkpointing=args.gradient_checkpointing,
        reshard_every_microbatch=args.fsdp_reshard_every_microbatch,
        ranks_per_node=args.actor_num_gpus_per_node,
        resume=bool(args.load),
        context_parallel=context_parallel_size(args),
        family=family,
    )
    plans = []
    for group in group_layout(args) if groups is None else groups:
        if not group.trains:
            continue  # a frozen group (the DMD2 reward group) holds no denoiser; its hook's model is not planned
        build_extra = None
        if group.hooks.build_modules is not None:

            def build_extra(model, builder=group.hooks.build_modules):
                return builder(args, {DENOISER: model})

        if lora is not None:
            adapter = lora.get(group.role)
        else:
            adapter = None if group.lora is None else LoraSpec(group.lora.rank, group.lora.target_modules)
        spec = GroupSpec(
            role=group.role,
            config=transformer_config(group.init),
            teacher=transformer_config(group.teacher) if group.teacher else None,
            teacher_2=second_expert_config(family, group.teacher) if group.teacher else None,
            lora=adapter,
            build_extra=build_extra,
            ema=group.ema is not None,
            batch=method.train_forward_batch(args, group),
        )
        plans.append(plan_group(spec, setting))
    return setting, plans


def gpu_memory_bytes(args) -> float | None:
    """``--gpu-memory-gib`` in bytes, else the first CUDA device's total memory, else None (no fit check)."""
    if args.gpu_memory_gb is not None:
        return args.gpu_memory_gb * GIB
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return None


def memory_table(setting: PlanSetting, plans: list[GroupMemory], gpu_bytes: float | None = None) -> list[str]:
    """The plan as text lines: a header, one row per group, the fit verdict when ``gpu_bytes`` is given."""
    mode = "unsharded (1 rank)"
    if setting.shard_ranks > 1:
        mode = "ZeRO-3 per block" if setting.reshard_every_microbatch else "ZeRO-2-like (whole models per phase)"
    if setting.context_parallel > 1:
        mode += (
            f", context parallel {setting.context_parallel} (FSDP over {setting.shard_ranks} ranks, "
            f"{setting.image_tokens // setting.context_parallel} image tokens per rank)"
        )
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
    return lines + startup_table(setting, plans)


def startup_table(setting: PlanSetting, plans: list[GroupMemory]) -> list[str]:
    """The start-up estimate as text lines: per group in initialisation order, its GPU bytes per rank and the host
    bytes per trainer process and per node while it loads (the groups before it asleep in host memory)."""
    per_node = f"host per node ({setting.ranks_per_node} rank{'s' if setting.ranks_per_node != 1 else ''})"
    header = ["group", "GPU per rank*", "host per process*", f"{per_node}*"]
    rows, asleep = [], 0
    for plan in plans:
        host = plan.startup_host + asleep
        rows.append([plan.role, *(format_bytes(n) for n in (plan.startup, host, host * setting.ranks_per_node))])
        # Asleep from here on: what it holds at rest (the optimizer state exists only once it steps or resumes).
        asleep += plan.resting - (0 if setting.resume else plan.optimizer)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["start-up, one group after the other (each built on the meta device, sharded, then read from its files):"]
    lines += ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    return lines


def fit_line(plans: list[GroupMemory], gpu_bytes: float) -> str:
    """Whether every group fits a GPU of ``gpu_bytes``, on one line naming the largest peak."""
    worst = max(plans, key=lambda plan: plan.peak)
    verdict = "fits" if worst.fits(gpu_bytes) else "does NOT fit"
    return (
        f"GPU of {format_bytes(gpu_bytes)}: {verdict} (largest peak {format_bytes(worst.peak)}, {worst.role} "
        f"group; the plan keeps {HEADROOM:.0%} free: {format_bytes((1 - HEADROOM) * gpu_bytes)})"
    )


def host_memory_per_node(plans: list[GroupMemory], ranks_per_node: int) -> tuple[int, int]:
    """``(pinned, pageable)`` host bytes a node holds for sleeping groups: ``ranks_per_node`` times DP rank 0's.

    Groups sleep only when several share the GPUs (on CUDA; ``miles.driver.schedule.needs_sleep``), so a group alone
    holds nothing here: ``(0, 0)``. Otherwise, from ``miles.backends.fsdp_utils.sleep``:

    * **pinned**: every group's optimizer state and EMA shadows, in a buffer pinned at its first sleep and kept for
      the whole run, awake or not;
    * **pageable**: the parameters, frozen models and buffers of the groups asleep, freed when they wake. At most all
      groups but the one awake sleep; the figure is that of the smallest group awake (the largest total).
    """
    if len(plans) < 2:
        return 0, 0
    pinned = sum(plan.optimizer + plan.ema for plan in plans)
    pageable = [plan.parameters + plan.frozen + plan.buffers for plan in plans]
    return ranks_per_node * pinned, ranks_per_node * (sum(pageable) - min(pageable))


def host_memory_line(plans: list[GroupMemory], ranks_per_node: int) -> str | None:
    """:func:`host_memory_per_node` as one line of the plan, or None when no group sleeps."""
    pinned, pageable = host_memory_per_node(plans, ranks_per_node)
    if not pinned + pageable:
        return None
    return (
        f"host memory per node of {ranks_per_node} ranks while groups sleep (on CUDA): {format_bytes(pinned)} pinned "
        f"for the run (every group's optimizer state and EMA) + up to {format_bytes(pageable)} pageable (the sleeping "
        f"groups' parameters, frozen models, buffers) = {format_bytes(pinned + pageable)}"
    )


def log_memory_plan(args, groups: list | None = None) -> str | None:
    """Log the run's memory plan (``--dry-run``); a plan that cannot be made is one warning, not a failure.

    Returns:
        None, or when a group's planned peak does not fit the GPU (``--gpu-memory-gib``, else this machine's CUDA
        device) the one line the dry run fails with (exit code 2), naming the figures and the knobs.
    """
    try:
        setting, plans = plan_run(args, groups=groups)
    # A family without a memory layout, or a config it cannot lay out, must not fail the dry run's checks.
    except (AttributeError, NotImplementedError, OSError, KeyError, ValueError) as exc:
        logger.warning("memory plan: not available (%s: %s)", type(exc).__name__, exc)
        return None
    gpu_bytes = gpu_memory_bytes(args)
    for line in memory_table(setting, plans, gpu_bytes):
        logger.info("%s", line)
    refusal = None
    worst = max(plans, key=lambda plan: plan.peak)
    if gpu_bytes is not None and not worst.fits(gpu_bytes):
        source = "--gpu-memory-gib" if args.gpu_memory_gb is not None else "this machine's GPU"
        refusal = (
            f"the memory plan does NOT fit a GPU of {format_bytes(gpu_bytes)} ({source}): the {worst.role} group's "
            f"planned peak is {format_bytes(worst.peak)}, above the {format_bytes((1 - HEADROOM) * gpu_bytes)} it "
            "may use; spread it over more GPUs (--actor-num-gpus-per-node, --actor-num-nodes), or add "
            "--fsdp-reshard-every-microbatch, --gradient-checkpointing or --lora-rank (docs/performance.md)"
        )
    host = host_memory_line(plans, args.actor_num_gpus_per_node)
    if host is not None:
        logger.info("%s", host)
    try:
        encoders = text_encoder_memory(args)
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        logger.warning("memory plan: text encoders not counted (%s: %s)", type(exc).__name__, exc)
        return refusal
    if encoders is not None:
        logger.info("%s", text_encoder_line(encoders, plans, gpu_bytes))
    return refusal


@dataclass(frozen=True)
class TextEncoderMemory:
    """The text encoders one actor rank holds when it encodes prompts at run time.

    Attributes:
        reason: why they load (the first prompt without a cached cond, or the negative prompt).
        numel: their parameters (from the safetensors headers of the family's ``text_encoder_dirs``).
        bytes: what they hold on the GPU: ``numel`` in the compute dtype, whole on every actor rank (not sharded).
        dtype: the compute dtype they load in (``--train-dtype``).
    """

    reason: str
    numel: int
    bytes: int
    dtype: torch.dtype


def _encoded_at_run_time(args) -> str | None:
    """Why the actor ranks load the text encoders: the first record (of the files whose prompts they encode) without a
    cached cond under ``--cond-key``, or a negative prompt without ``--negative-cond``; None when the prompt cache
    covers everything."""
    from miles.methods import get_method
    from miles.rollout.data_source import read_jsonl_records

    files = [("--prompt-data", args.prompt_data)]
    if args.eval_interval and args.eval_prompt_data:
        files.append(("--eval-prompt-data", args.eval_prompt_data))
    method = get_method(args)
    files += [(side.flag, side.path) for side in [*method.side_inputs(args), *method.eval_data(args)]]
    for flag, path in files:
        for number, record in enumerate(read_jsonl_records(path, args.input_key, flag), start=1):
            if not isinstance(record.get(args.cond_key), str):
                return f"{flag} record {number} has no cached cond under --cond-key {args.cond_key!r}"
    if (args.encode_negative_prompt or args.diffusion_guidance_scale != 1.0) and not args.negative_cond:
        return "the negative prompt is encoded (no --negative-cond)"
    return None


def text_encoder_memory(args) -> TextEncoderMemory | None:
    """The text encoders each actor rank loads (:class:`TextEncoderMemory`), or None when a prompt cache covers every
    prompt it encodes and the negative prompt.

    Raises:
        OSError, ValueError: for an unreadable data file, or a text encoder folder without safetensors weights.
        RuntimeError: for a family whose text encoder package is missing (digits).
    """
    from miles.backends.fsdp_utils.model import resolve_dtype
    from miles.driver.preflight_data import safetensors_header
    from miles.models import get_model_family

    reason = _encoded_at_run_time(args)
    if reason is None:
        return None
    family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
    numel = 0
    for folder in family.text_encoder_dirs(args.hf_checkpoint):
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ValueError(f"text encoder folder {folder} holds no .safetensors weights to count")
        for file in files:
            header = safetensors_header(file)
            numel += sum(math.prod(info["shape"]) for key, info in header.items() if key != "__metadata__")
    dtype = resolve_dtype(args.train_dtype)
    return TextEncoderMemory(reason=reason, numel=numel, bytes=numel * dtype.itemsize, dtype=dtype)


def _actor_peak(plans: list[GroupMemory]) -> GroupMemory:
    return next(plan for plan in plans if plan.role == "actor")


def text_encoder_line(encoders: TextEncoderMemory, plans: list[GroupMemory], gpu_bytes: float | None) -> str:
    """The plan's text-encoder figure on one line: their size per actor rank, why they load, the actor's peak with
    them and, with ``gpu_bytes``, whether it fits."""
    dtype = str(encoders.dtype).removeprefix("torch.")
    peak = _actor_peak(plans).peak + encoders.bytes
    line = (
        f"text encoders: {format_count(encoders.numel)} parameters, {format_bytes(encoders.bytes)} per actor rank in "
        f"{dtype} ({encoders.reason}), asleep with the actor group; actor peak with them {format_bytes(peak)}"
    )
    if gpu_bytes is not None:
        line += (
            f": {'fits' if peak <= (1 - HEADROOM) * gpu_bytes else 'does NOT fit'} a GPU of {format_bytes(gpu_bytes)}"
        )
    return line


def check_text_encoders_fit(args) -> None:
    """With ``--gpu-memory-gib``: refuse a run whose actor group fits the GPU without its text encoders but not with
    them, naming the prompt-cache command that takes them off the GPU. A plan that cannot be made refuses nothing.

    Raises:
        ArgumentValidationError: one line: the encoders' size, the peaks, and the command.
    """
    from miles.utils.validation import reject

    if args.gpu_memory_gb is None:
        return
    try:
        encoders = text_encoder_memory(args)
        if encoders is None:
            return
        _, plans = plan_run(args)
    # The dry run's plan warns about what it cannot count; this check then has nothing to say.
    except (AttributeError, NotImplementedError, OSError, RuntimeError, KeyError, ValueError):
        return
    budget = (1 - HEADROOM) * args.gpu_memory_gb * GIB
    actor = _actor_peak(plans)
    if actor.peak > budget or actor.peak + encoders.bytes <= budget:
        return  # fits with them, or does not fit even without them (the plan's own verdict says so)
    dtype = str(encoders.dtype).removeprefix("torch.")
    negative = f" --negative-prompt {shlex.quote(args.negative_prompt)}" if args.negative_prompt else ""
    reject(
        f"the text encoders ({format_bytes(encoders.bytes)} in {dtype} on every actor rank: {encoders.reason}) do not "
        f"fit beside the actor group on a GPU of {format_bytes(args.gpu_memory_gb * GIB)} (--gpu-memory-gib): its peak "
        f"is {format_bytes(actor.peak + encoders.bytes)} with them, {format_bytes(actor.peak)} without, the plan "
        f"keeps {HEADROOM:.0%} free; encode the prompts once instead: python -m miles.rollout.prompt_cache "
        f"{args.hf_checkpoint} {args.prompt_data} CACHE_DIR{negative}, then train with --prompt-data CACHE_DIR/prompts.jsonl "
        "--negative-cond CACHE_DIR/negative.safetensors (docs/sd3.md)"
    )
