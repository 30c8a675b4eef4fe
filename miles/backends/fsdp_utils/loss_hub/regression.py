"""DMD's regression loss: the student's one-step output from a fixed noise pulled toward the teacher's ODE sample.

Yin et al., "One-step Diffusion with Distribution Matching Distillation" (CVPR 2024), §3.3: beside the distribution
matching gradient, the generator regresses ``G(z)`` onto ``y``, the teacher's deterministic (ODE) sample from the
same noise ``z``, on pairs ``(z, y)`` computed once before training (``python -m miles.rollout.regression_pairs``).
DMD2 dropped the term (it ties the student to the teacher's sampler and costs the pairs); here it is an option of
``--loss-type dmd2``, on when ``--dmd2-regression-weight`` is above 0.

The distance is a plain mean squared error over the latent's elements, not DMD's LPIPS: LPIPS needs a VGG or AlexNet
downloaded at run time and an image decoder in the loop, neither of which a latent-space student or this project's
offline tests have; on the bundled 8×8 digits a feature network would see nothing an L2 does not.

Wiring (a hook of the actor's loss, as the GAN and reward terms are):

- the RolloutManager deals one record of ``--dmd2-regression-pairs`` per generated sample (a side input, its own
  seeded shuffle and checkpointed cursor), so each train pair carries ``pair.extras["regression"]``: a data sample
  whose ``x0`` is the teacher's sample ``y`` and whose cond is its prompt's;
- :func:`prepare_generator_regression_batch` appends one row per pair to the student's forward: the pair's noise
  ``z`` (redrawn from its key, :func:`miles.rollout.regression_pairs.regression_noise`) at the student schedule's first timestep, with that prompt's
  cond, so one forward of 2B rows serves both terms;
- :func:`dmd2_regression_loss` gives the first B rows to ``loss_hub.dmd2.dmd2_loss_formula`` unchanged and adds
  ``w · mean((x̂0 − y)²)`` per pair, where ``x̂0 = z − σ_0·v̂`` is the student's one-step output (σ_0 = 1 on every
  shifted grid).
"""

import dataclasses

import torch
from torch import Tensor

from miles.backends.fsdp_utils.loss_hub.dmd2 import dmd2_loss_formula, prepare_generator_batch
from miles.backends.fsdp_utils.loss_hub.dmd2_types import dmd2_settings
from miles.backends.fsdp_utils.loss_hub.types import Metrics, PreparedBatch, TrainContext
from miles.rollout.regression_pairs import INDEX_KEY, SEED_KEY, regression_noise
from miles.utils.sampling import FlowNoiseSchedule, x0_from_velocity
from miles.utils.types import TrainPair, collate_cond

__all__ = [
    "REGRESSION_DATA",
    "dmd2_regression_loss",
    "first_sigma",
    "prepare_generator_regression_batch",
    "regression_loss_per_pair",
]

# The side input's name: each train pair's regression pair (``pair.extras[REGRESSION_DATA]``, a data Sample).
REGRESSION_DATA = "regression"


def first_sigma(args) -> float:
    """σ_0 of the student's sampling schedule (``--diffusion-num-steps`` / ``--diffusion-flow-shift`` /
    ``--diffusion-timesteps``): the noise level its first step starts from, 1 on every shifted grid."""
    schedule = FlowNoiseSchedule(
        args.diffusion_num_steps, args.diffusion_flow_shift, timesteps=args.diffusion_timesteps
    )
    return float(schedule.sigmas[0])


def _regression_sample(pair: TrainPair):
    sample = pair.extras.get(REGRESSION_DATA)
    if sample is None:
        raise ValueError(
            f"train pair {pair.sample_index} carries no regression pair; --dmd2-regression-weight > 0 deals one "
            "record of --dmd2-regression-pairs per sample"
        )
    missing = [key for key in (SEED_KEY, INDEX_KEY) if key not in sample.metadata]
    if missing:
        raise ValueError(
            f"regression pair {sample.prompt!r} of train pair {pair.sample_index} has no {missing[0]!r} field; write "
            "--dmd2-regression-pairs with python -m miles.rollout.regression_pairs"
        )
    return sample


