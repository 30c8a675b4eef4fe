"""DMD2 hooks: the critic group's training and scoring, and the student's distribution-matching step.

The math is that of tianweiy/DMD2 ``compute_distribution_matching_loss`` (Yin et al., "Improved Distribution
Matching Distillation for Fast Image Synthesis", 2024) in flow-matching form, as the upstream miles DMD2 series
specifies it ([DMD2 4/7] critic group and scoring, [DMD2 5/7] generator loss):

- critic ("fake score") steps: the SFT flow-matching loss on the student's ``x̂0_i`` with the positive cond
  (:func:`prepare_critic_batch` + ``sft.sft_loss_formula``);
- scoring (:func:`predict_teacher_and_critic_x0`, the critic group's train-output hook): re-noise ``x̂0_i`` at one σ of
  the ``--fsdp-flow-shift`` grid inside 2–98% of the train timesteps (the reference's t ∈ [20, 980]); the frozen
  teacher predicts with CFG, the critic unguided; both give ``x0 = x_σ − σ·v``;
- student step (:func:`prepare_generator_batch` + :func:`dmd2_loss_formula`): the student recomputes
  ``x0 = x_i − σ_i·v`` at the rollout's stopped step and follows
  ``g = nan_to_num((x̂0_fake − x̂0_real) / mean|x0 − x̂0_real|)`` through the surrogate
  ``0.5·mean((x0 − sg(x0 − g))²)``, whose gradient is ``g / numel``.
"""

import logging
from functools import partial

import torch
from torch import Tensor

from miles.backends.fsdp_utils.loss_hub.dmd2_types import REAL_DATA, DMD2Pair, dmd2_settings
from miles.backends.fsdp_utils.loss_hub.gan import (
    DISC_HEAD,
    disc_loss_terms,
    generator_gan_gradient,
    judge_loss,
    judge_rows,
    pooled_embedding,
    seeded_noise_levels,
)
from miles.backends.fsdp_utils.loss_hub.reward import add_reward_gradient
from miles.backends.fsdp_utils.loss_hub.scoring_sigma import draw_scoring_levels
from miles.backends.fsdp_utils.loss_hub.sft import NUM_TRAIN_TIMESTEPS, prepare_sft_batch, trainer_flow_grid
from miles.backends.fsdp_utils.loss_hub.types import Metrics, PreparedBatch, TrainContext
from miles.backends.fsdp_utils.model import reshard
from miles.models.base import DENOISER
from miles.models.capabilities import TrueCFG, supports
from miles.utils.health import health_figures
from miles.utils.misc import make_generator
from miles.utils.sampling import FlowNoiseSchedule, forward_process, x0_from_velocity
from miles.utils.types import TrainPair, collate_cond

__all__ = [
    "critic_gan_loss",
    "prepare_critic_batch",
    "prepare_critic_gan_batch",
    "scoring_grid_indices",
    "predict_teacher_and_critic_x0",
    "prepare_generator_batch",
    "dmd2_loss_formula",
    "record_rollout_train_abs_diff",
]

logger = logging.getLogger(__name__)

# Guards the x0_rel_max denominator when a rollout x0 is all zeros.
_REL_EPS = 1e-12
# The smallest DMD2 normalizer mean|x0 − x̂0_real| (its per-pair denominator).
NORMALIZER_FLOOR = 1e-6


def prepare_critic_batch(ctx: TrainContext, train_pairs: list[TrainPair]) -> PreparedBatch:
    """The critic's flow-matching batch: SFT on the student's ``x̂0_i`` with the rollout's positive cond.

    Builds SFT-shaped pairs ``(sample_index, x0 = x̂0_i, pos_cond)`` and calls ``sft.prepare_sft_batch``, so the
    critic's inputs, targets and seeds (``"sample"``, seed, rollout, micro-batch, DP rank) are exactly SFT's
    ([DMD2 4/7]). See ``prepare_sft_batch`` for the returned fields.
    """
    sft_pairs = [TrainPair(sample_index=pair.sample_index, x0=pair.x0, pos_cond=pair.pos_cond) for pair in train_pairs]
    return prepare_sft_batch(ctx, sft_pairs)


