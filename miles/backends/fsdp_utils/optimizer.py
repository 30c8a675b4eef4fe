"""AdamW and its learning-rate schedule for one trainer group.

The schedule counts optimizer steps (``--num-steps-per-rollout`` per rollout, ``--num-rollout`` rollouts) and is a
``LambdaLR`` so its state is one integer that checkpoints exactly.
"""

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.lr_scheduler import LambdaLR

from miles.config import OptimizerSpec, ScheduleSpec

__all__ = [
    "LR_DECAY_STYLES",
    "apply_optimizer_spec",
    "build_optimizer",
    "build_lr_scheduler",
    "clip_grad_norm_",
    "lr_factor",
]

LR_DECAY_STYLES = ("constant", "cosine")


def build_optimizer(models: list[nn.Module], spec: OptimizerSpec) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``models`` at the spec's learning rate, betas, epsilon and weight
    decay (``--lr``, ``--adam-beta1``, ``--adam-beta2``, ``--adam-eps``, ``--weight-decay``). FSDP2 parameters are
    DTensors; AdamW keeps its state sharded like them. The multi-tensor (``foreach``) update is the same math as the
    per-tensor one (a test pins them to 1e-6).

    Raises:
        ValueError: if no parameter requires grad (a frozen model passed as trainable).
    """
    params = [p for model in models for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the trainable model has no parameter with requires_grad=True; check --hf-checkpoint")
    return torch.optim.AdamW(
        params,
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        # foreach=None falls back to the per-tensor loop for DTensor parameters (on CPU and CUDA alike): one
        # dispatch per op per tensor, 20% of a critic rank's time measured here. torchtitan passes foreach=True too.
        foreach=True,
    )


def lr_factor(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_style: str, total_steps: int) -> float:
    """The multiplier of ``lr`` for optimizer step ``step`` (0-based).

    Warmup: linear, step ``s < warmup_steps`` uses ``lr·(s + 1)/warmup_steps``, so the first step is not wasted at
    lr 0 and step ``warmup_steps − 1`` reaches ``lr``. After warmup, ``constant`` keeps ``lr``; ``cosine`` decays
    from ``lr`` to ``min_lr`` over the remaining ``total_steps − warmup_steps`` steps (Loshchilov & Hutter, SGDR:
    ``min_lr + (lr − min_lr)·(1 + cos(π·p))/2``, p the fraction of decay steps done) and stays at ``min_lr`` after.

    Raises:
        ValueError: on an unknown ``decay_style``.
    """
    if decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"--lr-decay-style {decay_style!r} is not one of {LR_DECAY_STYLES}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_style == "constant" or lr == 0:
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    value = min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return value / lr


def build_lr_scheduler(optimizer: torch.optim.Optimizer, schedule: ScheduleSpec, lr: float) -> LambdaLR:
    """A ``LambdaLR`` of :func:`lr_factor` for the group's learning rate ``lr`` and its schedule (``--min-lr``,
    ``--lr-warmup-steps``, ``--lr-decay-style``, and the horizon: the run's optimizer steps,
    ``num_rollout · steps per rollout``)."""
    factor = partial(
        lr_factor,
        lr=lr,
        min_lr=schedule.min_lr,
        warmup_steps=schedule.warmup_steps,
        decay_style=schedule.decay_style,
        total_steps=schedule.total_steps,
    )
    return LambdaLR(optimizer, factor)


def apply_optimizer_spec(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, spec: OptimizerSpec) -> None:
    """After a checkpoint load: give the optimizer and its schedule this command's settings.

    ``load_state_dict`` restores every param group's ``lr``, ``initial_lr``, ``betas``, ``eps`` and
    ``weight_decay``, and the schedule's ``base_lrs``, as the earlier run had them, so a resume with a new ``--lr`` or
    ``--weight-decay`` would keep the old values without a word. This sets them from the group's spec (the critic's
    learning rate is ``--critic-lr``) and recomputes the current ``lr`` of the schedule's position. With the same
    settings it changes nothing: the values equal the loaded ones bit for bit. The schedule's factor (warmup, decay
    style, ``--min-lr``, horizon) is rebuilt from the spec by :func:`build_lr_scheduler` already.
    """
    for group in optimizer.param_groups:
        group["betas"] = tuple(spec.betas)
        group["eps"] = spec.eps
        group["weight_decay"] = spec.weight_decay
        group["initial_lr"] = spec.lr
    scheduler.base_lrs = [spec.lr for _ in optimizer.param_groups]
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


@torch.no_grad()
def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of ``grads`` (before clipping), scaling them in place to ``max_norm`` when it is > 0 and the
    norm is finite; ``torch.nn.utils.clip_grad_norm_``'s math on FSDP2 gradients without DTensor's dispatch per op.

    FSDP2 shards a gradient on dim 0 over the mesh, so each element lives on one rank. The norm is computed on the
    local shards (plain tensors) the way DTensor computes it, in one all-reduce: each gradient's squared shard norm
    summed over the ranks, its root, then the norm of those. The result and the clipped gradients are bit for bit
    those of ``get_total_norm`` and ``clip_grads_with_norm_`` on the DTensors (``tests/fast/backends/fsdp_utils/
    test_clip.py``), whose dispatch took about 12 ms of each 126 ms critic window of the digits model at 2 ranks in
    a ``--profile-rollouts`` trace (docs/performance.md). Gradients held whole on every rank (a module left
    unsharded) join the norm once.

    Args:
        grads: the trainable parameters' ``.grad`` (float32 DTensors of FSDP2 and/or plain tensors, one device).
        max_norm: ``--clip-grad``; None or <= 0 only measures.

    Returns:
        The norm, a 0-dim float32 tensor on the gradients' device (0 for no gradients).

    Raises:
        NotImplementedError: for a DTensor with a placement other than ``Shard`` (not FSDP2's).
    """
    sharded = [g for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    if any(not isinstance(placement, Shard) for g in sharded for placement in g.placements):
        raise NotImplementedError("clip_grad_norm_ expects FSDP2 gradients, sharded on every mesh dimension")
    shards = [g.to_local() for g in sharded]
    total_norm = torch.nn.utils.get_total_norm(whole, norm_type=2.0, foreach=True)  # 0 without any
    if sharded:
        squares = torch.stack(torch._foreach_norm(shards, 2.0)) ** 2.0
        dist.all_reduce(squares, group=sharded[0].device_mesh.get_group())
        sharded_norm = torch.linalg.vector_norm(squares**0.5, 2.0)
        both = torch.stack([sharded_norm, total_norm.to(sharded_norm)])
        total_norm = torch.linalg.vector_norm(both, 2.0) if whole else sharded_norm
    if grads and max_norm and max_norm > 0:
        # clip_grads_with_norm_'s factor (it takes parameters and scales their .grad, so it cannot take these); 1 for
        # a non-finite norm (the trainer skips that step), chosen on the device: an `if` on the norm would wait for
        # the GPU once per window. Multiplying by 1 leaves every value as it was.
        factor = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(shards + whole, torch.where(torch.isfinite(total_norm), factor, 1.0))
    return total_norm
