"""Flow-matching SFT hooks: the velocity regression every flow-matching DiT (SD3, digits) is trained with.

Formula (SD3 paper §2, diffusers ``train_dreambooth_sd3``, torchtitan's Flux trainer): draw σ from the trainer's
shifted grid, ``x_σ = (1 − σ)·x0 + σ·ε``, the model input ``timestep = σ · 1000`` and the target velocity
``v = ε − x0``; the loss is the mean squared error between the predicted and target velocity.

Both hooks also serve the DMD2 critic group, whose ``prepare_critic_batch`` builds SFT-shaped pairs from the
student's ``x̂0_i`` and calls :func:`prepare_sft_batch`.
"""

import torch
from torch import Tensor

from miles.backends.fsdp_utils.loss_hub.types import Metrics, PreparedBatch, TrainContext
from miles.utils.misc import make_generator
from miles.utils.sampling import FlowNoiseSchedule, draw_noise_levels, forward_process
from miles.utils.types import TrainPair, collate_cond

__all__ = ["NUM_TRAIN_TIMESTEPS", "trainer_flow_grid", "prepare_sft_batch", "sft_loss_formula"]

# SD3 and digits both scale σ to the model's timestep input by 1000; the trainer's grid has one point per timestep.
NUM_TRAIN_TIMESTEPS = 1000


def trainer_flow_grid(args) -> FlowNoiseSchedule:
    """The trainer's σ grid: ``NUM_TRAIN_TIMESTEPS`` points at ``--fsdp-flow-shift`` (sigmas float64, descending)."""
    return FlowNoiseSchedule(NUM_TRAIN_TIMESTEPS, args.fsdp_flow_shift, num_train_timesteps=NUM_TRAIN_TIMESTEPS)


def prepare_sft_batch(ctx: TrainContext, train_pairs: list[TrainPair]) -> PreparedBatch:
    """Noise each pair's clean latent at a random σ of the trainer grid and set the velocity target.

    One generator per micro-batch, ``make_generator("sample", args.seed, ctx.rollout_id, ctx.microbatch_id,
    ctx.dp_rank)``, draws first the B grid indices (uniform in ``[0, N)``, int64) and then the noise ``ε`` (float32
    ``(B, C, H, W)``), always in that order and on the CPU, so a resumed run or a 2-rank run repeats them exactly.
    With ``--sft-uncond-prob p > 0`` it then draws one uniform per pair and trains the pairs below ``p`` on their
    ``neg_cond`` (classifier-free guidance training, Ho & Salimans 2022), so the model learns the unconditional
    velocity that CFG needs.

    Args:
        ctx: the trainer context; reads ``args.seed``, ``args.fsdp_flow_shift``, ``rollout_id``, ``microbatch_id``,
            ``dp_rank`` and ``device``.
        train_pairs: the micro-batch; each pair's ``x0`` is float32 ``(C, H, W)`` and ``pos_cond`` its prompt.

    Returns:
        PreparedBatch with ``latents`` = ``x_σ`` float32 ``(B, C, H, W)``, ``timestep`` float32 ``(B,)`` in
        [0, 1000], ``cond`` the collated positive cond, ``target`` = ``ε − x0`` float32 ``(B, C, H, W)`` and
        ``extras`` = ``{"sigma": float64 (B,), "noise": (B, C, H, W), "x0": (B, C, H, W), "grid_index": int64 (B,)}``.

    Raises:
        ValueError: for an empty micro-batch or pairs whose conds do not share keys.
    """
    if not train_pairs:
        raise ValueError("prepare_sft_batch got an empty micro-batch; check --micro-batch-size and the DP split")
    args = ctx.args
    grid = trainer_flow_grid(args)
    x0 = torch.stack([pair.x0 for pair in train_pairs]).float()
    generator = make_generator("sample", args.seed, ctx.rollout_id, ctx.microbatch_id, ctx.dp_rank)
    grid_index, sigma, timestep, noise = draw_noise_levels(generator, grid, x0.shape)
    latents = forward_process(x0, sigma, noise)
    target = noise - x0
    conds = [pair.pos_cond for pair in train_pairs]
    uncond_prob = args.sft_uncond_prob
    if uncond_prob > 0:
        # Drawn after the noise so that runs without conditioning dropout keep their exact draws.
        drop = torch.rand(len(train_pairs), generator=generator) < uncond_prob
        conds = [_uncond(pair) if dropped else cond for pair, cond, dropped in zip(train_pairs, conds, drop.tolist())]
    device = ctx.device
    return PreparedBatch(
        latents=latents.to(device),
        timestep=timestep.to(device),
        cond={key: value.to(device) for key, value in collate_cond(conds).items()},
        target=target.to(device),
        extras={
            "sigma": sigma.to(device),
            "noise": noise.to(device),
            "x0": x0.to(device),
            "grid_index": grid_index.to(device),
        },
    )


def _uncond(pair: TrainPair) -> dict[str, torch.Tensor]:
    if not pair.neg_cond:
        raise ValueError(
            f"--sft-uncond-prob needs the negative prompt's cond, but sample {pair.sample_index} has none; "
            "the RolloutManager encodes --negative-prompt when --sft-uncond-prob > 0"
        )
    return pair.neg_cond


# The loss-hook signature every --custom-loss-function-path shares (docs/customization.md).
def sft_loss_formula(
    ctx: TrainContext, train_pairs: list[TrainPair], prepared: PreparedBatch, *, new_pred: Tensor, metrics: Metrics
) -> Tensor:
    """Flow-matching MSE ``mean((v̂ − v)²)`` per pair, summed over the micro-batch's pairs.

    The trainer divides the sum by the optimizer window's pair count, so a window's loss is the mean over its pairs
    however it is split into micro-batches.

    Args:
        new_pred: the model's velocity ``v̂``, float32 ``(B, C, H, W)``.
        prepared: the batch of :func:`prepare_sft_batch`; ``prepared.target`` is ``v = ε − x0``.
        metrics: appends the ``"sft_loss"`` values of the pairs, a detached float32 ``(B,)`` tensor on the device
            (the trainer reads a window's figures to the host at once).

    Returns:
        A float32 scalar: the sum over pairs of each pair's mean squared velocity error.
    """
    target = prepared.target.to(device=new_pred.device, dtype=torch.float32)
    per_pair = (new_pred.float() - target).pow(2).flatten(1).mean(dim=1)
    metrics.setdefault("sft_loss", []).append(per_pair.detach())
    return per_pair.sum()