def prepare_critic_gan_batch(ctx: TrainContext, train_pairs: list[TrainPair]) -> PreparedBatch:
    """Phase 2: the critic's flow-matching batch plus the discriminator's, in one forward of 3B (to 5B) samples.

    Rows ``0..B−1`` are exactly :func:`prepare_critic_batch`'s; rows ``B..2B−1`` are the fakes ``x̂0_i`` and rows
    ``2B..3B−1`` the paired real latents, both noised at diffusion-GAN levels (σ from the scoring range; σ and noise
    from ``make_generator("gan_disc", seed, rollout, micro-batch, DP rank)``: fakes first, then reals), with the
    fakes' positive cond and the reals' own. Then the optional matching-aware and approximate-R1 rows of B each
    (:func:`~miles.backends.fsdp_utils.loss_hub.gan.judge_rows`).

    The critic's one forward then gives the SFT velocity of the first rows and, through the head's feature tap,
    the discriminator's features of the others (:func:`critic_gan_loss`). ``extras["gan_groups"]`` names the
    groups of B rows after the SFT ones.

    The real samples are the pairs' side input ``pair.extras["real"]`` (data ``Sample`` s of
    ``--dmd2-gan-real-data``, one per pair).

    Raises:
        ValueError: if a pair carries no real sample (``--dmd2-gan-real-data`` feeds them).
    """
    missing = [pair.sample_index for pair in train_pairs if REAL_DATA not in pair.extras]
    if missing:
        raise ValueError(
            f"train pairs {missing[:8]} carry no real sample; the DMD2 GAN's critic trains on --dmd2-gan-real-data"
        )
    sft = prepare_critic_batch(ctx, train_pairs)
    grid = trainer_flow_grid(ctx.args)
    allowed = gan_grid_indices(ctx.args, grid)
    fake = torch.stack([pair.x0 for pair in train_pairs]).float()
    real = torch.stack([pair.extras[REAL_DATA].x0 for pair in train_pairs]).float()
    sigma, timestep, noise = seeded_noise_levels(
        ctx, "gan_disc", ctx.microbatch_id, (2 * len(train_pairs), *fake.shape[1:]), grid, allowed
    )
    batch = len(train_pairs)
    gan_latents = forward_process(torch.cat([fake, real]), sigma, noise).to(ctx.device)
    fake_cond = {key: value.to(ctx.device) for key, value in collate_cond([p.pos_cond for p in train_pairs]).items()}
    real_conds = collate_cond([pair.extras[REAL_DATA].env.pos_cond for pair in train_pairs])
    real_cond = {key: value.to(ctx.device) for key, value in real_conds.items()}
    latents, timesteps, conds = (
        [sft.latents, gan_latents],
        [sft.timestep, timestep.to(ctx.device)],
        [fake_cond, real_cond],
    )
    rows, extras = judge_rows(
        ctx, real, gan_latents[batch:], real_cond, sigma[batch:], timestep[batch:].to(ctx.device), noise[batch:]
    )
    groups = ["fake", "real"]
    for name, row_latents, row_timestep, row_cond in rows:
        groups.append(name)
        latents.append(row_latents)
        timesteps.append(row_timestep)
        conds.append(row_cond)
    return PreparedBatch(
        latents=torch.cat(latents),
        timestep=torch.cat(timesteps),
        cond={key: torch.cat([sft.cond[key], *(cond[key] for cond in conds)]) for key in sft.cond},
        target=sft.target,
        extras={**sft.extras, **extras, "gan_batch": batch, "gan_sigma": sigma, "gan_groups": groups},
    )


