"""DMD2 + reward (DMDR): a frozen reward model's gradient added to the student's distribution-matching step.

DMDR (Jiang et al., "Distribution Matching Distillation Meets Reinforcement Learning", arXiv 2511.13649) adds a
reward objective to DMD's: the generator minimises ``L_DM − w·r(x̂0)``. Here the reward lives in its own trainer
group, ``reward`` (no optimizer, no checkpoint: :class:`~miles.backends.fsdp_utils.frozen_trainer.FrozenGroupRunner`),
that runs between the critic and the actor:

- reward group, train-output hook :func:`reward_gradient`: per pair, the student's rollout ``x̂0_i`` is decoded to
  pixels through the family's differentiable decoder (:class:`~miles.models.capabilities.DifferentiablePixels`), the
  reward hook ``--dmd2-reward-function-path`` scores them, and autograd gives each pair's own ``∂r_j/∂x̂0_j`` (the
  gradient of the sum of the batch's rewards, which the pairs do not share), shipped to the actor by sample index
  exactly as the critic ships its x0 predictions;
- actor, inside ``loss_hub.dmd2.dmd2_loss_formula`` (:func:`add_reward_gradient`): the distribution-matching
  ``g`` (whose surrogate has ``∂loss_j/∂x0 = g/numel``) becomes ``g − w·numel·∂r/∂x̂0``, so
  ``∂loss_j/∂x0 = g/numel − w·∂r_j/∂x̂0``: a step that raises the reward, ``--dmd2-reward-weight`` w.

The reward hook: ``fn(images, prompts) -> rewards`` with ``images`` float32 ``(B, C, H, W)`` in [0, 1] (0 black, not
clipped) on the group's device and with autograd, ``prompts`` the pairs' prompt strings, ``rewards`` float ``(B,)``,
differentiable in ``images``; higher is better. The digits one is :func:`miles.eval.digits.reward.digit_log_prob`.
"""

import logging
from collections.abc import Callable

import torch

from miles.backends.fsdp_utils.loss_hub.dmd2_types import dmd2_settings
from miles.backends.fsdp_utils.loss_hub.types import Metrics, TrainContext
from miles.models.capabilities import DifferentiablePixels, require
from miles.utils.types import TrainPair

__all__ = ["REWARD_ROLE", "add_reward_gradient", "reward_gradient", "score_and_gradient"]

logger = logging.getLogger(__name__)

# The reward group's role: its trainer group's name and its key in the actor's ctx.external_data.
REWARD_ROLE = "reward"
# Guards the ratio's denominator when the DM gradient is all zeros.
_EPS = 1e-12


