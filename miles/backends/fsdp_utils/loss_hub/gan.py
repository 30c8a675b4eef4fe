"""DMD2 phase 2: a discriminator head on the critic, in DiT form (Yin et al. 2024, §4.3; tianweiy/DMD2
``SDGuidance.cls_pred_branch`` on the fake-score UNet's bottleneck, ``compute_cls_logits``).

The discriminator is the critic itself plus a small head: the critic transformer runs on a noised image, forward
hooks read its image-token hidden states after the chosen blocks (``--dmd2-gan-feature-blocks``, default the middle
one; several blocks give several heads, FastGen-style, whose logits are averaged), the tokens are laid back on
their patch grid ``(B, D, h, w)`` and strided convolutions with GroupNorm and SiLU reduce each grid to one logit
per image. The family supplies the tokens, their grid and their width (``TokenFeatures`` of
:mod:`miles.models.capabilities`). A video's grid ``(f, h, w)`` is folded into f frames of ``(h, w)`` that the same
2-D head judges one by one, and the frames' logits are averaged: the tokens of a video DiT already attend across
frames, so a frame's features carry the motion around it, and an image and a video head are one design.
Diffusion-GAN: real and fake images are noised at a σ drawn like the DMD2 scoring σ (the ``--fsdp-flow-shift`` grid
inside 2–98% of the timesteps) before the critic sees them.

Losses (non-saturating, tianweiy/DMD2): the critic group minimises ``softplus(D(fake)) + softplus(−D(real))``
(``guidance_cls_loss``), weighted by ``--dmd2-gan-disc-weight``, beside its flow-matching loss; the generator's is
``softplus(−D(fake))`` (``gen_cls_loss``), whose gradient with respect to the student's x̂0 the critic's scoring
hook computes (:func:`generator_gan_gradient`) and the actor adds to its distribution-matching gradient.

Options that make the head judge the prompt and resist pixel noise:

* ``--dmd2-gan-projection``: the projection discriminator of Miyato & Koyama 2018 ("cGANs with Projection
  Discriminator", eq. 3), ``D(x, y) = ψ(φ(x)) + yᵀVφ(x)``, with y the prompt's pooled text embedding
  (``cond["pooled_projections"]``) in place of a class embedding (:meth:`DiscriminatorHead.forward`).
* ``--dmd2-gan-mismatch-weight``: the matching-aware discriminator of Reed et al. 2016 ("Generative Adversarial Text
  to Image Synthesis", GAN-CLS): real images shown with another sample's prompt are a third, "fake" class
  (:func:`mismatched_rows`).
* ``--dmd2-gan-r1-weight``: the approximate R1 penalty ``mean((D(x_real) − D(x_real + α·ε))²)`` of FastGen
  (``gan_r1_reg_weight`` / ``gan_r1_reg_alpha``) and Seaweed-APT (Lin et al. 2025, §3.3), a finite-difference
  estimate of Mescheder et al. 2018's R1, ``E‖∇_x D(x_real)‖²``: for small α its expectation is
  ``α²·‖∇_x D‖²`` (:func:`approximate_r1`).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.backends.fsdp_utils.loss_hub.dmd2_types import dmd2_settings
from miles.backends.fsdp_utils.loss_hub.types import Metrics
from miles.models.base import DENOISER
from miles.models.capabilities import TokenFeatures, require
from miles.utils.misc import make_generator
from miles.utils.sampling import draw_noise_levels, forward_process

__all__ = [
    "DISC_HEAD",
    "POOLED_COND_KEY",
    "approximate_r1",
    "mismatched_rows",
    "pooled_embedding",
    "DiscriminatorHead",
    "FeatureTap",
    "build_discriminator",
    "discriminator_logits",
    "generator_gan_gradient",
    "judge_loss",
    "judge_rows",
    "seeded_noise_levels",
]

# The head's name among the critic group's trainable modules (ctx.models, checkpoints, metrics).
DISC_HEAD = "disc_head"
# The cond entry the projection term reads: the prompt's pooled text embedding (SD3 and digits families).
POOLED_COND_KEY = "pooled_projections"


def _conv_block(channels_in: int, channels_out: int, kernel: int, stride: int, padding: int) -> list[nn.Module]:
    # Up to 32 groups (tianweiy/DMD2's) of at least 8 channels: on the final 1×1 grid a group of one channel would
    # normalise every activation to its bias and cut the logit off from the image.
    groups = math.gcd(32, max(1, channels_out // 8))
    return [
        nn.Conv2d(channels_in, channels_out, kernel_size=kernel, stride=stride, padding=padding),
        nn.GroupNorm(groups, channels_out),
        nn.SiLU(),
    ]


class FeatureTap:
    """Forward hooks that keep the image tokens of chosen blocks of a denoiser from its most recent forward.

    A pre-hook on the denoiser clears them at the start of each forward, so :attr:`features` always belongs to the
    last forward (one ``(B, N, D)`` tensor per chosen block, in block order). The critic's trainer forward of a GAN
    micro-batch thus leaves the discriminator's features for the loss hook, with their autograd graph.
    """

    def __init__(self, family, denoiser: nn.Module, block_indices: list[int]) -> None:
        blocks = family.blocks(denoiser)
        for index in block_indices:
            if not -len(blocks) <= index < len(blocks):
                raise ValueError(
                    f"--dmd2-gan-feature-blocks index {index} is outside the critic's {len(blocks)} blocks"
                )
        self.family = family
        self.block_indices = list(block_indices)
        self.features: list[torch.Tensor] = []
        denoiser.register_forward_pre_hook(self._clear)
        for index in block_indices:
            blocks[index].register_forward_hook(self._record)

    def _clear(self, module: nn.Module, inputs) -> None:
        self.features = []

    def _record(self, module: nn.Module, inputs, output) -> None:
        self.features.append(self.family.image_tokens(output))


class DiscriminatorHead(nn.Module):
    """One small conv head per tapped block: image tokens ``(B, h·w, D)`` → ``(B, D, h, w)`` → stride-2 4×4
    convolutions (GroupNorm, SiLU) until the grid is at most 2×2, then a convolution over the whole grid to the
    feature φ ``(B, C)`` and a 1×1 convolution ψ to one logit; the heads' logits are averaged. Randomly initialised
    (PyTorch's defaults). Video tokens ``(B, f·h·w, D)`` run as ``B·f`` frames ``(D, h, w)`` whose logits are
    averaged per video.

    With ``cond_dim``, each head adds the projection term of Miyato & Koyama 2018 (eq. 3), ``yᵀVφ(x)`` with ``V``
    a bias-free ``Linear(cond_dim, C)`` and ``y`` the prompt's pooled embedding, so the logit depends on whether the
    image fits its prompt (a video's every frame with its video's prompt).

    Args:
        hidden_size: D, the transformer's token width.
        grid: ``(h, w)``, the patch grid of the image tokens, or ``(f, h, w)`` for a video.
        num_features: how many tapped blocks feed it.
        channels: the convolutions' width (default ``min(D, 256)``).
        cond_dim: the pooled prompt embedding's width P for the projection term (None: no projection).
    """

    def __init__(
        self,
        hidden_size: int,
        grid: tuple[int, ...],
        num_features: int = 1,
        channels: int | None = None,
        cond_dim: int | None = None,
    ):
        super().__init__()
        self.grid = tuple(grid)
        if len(self.grid) not in (2, 3):
            raise ValueError(f"a token grid is (h, w) or (f, h, w), got {self.grid}")
        channels = channels or min(hidden_size, 256)
        heads = []
        for _ in range(num_features):
            layers, size, width = [], min(self.grid[-2:]), hidden_size
            while size > 2:
                layers += _conv_block(width, channels, kernel=4, stride=2, padding=1)
                size, width = size // 2, channels
            layers += _conv_block(width, channels, kernel=size, stride=1, padding=0)  # the whole grid → 1×1
            layers.append(nn.Conv2d(channels, 1, kernel_size=1))
            heads.append(nn.Sequential(*layers))
        self.heads = nn.ModuleList(heads)
        self.projections = None
        if cond_dim is not None:
            self.projections = nn.ModuleList(nn.Linear(cond_dim, channels, bias=False) for _ in range(num_features))

    def forward(self, features: list[torch.Tensor], cond_embedding: torch.Tensor | None = None) -> torch.Tensor:
        """``features``: one ``(B, h·w, D)`` (video: ``(B, f·h·w, D)``) tensor per head → float32 logits ``(B,)``.

        Args:
            cond_embedding: float ``(B, P)`` pooled prompt embeddings; required by (and only read by) a head with
                the projection term.

        Raises:
            ValueError: if the feature count or a token count does not match the head, or the projection term
                gets no (or a mis-shaped) ``cond_embedding``.
        """
        if len(features) != len(self.heads):
            raise ValueError(f"the discriminator head has {len(self.heads)} inputs, got {len(features)} features")
        if self.projections is not None and (cond_embedding is None or cond_embedding.ndim != 2):
            shape = None if cond_embedding is None else list(cond_embedding.shape)
            raise ValueError(f"the projection discriminator needs (B, P) prompt embeddings, got {shape}")
        frames, (h, w) = math.prod(self.grid[:-2]), self.grid[-2:]
        logits = []
        for position, (head, tokens) in enumerate(zip(self.heads, features)):
            batch, count, width = tokens.shape
            if count != frames * h * w:
                raise ValueError(f"expected {'×'.join(map(str, self.grid))} image tokens, got {count}")
            grid = tokens.transpose(1, 2).reshape(batch, width, *self.grid)
            if len(self.grid) == 3:
                # (B, D, f, h, w) → (B·f, D, h, w): each frame through the 2-D head (see the module docstring)
                grid = grid.transpose(1, 2).reshape(batch * frames, width, h, w)
            dtype = next(head.parameters()).dtype
            phi = head[:-1](grid.to(dtype))  # (B·f, C, 1, 1): each frame's grid reduced to one feature vector
            logit = head[-1](phi).flatten(1).mean(dim=1)
            if self.projections is not None:
                embedded = self.projections[position](cond_embedding.to(device=phi.device, dtype=dtype))
                logit = logit + (embedded.repeat_interleave(frames, dim=0) * phi.flatten(1)).sum(dim=1)
            logit = logit.float()
            logits.append(logit.view(batch, frames).mean(dim=1) if len(self.grid) == 3 else logit)
        return torch.stack(logits).mean(dim=0)


def feature_blocks(args, num_blocks: int) -> list[int]:
    """``--dmd2-gan-feature-blocks``, default the middle block (``num_blocks // 2``)."""
    blocks = dmd2_settings(args).gan_feature_blocks
    return [int(index) for index in blocks] if blocks else [num_blocks // 2]


def build_discriminator(args, models: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """The critic group's ``--custom-build-modules-path`` under the GAN: taps the critic transformer's chosen blocks
    and returns ``{"disc_head": DiscriminatorHead}`` (the trainer shards it and trains it under the critic's
    optimizer).

    Raises:
        ValueError: for a family without :class:`~miles.models.capabilities.TokenFeatures` or a bad block index.
    """
    from miles.models import get_model_family

    family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
    critic = models[DENOISER]
    require(family, TokenFeatures, "the DMD2 GAN head (--dmd2-gan-disc-weight)")
    indices = feature_blocks(args, len(family.blocks(critic)))
    cond_dim = None
    if dmd2_settings(args).gan_projection:
        cond_dim = getattr(critic.config, "pooled_projection_dim", None)
        if cond_dim is None:
            raise ValueError(
                f"--dmd2-gan-projection reads the prompt's pooled embedding, but the {family.name} family's denoiser "
                "config has no pooled_projection_dim"
            )
    grid = family.token_grid(critic, tuple(family.latent_shape(args.hf_checkpoint)))
    head = DiscriminatorHead(family.token_width(critic), grid, num_features=len(indices), cond_dim=cond_dim)
    # The tap lives on the head: the loss and scoring hooks find it through ctx.models["disc_head"].
    head.tap = FeatureTap(family, critic, indices)
    return {DISC_HEAD: head}


def discriminator_logits(
    ctx, x0: Tensor, cond: dict[str, Tensor], sigma: Tensor, timestep: Tensor, noise: Tensor
) -> Tensor:
    """D(x0): noise ``x0`` ``(B, C, H, W)`` at ``sigma`` (float64 ``(B,)``) with ``noise``, run the critic
    transformer with ``cond`` under the head's tap and return the head's float32 logits ``(B,)``. Gradients flow to
    ``x0`` and to the critic and head parameters (as they require)."""
    head = ctx.models[DISC_HEAD]
    ctx.predict_velocity(ctx.models[DENOISER], forward_process(x0, sigma, noise), timestep, cond)
    return head(head.tap.features, pooled_embedding(head, cond))


def pooled_embedding(head: nn.Module, cond: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The prompt embeddings a projection head reads (``cond[POOLED_COND_KEY]``), None for a head without one.

    Raises:
        ValueError: when the head projects but the cond has no pooled embedding.
    """
    if getattr(head, "projections", None) is None:
        return None
    if POOLED_COND_KEY not in cond:
        raise ValueError(
            f"--dmd2-gan-projection reads the prompt's pooled embedding cond[{POOLED_COND_KEY!r}], but the family's "
            f"cond has only {sorted(cond)}"
        )
    return cond[POOLED_COND_KEY]


def mismatched_rows(cond: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row j of a batch's cond, the first other row k (j + 1, j + 2, ... cyclically) whose cond differs
    from j's: the prompt a matching-aware discriminator shows with j's real image (Reed et al. 2016, GAN-CLS).

    Args:
        cond: collated cond, each value ``(B, ...)``.

    Returns:
        ``(rows int64 (B,), valid bool (B,))``: ``valid[j]`` is False (and ``rows[j] = j``) when every row holds
        j's prompt, so no mismatched prompt exists in the batch.
    """
    flat = torch.cat([value.flatten(1).float() for _, value in sorted(cond.items())], dim=1)
    batch = len(flat)
    rows, valid = list(range(batch)), [False] * batch
    for j in range(batch):
        for step in range(1, batch):
            k = (j + step) % batch
            if not torch.equal(flat[k], flat[j]):
                rows[j], valid[j] = k, True
                break
    return torch.tensor(rows, dtype=torch.long), torch.tensor(valid)


def approximate_r1(logits_real: torch.Tensor, logits_perturbed: torch.Tensor) -> torch.Tensor:
    """Per pair ``(D(x_real) − D(x_real + α·ε))²`` (float32 ``(B,)``): FastGen's approximate R1 (its mean-squared
    ``gan_loss_ar1``), whose expectation over ε is ``α²·‖∇_x D(x_real)‖² + O(α³)`` (Mescheder et al. 2018's R1
    without the double backward)."""
    return (logits_real.float() - logits_perturbed.float()).pow(2)


def judge_rows(
    ctx,
    real: torch.Tensor,
    noised_real: torch.Tensor,
    real_cond: dict[str, torch.Tensor],
    sigma: torch.Tensor,
    timestep: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]], dict]:
    """The discriminator's optional rows after the fakes and the reals, in this order, each only when its weight is
    > 0 (the DMD2 settings):

    * ``"mismatch"`` (``--dmd2-gan-mismatch-weight``): ``noised_real`` again (same σ and noise) with another real's
      prompt (:func:`mismatched_rows`);
    * ``"r1"`` (``--dmd2-gan-r1-weight``): the clean reals perturbed by ``α·ε'`` (``α`` = ``--dmd2-gan-r1-alpha``,
      ``ε'`` from ``make_generator("gan_r1", seed, rollout, micro-batch, DP rank)``), then noised with the reals'
      ``sigma`` and ``noise``, with their own prompts.

    Args:
        real: clean real latents float32 ``(B, ...)``; noised_real: the same noised, on ``ctx.device``.
        real_cond: their collated cond on ``ctx.device``; sigma float64 ``(B,)``, timestep ``(B,)`` on
            ``ctx.device`` and noise ``(B, ...)``: the reals' diffusion-GAN draw.

    Returns:
        ``([(group name, latents, timestep, cond), ...], extras)``; ``extras["gan_mismatch_valid"]`` (bool ``(B,)``)
        with the mismatch rows.
    """
    settings = dmd2_settings(ctx.args)
    rows, extras = [], {}
    if settings.gan_mismatch_weight > 0:
        index, valid = mismatched_rows(real_cond)
        rows.append(("mismatch", noised_real, timestep, {k: v[index.to(v.device)] for k, v in real_cond.items()}))
        extras["gan_mismatch_valid"] = valid
    if settings.gan_r1_weight > 0:
        generator = make_generator("gan_r1", ctx.args.seed, ctx.rollout_id, ctx.microbatch_id, ctx.dp_rank)
        bump = settings.gan_r1_alpha * torch.randn(real.shape, generator=generator, dtype=torch.float32)
        rows.append(("r1", forward_process(real + bump, sigma, noise).to(ctx.device), timestep, real_cond))
    return rows, extras


def judge_loss(settings, logit: dict[str, torch.Tensor], extras: dict, metrics: Metrics) -> torch.Tensor:
    """Per pair, the optional rows' discriminator terms (float32 ``(B,)``): ``w_mismatch · softplus(D(real, another
    prompt))`` (0 for a pair without one) ``+ w_r1 · (D(real) − D(real + α·ε'))²``; ``logit`` maps each group of
    :func:`judge_rows` (and ``"real"``) to its logits. Appends ``gan_logit_mismatch`` and ``gan_r1`` to ``metrics``.
    """
    terms = torch.zeros_like(logit["real"])
    if "mismatch" in logit:
        valid = extras["gan_mismatch_valid"].to(device=terms.device, dtype=torch.float32)
        terms = terms + settings.gan_mismatch_weight * valid * F.softplus(logit["mismatch"])
        metrics.setdefault("gan_logit_mismatch", []).append(logit["mismatch"].detach())
    if "r1" in logit:
        r1 = approximate_r1(logit["real"], logit["r1"])
        terms = terms + settings.gan_r1_weight * r1
        metrics.setdefault("gan_r1", []).append(r1.detach())
    return terms


def disc_loss_terms(logits_fake: torch.Tensor, logits_real: torch.Tensor) -> torch.Tensor:
    """Per pair ``softplus(D(fake)) + softplus(−D(real))`` (float32 ``(B,)``), tianweiy/DMD2's
    ``guidance_cls_loss``."""
    return F.softplus(logits_fake) + F.softplus(-logits_real)


# discriminator_logits' inputs: it runs D through it, with x0 as the leaf of the gradient.
def generator_gan_gradient(
    ctx, x0: Tensor, cond: dict[str, Tensor], sigma: Tensor, timestep: Tensor, noise: Tensor
) -> tuple[Tensor, Tensor]:
    """``g_gan = ∂ softplus(−D(noise(x0))) / ∂x0`` per pair, by autograd through the critic and the head with their
    weights untouched: ``torch.autograd.grad`` with respect to ``x0`` alone computes no weight gradient and
    accumulates none. Their ``requires_grad`` is left as it is: FSDP2 fixes a unit's mixed-precision dtypes from the
    ``requires_grad`` its parameters have at its first forward (pytorch/pytorch#186998), and this pass may be the
    head's first forward (``--dmd2-critic-scoring original`` with one critic step per rollout scores before the
    critic's first step), whose training backward would then fail in bf16.

    Returns:
        ``(g_gan float32 (B, C, H, W), logits float32 (B,))``; each pair's gradient is its own loss's (the sum over
        the batch does not couple them).
    """
    with torch.enable_grad():
        x0 = x0.detach().float().requires_grad_(True)
        logits = discriminator_logits(ctx, x0, cond, sigma, timestep, noise)
        (grad,) = torch.autograd.grad(F.softplus(-logits).sum(), x0)
    return grad.detach(), logits.detach()


def seeded_noise_levels(ctx, purpose: str, microbatch_id: int, x0_shape, grid, allowed):
    """The σ, timestep and noise of one diffusion-GAN draw (:func:`miles.utils.sampling.draw_noise_levels` over the
    ``allowed`` grid positions), from ``make_generator(purpose, seed, rollout, micro-batch, DP rank)``."""
    generator = make_generator(purpose, ctx.args.seed, ctx.rollout_id, microbatch_id, ctx.dp_rank)
    _, sigma, timestep, noise = draw_noise_levels(generator, grid, tuple(x0_shape), allowed)
    return sigma, timestep, noise