# The loss-hook signature every --custom-loss-function-path shares (docs/customization.md).
def critic_gan_loss(
    ctx: TrainContext, train_pairs: list[TrainPair], prepared: PreparedBatch, *, new_pred: Tensor, metrics: Metrics
) -> Tensor:
    """Phase 2 critic loss, summed over the micro-batch's pairs: per pair the flow-matching loss of its first B
    rows (``sft_loss_formula``'s) plus ``--dmd2-gan-disc-weight`` × the discriminator's loss
    ``softplus(D(fake)) + softplus(−D(real))`` (tianweiy/DMD2 ``guidance_cls_loss``)
    ``+ w_mismatch · softplus(D(real, another prompt))`` (Reed et al. 2016; pairs without a mismatched prompt in the
    micro-batch add 0) ``+ w_r1 · (D(real) − D(real + α·ε'))²`` (approximate R1). All train the critic backbone;
    the GAN terms also train the head.

    Metrics: ``sft_loss``, ``gan_disc_loss`` (the two-term loss), ``gan_logit_real`` and ``gan_logit_fake`` (mean D
    of each), and with their options ``gan_logit_mismatch`` and ``gan_r1``.
    """
    batch = prepared.extras["gan_batch"]
    groups = prepared.extras.get("gan_groups", ["fake", "real"])
    target = prepared.target.to(device=new_pred.device, dtype=torch.float32)
    sft = (new_pred[:batch].float() - target).pow(2).flatten(1).mean(dim=1)
    head = ctx.models[DISC_HEAD]
    # The tap holds the image tokens of the trainer's forward: rows B.. are the noised fakes, then the reals, then
    # the optional groups.
    pooled = pooled_embedding(head, prepared.cond)
    logits = head([features[batch:] for features in head.tap.features], None if pooled is None else pooled[batch:])
    logit = {name: logits[i * batch : (i + 1) * batch] for i, name in enumerate(groups)}
    disc = disc_loss_terms(logit["fake"], logit["real"])
    settings = dmd2_settings(ctx.args)
    gan = disc + judge_loss(settings, logit, prepared.extras, metrics) if len(groups) > 2 else disc
    weight = settings.gan_disc_weight
    metrics.setdefault("sft_loss", []).append(sft.detach())
    metrics.setdefault("gan_disc_loss", []).append(disc.detach())
    metrics.setdefault("gan_logit_real", []).append(logit["real"].detach())
    metrics.setdefault("gan_logit_fake", []).append(logit["fake"].detach())
    return (sft + weight * gan).sum()


def gan_grid_indices(args, grid: FlowNoiseSchedule) -> torch.Tensor:
    """Indices of the trainer grid the diffusion-GAN noise is drawn from: the scoring range with its top at
    ``--dmd2-gan-max-timestep-ratio`` (tianweiy/DMD2's ``diffusion_gan_max_timestep``; small images are unreadable
    at high noise, so a discriminator there learns nothing).

    Raises:
        ValueError: if no grid point falls in the range.
    """
    ratio = dmd2_settings(args).gan_max_timestep_ratio
    return scoring_grid_indices(args, grid, max_ratio=ratio, max_flag="--dmd2-gan-max-timestep-ratio")


def scoring_grid_indices(
    args, grid: FlowNoiseSchedule, max_ratio: float | None = None, max_flag: str = "--dmd2-max-timestep-ratio"
) -> torch.Tensor:
    """Indices (int64, ascending) of the trainer grid whose timestep lies in the DMD2 scoring range.

    The range is ``[--dmd2-min-timestep-ratio, --dmd2-max-timestep-ratio] · 1000`` (2–98% by default, tianweiy/DMD2's
    ``min_step = 0.02·T``, ``max_step = 0.98·T``).

    Raises:
        ValueError: if no grid point falls in the range.
    """
    settings = dmd2_settings(args)
    low = settings.min_timestep_ratio * NUM_TRAIN_TIMESTEPS
    high = (settings.max_timestep_ratio if max_ratio is None else max_ratio) * NUM_TRAIN_TIMESTEPS
    allowed = torch.nonzero((grid.timesteps >= low) & (grid.timesteps <= high)).flatten()
    if len(allowed) == 0:
        raise ValueError(
            f"no timestep of the --fsdp-flow-shift {args.fsdp_flow_shift} grid lies in "
            f"[{low:g}, {high:g}]; widen --dmd2-min-timestep-ratio / {max_flag}"
        )
    return allowed