def score_and_gradient(family, fn, x0: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r, ∂r/∂x0)`` of one batch: ``r = fn(family.latents_to_pixels(x0), prompts)``.

    Args:
        family: a family with :class:`~miles.models.capabilities.DifferentiablePixels`.
        fn: the reward hook (module docstring).
        x0: latents float ``(B, *latent_shape)``; detached here, the gradient's leaf.

    Returns:
        ``(rewards float32 (B,), gradient float32 (B, *latent_shape))``, detached; row j of the gradient is
        ``∂r_j/∂x0_j`` (autograd of ``Σ_j r_j``, whose pairs are independent).

    Raises:
        ValueError: if the hook returns something else than one finite-shaped reward per image.
    """
    with torch.enable_grad():
        leaf = x0.detach().float().requires_grad_(True)
        rewards = fn(family.latents_to_pixels(leaf), list(prompts))
        if not isinstance(rewards, torch.Tensor) or rewards.shape != (len(leaf),):
            shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
            raise ValueError(f"the reward hook returned {shape}; expected a float tensor of shape ({len(leaf)},)")
        if not rewards.requires_grad:
            raise ValueError("the reward hook's rewards carry no gradient; compute them from the images with autograd")
        (grad,) = torch.autograd.grad(rewards.float().sum(), leaf)
    return rewards.detach().float(), grad.detach().float()


def reward_gradient(ctx: TrainContext, train_pairs: list[TrainPair], *, reward: Callable) -> dict[str, torch.Tensor]:
    """The reward group's train-output hook: each pair's reward and its gradient at the student's rollout ``x̂0_i``.

    Runs over this rank's whole DP shard in micro-batches of ``--micro-batch-size`` (no random draw: the reward is a
    deterministic function of ``x̂0_i``). The actor logs the rewards (``train/dmd2_reward``).

    Args:
        ctx: reads ``args.micro_batch_size``, ``family`` (its
            :class:`~miles.models.capabilities.DifferentiablePixels`) and ``device``.
        train_pairs: this rank's DMD2 pairs; ``x0`` is the rollout's ``x̂0_i``, float32 ``(C, H, W)``; ``prompt``.
        reward: ``--dmd2-reward-function-path``'s ``fn(images, prompts) -> rewards``, which the reward group binds
            (the driver imports it once).

    Returns:
        On the CPU, in the shard's order: ``{"sample_index": int64 (N,), "reward": float32 (N,), "g_reward":
        float32 (N, C, H, W)}``, ``g_reward[j] = ∂r_j/∂x̂0_j``.

    Raises:
        ValueError: with no pairs, for a family without a differentiable decoder, or for a
            hook that returns no per-image differentiable rewards.
    """
    if not train_pairs:
        raise ValueError("reward_gradient got no train pairs; the reward group's DP shard is empty")
    require(ctx.family, DifferentiablePixels, "the DMD2 reward group (--dmd2-reward-weight)")
    size = ctx.args.micro_batch_size
    rewards, grads = [], []
    for start in range(0, len(train_pairs), size):
        chunk = train_pairs[start : start + size]
        x0 = torch.stack([pair.x0 for pair in chunk]).float().to(ctx.device)
        scores, grad = score_and_gradient(ctx.family, reward, x0, [pair.prompt for pair in chunk])
        rewards.append(scores.cpu())
        grads.append(grad.cpu())
    return {
        "sample_index": torch.tensor([pair.sample_index for pair in train_pairs], dtype=torch.long),
        "reward": torch.cat(rewards),
        "g_reward": torch.cat(grads),
    }


def _reward_rows(ctx: TrainContext, sample_index: torch.Tensor, device: torch.device):
    scores = ctx.external_data.get(REWARD_ROLE)
    if scores is None:
        raise RuntimeError(
            f"ctx.external_data has no {REWARD_ROLE!r} output; --dmd2-reward-weight > 0 must train the reward group "
            "(train-output hook loss_hub.reward.reward_gradient) before the actor"
        )
    row_of = {index: row for row, index in enumerate(scores["sample_index"].tolist())}
    missing = [index for index in sample_index.tolist() if index not in row_of]
    if missing:
        raise RuntimeError(
            f"the reward group's output has no sample {missing[0]}; the paired reward and actor ranks must hold the "
            "same DP shard of the rollout"
        )
    rows = torch.tensor([row_of[index] for index in sample_index.tolist()], dtype=torch.long)
    return scores["reward"][rows].float(), scores["g_reward"][rows].to(device=device, dtype=torch.float32)


def add_reward_gradient(
    ctx: TrainContext,
    dm_grad: torch.Tensor,
    grad: torch.Tensor,
    sample_index: torch.Tensor,
    metrics: Metrics,
) -> torch.Tensor:
    """The actor's side: ``grad − w·numel·∂r/∂x̂0`` per pair (``w`` = ``--dmd2-reward-weight``), ``grad`` unchanged
    with weight 0 (the reward group then does not exist).

    ``grad`` is the surrogate's target gradient ``g`` (``∂loss_j/∂x0 = g/numel``, numel = one pair's element count),
    so the step follows ``g/numel − w·∂r_j/∂x̂0_j``: it maximises the reward.

    Args:
        dm_grad: the distribution-matching ``g`` alone, float32 ``(B, C, H, W)`` (for the ratio figure).
        grad: ``g`` with any other term already added (the GAN's), same shape.
        sample_index: int64 ``(B,)``, the micro-batch's samples (rows of the reward group's output).
        metrics: appends per pair ``dmd2_reward`` (its reward) and ``dmd2_reward_dm_grad_ratio``
            (``‖w·numel·∂r/∂x̂0‖ / ‖g_DM‖``, like ``dmd2_gan_dm_grad_ratio``).

    Raises:
        RuntimeError: if the reward group's output is missing or lacks one of the samples.
    """
    weight = dmd2_settings(ctx.args).reward_weight
    if weight <= 0:
        return grad
    reward, g_reward = _reward_rows(ctx, sample_index, grad.device)
    step = weight * grad[0].numel() * g_reward
    ratio = step.flatten(1).norm(dim=1) / dm_grad.flatten(1).norm(dim=1).clamp_min(_EPS)
    metrics.setdefault("dmd2_reward", []).append(reward.detach())
    metrics.setdefault("dmd2_reward_dm_grad_ratio", []).append(ratio.detach())
    return grad - step