def prepare_generator_regression_batch(ctx: TrainContext, train_pairs: list[TrainPair]) -> PreparedBatch:
    """The student's DMD2 batch (``loss_hub.dmd2.prepare_generator_batch``) plus one regression row per pair.

    Rows ``0..B−1`` are exactly ``prepare_generator_batch``'s; rows ``B..2B−1`` are the pairs' regression noise
    ``z`` (``regression_noise`` of each record's seed and index) at the timestep ``σ_0 · 1000`` of the student's
    first step, with the regression prompt's cond.

    Returns:
        PreparedBatch of 2B rows; ``extras`` adds ``"regression_batch"`` (B), ``"regression_target"`` (the teacher's
        samples ``y``, float32 ``(B, C, H, W)``), ``"regression_noise"`` (``z``, same shape) and
        ``"regression_sigma"`` (σ_0).

    Raises:
        ValueError: if a pair carries no regression pair, or its record has no seed and index.
    """
    base = prepare_generator_batch(ctx, train_pairs)
    samples = [_regression_sample(pair) for pair in train_pairs]
    target = torch.stack([sample.x0 for sample in samples]).float()
    noise = torch.cat(
        [regression_noise(target.shape[1:], int(s.metadata[SEED_KEY]), [int(s.metadata[INDEX_KEY])]) for s in samples]
    )
    sigma = first_sigma(ctx.args)
    batch = len(train_pairs)
    device = ctx.device
    timestep = torch.full((batch,), sigma * 1000.0, dtype=torch.float32, device=device)
    cond = collate_cond([sample.env.pos_cond for sample in samples])
    return PreparedBatch(
        latents=torch.cat([base.latents, noise.to(device)]),
        timestep=torch.cat([base.timestep, timestep]),
        cond={key: torch.cat([base.cond[key], cond[key].to(device)]) for key in base.cond},
        extras={
            **base.extras,
            "regression_batch": batch,
            "regression_target": target.to(device),
            "regression_noise": noise.to(device),
            "regression_sigma": sigma,
        },
        component=base.component,
    )


def regression_loss_per_pair(velocity: torch.Tensor, noise: torch.Tensor, target: torch.Tensor, sigma: float):
    """``(loss, x̂0)``: per pair ``mean((x̂0 − y)²)`` over the latent's elements, ``x̂0 = z − σ_0·v̂`` (float32).

    Args:
        velocity: the student's ``v̂`` at ``(z, σ_0)``, ``(B, C, H, W)``, with grad.
        noise: ``z``, float32 ``(B, C, H, W)``.
        target: the teacher's ODE sample ``y`` from ``z``, float32 ``(B, C, H, W)``.
        sigma: σ_0 in (0, 1].

    Returns:
        float32 ``(B,)`` losses (with grad) and the one-step outputs ``x̂0``; ``∂loss_j/∂x̂0 = 2(x̂0 − y)/numel``.
    """
    x0 = x0_from_velocity(noise.float(), sigma, velocity.float())
    loss = (x0 - target.to(device=x0.device, dtype=torch.float32)).pow(2).flatten(1).mean(dim=1)
    return loss, x0


# The loss-hook signature every --custom-loss-function-path shares (docs/customization.md).
def dmd2_regression_loss(
    ctx: TrainContext, train_pairs: list[TrainPair], prepared: PreparedBatch, *, new_pred: Tensor, metrics: Metrics
) -> Tensor:
    """The student's DMD2 loss plus ``--dmd2-regression-weight`` × DMD's regression loss, summed over the pairs.

    The first B rows of ``new_pred`` and ``prepared`` go to ``loss_hub.dmd2.dmd2_loss_formula`` as if the batch held
    only them (its value, gradient and metrics are those of a run without the term); the last B rows are the
    student's velocities at the regression noise, whose :func:`regression_loss_per_pair` is added with weight w:
    ``loss_j = dmd2_j + w·mean((x̂0_j − y_j)²)``.

    Metrics: ``dmd2_regression_loss`` (the unweighted per-pair mean squared error) beside the DMD2 ones.
    """
    batch = prepared.extras["regression_batch"]
    dmd2_rows = dataclasses.replace(
        prepared,
        latents=prepared.latents[:batch],
        timestep=prepared.timestep[:batch],
        cond={key: value[:batch] for key, value in prepared.cond.items()},
    )
    dm = dmd2_loss_formula(ctx, train_pairs, dmd2_rows, new_pred=new_pred[:batch], metrics=metrics)
    loss, _ = regression_loss_per_pair(
        new_pred[batch:],
        prepared.extras["regression_noise"],
        prepared.extras["regression_target"],
        prepared.extras["regression_sigma"],
    )
    metrics.setdefault("dmd2_regression_loss", []).append(loss.detach())
    return dm + dmd2_settings(ctx.args).regression_weight * loss.sum()