def _check_negative_conds(train_pairs: list[TrainPair], guidance_scale: float) -> None:
    missing = [pair.sample_index for pair in train_pairs if not pair.neg_cond]
    if missing:
        shown = ", ".join(str(index) for index in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ValueError(
            f"--dmd2-teacher-guidance-scale {guidance_scale:g} runs teacher CFG over the negative prompt, but samples "
            f"[{shown}] carry no negative cond; make the engine encode --negative-prompt for dmd2 rollouts, "
            "or set --dmd2-teacher-guidance-scale 1"
        )


def predict_teacher_and_critic_x0(ctx: TrainContext, train_pairs: list[TrainPair]) -> dict[str, torch.Tensor]:
    """Score the student's samples with the frozen teacher (CFG) and the critic (unguided): the critic group's output.

    Runs after the critic's K steps (or before its last one with ``--dmd2-critic-scoring original``), under no grad,
    over this rank's whole DP shard, in micro-batches of ``--micro-batch-size`` pairs with ids ``0, 1, ...``. Per
    micro-batch ``m``, one generator ``make_generator("dmd2_score", args.seed, ctx.rollout_id, m, ctx.dp_rank)``
    draws first the noise levels (``--dmd2-scoring-sigma``,
    :func:`~miles.backends.fsdp_utils.loss_hub.scoring_sigma.draw_scoring_levels`; by default uniform over
    :func:`scoring_grid_indices`) and then the noise ``ε``; then ``x_σ = (1 − σ)·x̂0_i + σ·ε`` and
    ``x0 = x_σ − σ·v`` (float32) for the teacher and the critic.

    This is the scoring half of tianweiy/DMD2 ``compute_distribution_matching_loss`` (real score with CFG, fake
    score without), see [DMD2 4/7]. The teacher is guided in its family's form (``family.guided_velocity``): true
    CFG over the pairs' negative cond (with the stock sampler's per-token norm rescale when the settings ask for it:
    Qwen-Image), or the scale as an input for a guidance-distilled teacher. Both models are resharded afterwards,
    also on error.

    Args:
        ctx: reads ``teacher_models[DENOISER]`` (frozen teacher; both experts of a two-expert one behind one module,
            :class:`~miles.models.experts.ExpertSwitch`), ``models[DENOISER]`` (the critic), ``family``
            (its guidance form: true CFG or embedded guidance, :mod:`miles.models.capabilities`), ``args.seed``,
            ``args.fsdp_flow_shift``, ``args.micro_batch_size``, the DMD2 settings' teacher guidance scale and
            norm rescale, scoring range and scoring σ rule, ``rollout_id`` and ``dp_rank``.
        train_pairs: this rank's DMD2 pairs; ``x0`` is the rollout's ``x̂0_i`` float32 ``(C, H, W)``.

    It also appends the shard's collapse-alarm figures (:func:`miles.utils.health.health_figures` of the student's
    x̂0_i against the teacher's predictions) to ``ctx.metrics``, logged as ``health/*``.

    With the GAN head (phase 2, ``ctx.models["disc_head"]``) it also computes, per pair, the generator's GAN
    gradient ``g_gan = ∂ softplus(−D(noise(x̂0_i))) / ∂x̂0_i`` by autograd through the critic and the head (their
    weights untouched; σ and noise from ``make_generator("gan_gen", seed, rollout, micro-batch, DP rank)``).

    Returns:
        On the CPU, in the shard's order: ``{"sample_index": int64 (N,), "x0_real": float32 (N, C, H, W) (teacher),
        "x0_fake": float32 (N, C, H, W) (critic), "sigma": float64 (N,) in [0, 1]}``, plus with the GAN head
        ``"g_gan": float32 (N, C, H, W)`` and ``"gan_logit_fake": float32 (N,)``.

    Raises:
        ValueError: with no pairs, without a teacher, or when the teacher runs CFG (guidance ≠ 1) and a pair has an
            empty negative cond (names ``--dmd2-teacher-guidance-scale`` and the negative prompt).
    """
    if not train_pairs:
        raise ValueError("predict_teacher_and_critic_x0 got no train pairs; the critic group's DP shard is empty")
    if DENOISER not in ctx.teacher_models:
        raise ValueError(
            f"DMD2 scoring needs the frozen teacher in the critic group (ctx.teacher_models[{DENOISER!r}]); "
            "set --teacher-load"
        )
    args = ctx.args
    teacher = ctx.teacher_models[DENOISER]
    critic = ctx.models[DENOISER]
    settings = dmd2_settings(args)
    guidance_scale = settings.teacher_guidance_scale
    # Only true CFG runs an unconditional branch; an embedded-guidance teacher takes the scale as an input.
    true_cfg = supports(ctx.family, TrueCFG)
    if guidance_scale != 1.0 and true_cfg:
        _check_negative_conds(train_pairs, guidance_scale)
    # the stock sampler's per-token norm rescale (Qwen-Image), passed only when asked for: a family's own
    # guided_velocity need not take the keyword
    rescale = {"norm_rescale": True} if settings.teacher_cfg_norm_rescale and guidance_scale != 1.0 else {}
    grid = trainer_flow_grid(args)
    # The continuous rules draw σ in the range itself; only the grid rule needs grid points inside it.
    allowed = scoring_grid_indices(args, grid) if settings.scoring_sigma == "grid" else None
    micro_batch_size = args.micro_batch_size

    gan = DISC_HEAD in ctx.models
    gan_allowed = gan_grid_indices(args, grid) if gan else None
    x0_real_parts, x0_fake_parts, sigma_parts, gan_parts, logit_parts = [], [], [], [], []
    try:
        with torch.no_grad():
            for microbatch_id, start in enumerate(range(0, len(train_pairs), micro_batch_size)):
                chunk = train_pairs[start : start + micro_batch_size]
                x0_hat = torch.stack([pair.x0 for pair in chunk]).float()
                generator = make_generator("dmd2_score", args.seed, ctx.rollout_id, microbatch_id, ctx.dp_rank)
                sigma, timestep, noise = draw_scoring_levels(settings, generator, grid, x0_hat.shape, allowed)
                x_sigma = forward_process(x0_hat, sigma, noise)
                sigma_b = sigma.float().view(-1, *([1] * (x0_hat.ndim - 1)))

                pos_cond = collate_cond([pair.pos_cond for pair in chunk])
                neg_cond = (
                    collate_cond([pair.neg_cond for pair in chunk]) if guidance_scale != 1.0 and true_cfg else None
                )
                v_real = ctx.family.guided_velocity(
                    partial(ctx.predict_velocity, teacher),
                    x_sigma,
                    timestep,
                    pos_cond,
                    neg_cond,
                    guidance_scale,
                    **rescale,
                )
                v_fake = ctx.predict_velocity(critic, x_sigma, timestep, pos_cond)
                x0_real_parts.append(x0_from_velocity(x_sigma, sigma_b, v_real.cpu()))
                x0_fake_parts.append(x0_from_velocity(x_sigma, sigma_b, v_fake.cpu()))
                sigma_parts.append(sigma)
                if gan:
                    levels = seeded_noise_levels(ctx, "gan_gen", microbatch_id, x0_hat.shape, grid, gan_allowed)
                    g_gan, logits = generator_gan_gradient(ctx, x0_hat.to(ctx.device), pos_cond, *levels)
                    gan_parts.append(g_gan.cpu())
                    logit_parts.append(logits.cpu())
    finally:
        for model in [*ctx.teacher_models.values(), *ctx.models.values()]:
            # FSDP2 keeps a root gathered after a no_grad forward; sleep would then move full weights.
            reshard(model)

    logger.debug(
        "rollout %d dp rank %d: scored %d samples (teacher guidance %g) in %d micro-batches",
        ctx.rollout_id,
        ctx.dp_rank,
        len(train_pairs),
        guidance_scale,
        len(sigma_parts),
    )
    if ctx.metrics is not None:
        # The collapse alarms' figures: the student's samples against the teacher's predictions of them.
        student = torch.stack([pair.x0 for pair in train_pairs]).float()
        for name, value in health_figures(student, torch.cat(x0_real_parts), [p.prompt for p in train_pairs]).items():
            ctx.metrics.setdefault(name, []).append(value)
    scores = {
        "sample_index": torch.tensor([pair.sample_index for pair in train_pairs], dtype=torch.long),
        "x0_real": torch.cat(x0_real_parts),
        "x0_fake": torch.cat(x0_fake_parts),
        "sigma": torch.cat(sigma_parts),
    }
    if gan:
        scores["g_gan"] = torch.cat(gan_parts)
        scores["gan_logit_fake"] = torch.cat(logit_parts)
    return scores


def _single_component(ctx: TrainContext) -> str:
    if len(ctx.models) != 1:
        raise ValueError(
            f"--loss-type dmd2 trains the student as a single DiT component, got trainable components "
            f"{sorted(ctx.models)}; train one denoiser per student"
        )
    return next(iter(ctx.models))


def prepare_generator_batch(ctx: TrainContext, train_pairs: list[DMD2Pair]) -> PreparedBatch:
    """The student's unguided forward at the rollout's stopped step ``(x_i, t_i)`` with the positive cond.

    Args:
        train_pairs: DMD2 pairs from ``data_conversion_hub.dmd2``; each has ``latent`` (``x_i``, float32
            ``(C, H, W)``), ``sigma`` (``σ_i`` in [0, 1]), ``timestep`` (``t_i`` in [0, 1000]) and ``x0``
            (the rollout's ``x̂0_i``).

    Returns:
        PreparedBatch with ``latents`` ``x_i`` float32 ``(B, C, H, W)``, ``timestep`` float32 ``(B,)``, the collated
        positive ``cond``, no target, ``component`` = the single trainable component, and ``extras`` =
        ``{"sigma": float64 (B,), "rollout_x0": float32 (B, C, H, W), "sample_index": int64 (B,)}``.

    Raises:
        ValueError: if ``ctx.models`` holds more than one trainable component, or a pair is not a ``DMD2Pair``.
    """
    component = _single_component(ctx)
    for pair in train_pairs:
        if not isinstance(pair, DMD2Pair):
            raise ValueError(
                f"train pair of sample {pair.sample_index} is a {type(pair).__name__}, not a DMD2Pair (no stopped "
                "step); --loss-type dmd2 needs the pairs of miles.ray.data_conversion_hub.dmd2.expand_samples_to_train_pairs"
            )
    device = ctx.device
    return PreparedBatch(
        latents=torch.stack([pair.latent for pair in train_pairs]).float().to(device),
        timestep=torch.tensor([pair.timestep for pair in train_pairs], dtype=torch.float32, device=device),
        cond={key: value.to(device) for key, value in collate_cond([p.pos_cond for p in train_pairs]).items()},
        extras={
            "sigma": torch.tensor([pair.sigma for pair in train_pairs], dtype=torch.float64, device=device),
            "rollout_x0": torch.stack([pair.x0 for pair in train_pairs]).float().to(device),
            "sample_index": torch.tensor([pair.sample_index for pair in train_pairs], dtype=torch.long),
        },
        component=component,
    )


def record_rollout_train_abs_diff(metrics: Metrics, prefix: str, train: torch.Tensor, rollout: torch.Tensor) -> None:
    """Append per-pair gaps between a trainer-side tensor and its rollout counterpart to ``metrics``.

    For each pair j (first dim): ``<prefix>_mean_abs_diff`` = mean|train − rollout|, ``<prefix>_max_abs_diff`` =
    max|train − rollout| and ``<prefix>_rel_max`` = max|train − rollout| / max(max|rollout|, 1e-12). The gap is
    pure rollout/train numerics when both ran the same weights on the same input.

    Args:
        train, rollout: tensors of the same shape ``(B, ...)``; compared in float32, detached.
    """
    train = train.detach().float()
    rollout = rollout.detach().to(device=train.device, dtype=torch.float32)
    diff = (train - rollout).abs().flatten(1)
    max_diff = diff.max(dim=1).values
    scale = rollout.abs().flatten(1).max(dim=1).values.clamp_min(_REL_EPS)
    metrics.setdefault(f"{prefix}_mean_abs_diff", []).append(diff.mean(dim=1).detach())
    metrics.setdefault(f"{prefix}_max_abs_diff", []).append(max_diff.detach())
    metrics.setdefault(f"{prefix}_rel_max", []).append((max_diff / scale).detach())


def _critic_scores(ctx: TrainContext, sample_index: torch.Tensor, device: torch.device):
    scores = ctx.external_data.get("critic")
    if scores is None:
        raise RuntimeError(
            "ctx.external_data has no 'critic' output; --loss-type dmd2 must train the critic group (with the "
            "train-output hook loss_hub.dmd2.predict_teacher_and_critic_x0) before the actor"
        )
    row_of = {index: row for row, index in enumerate(scores["sample_index"].tolist())}
    rows = []
    for index in sample_index.tolist():
        if index not in row_of:
            raise RuntimeError(
                f"the critic group's scores have no sample {index}; the paired critic and actor ranks must hold "
                "the same DP shard of the rollout"
            )
        rows.append(row_of[index])
    rows = torch.tensor(rows, dtype=torch.long)
    x0_real = scores["x0_real"][rows].to(device=device, dtype=torch.float32)
    x0_fake = scores["x0_fake"][rows].to(device=device, dtype=torch.float32)
    g_gan = scores["g_gan"][rows].to(device=device, dtype=torch.float32) if "g_gan" in scores else None
    return x0_real, x0_fake, g_gan


# The loss-hook signature every --custom-loss-function-path shares (docs/customization.md).
def dmd2_loss_formula(
    ctx: TrainContext, train_pairs: list[TrainPair], prepared: PreparedBatch, *, new_pred: Tensor, metrics: Metrics
) -> Tensor:
    """DMD2 generator surrogate, summed over the micro-batch's pairs ([DMD2 5/7]).

    Per pair j, with ``x0 = x_i − σ_i·v̂`` (float32) and the critic group's ``x̂0_real`` / ``x̂0_fake``:
    ``g = nan_to_num((x̂0_fake − x̂0_real) / max(mean|x0 − x̂0_real|, 1e-6))`` (normalizer over (C, H, W), detached;
    non-finite ratios become 0) and
    ``loss_j = 0.5·mean((x0 − sg(x0 − g))²)``, so ``∂loss_j/∂x0 = g / numel``. tianweiy/DMD2
    ``compute_distribution_matching_loss`` computes the same g (its ``p_real − p_fake``) and a batch-mean MSE, which
    the trainer's division by the window's pair count reproduces. The value, ``0.5·mean(g²)``, is a gradient size,
    not a convergence measure.

    Args:
        new_pred: the student's velocity ``v̂``, float32 ``(B, C, H, W)``, with grad.
        prepared: from :func:`prepare_generator_batch` (``latents`` = ``x_i``, ``extras["sigma"]``,
            ``extras["rollout_x0"]``, ``extras["sample_index"]``).
        metrics: appends per pair ``dmd2_loss``, ``dmd2_grad_abs_mean``, ``dmd2_nonfinite_frac`` (share of g entries
            that ``nan_to_num`` replaced), the ``x0_*`` gaps of :func:`record_rollout_train_abs_diff`, and with the
            reward group the figures of :func:`~miles.backends.fsdp_utils.loss_hub.reward.add_reward_gradient`.

    Raises:
        RuntimeError: if ``ctx.external_data["critic"]`` is missing or lacks one of the batch's sample indices.
    """
    device = new_pred.device
    v = new_pred.float()
    latents = prepared.latents.to(device=device, dtype=torch.float32)
    sigma = prepared.extras["sigma"].to(device=device, dtype=torch.float32).view(-1, *([1] * (v.ndim - 1)))
    x0 = latents - sigma * v
    x0_real, x0_fake, g_gan = _critic_scores(ctx, prepared.extras["sample_index"], device)
    settings = dmd2_settings(ctx.args)
    gan_weight = settings.gan_gen_weight
    if isinstance(ctx.rollout_id, int) and ctx.rollout_id < settings.gan_start_rollout:
        # The GAN phase starts once the distribution-matching term has converged (tianweiy/DMD2's ImageNet recipe
        # adds the GAN to a converged student); the head trains from the start, so it is ready by then.
        gan_weight = 0.0

    reduce_dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        # The floor keeps a zero normalizer (student equal to the teacher's x0) from dividing by 0; FastGen adds
        # 1e-6 instead, the floor leaves every normalizer above it bit-identical.
        normalizer = (x0.detach() - x0_real).abs().mean(dim=reduce_dims, keepdim=True).clamp_min(NORMALIZER_FLOOR)
        ratio = (x0_fake - x0_real) / normalizer
        nonfinite = ~torch.isfinite(ratio)
        # ±inf and NaN entries contribute no gradient (nan_to_num's ±3.4e38 would overflow the surrogate's square).
        grad = torch.nan_to_num(ratio, nan=0.0, posinf=0.0, neginf=0.0)
        dm_grad = grad
        if g_gan is not None and gan_weight > 0:
            # ∂loss/∂x0 = g/numel + w·g_gan: tianweiy/DMD2's loss_dm (a mean) + gen_cls_loss_weight · gen_cls_loss.
            grad = grad + gan_weight * x0[0].numel() * g_gan
        # DMDR: − w·numel·∂r/∂x̂0 from the reward group (loss_hub.reward); grad itself when the weight is 0.
        grad = add_reward_gradient(ctx, dm_grad, grad, prepared.extras["sample_index"], metrics)
    per_pair = 0.5 * (x0 - (x0 - grad).detach()).pow(2).mean(dim=reduce_dims)

    metrics.setdefault("dmd2_loss", []).append(per_pair.detach())
    metrics.setdefault("dmd2_grad_abs_mean", []).append(grad.abs().flatten(1).mean(dim=1).detach())
    metrics.setdefault("dmd2_nonfinite_frac", []).append(nonfinite.flatten(1).float().mean(dim=1).detach())
    if g_gan is not None:
        gan_step = gan_weight * x0[0].numel() * g_gan
        ratio_norm = gan_step.flatten(1).norm(dim=1) / dm_grad.flatten(1).norm(dim=1).clamp_min(_REL_EPS)
        metrics.setdefault("dmd2_gan_grad_abs_mean", []).append(g_gan.abs().flatten(1).mean(dim=1).detach())
        metrics.setdefault("dmd2_gan_dm_grad_ratio", []).append(ratio_norm.detach())
    record_rollout_train_abs_diff(metrics, "x0", x0, prepared.extras["rollout_x0"])
    return per_pair.sum()
