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
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from miles.backends.fsdp_utils.loss_hub.dmd2_types import dmd2_settings
from miles.models.base import DENOISER
from miles.models.capabilities import TokenFeatures, require
from miles.utils.misc import make_generator
from miles.utils.sampling import draw_noise_levels, forward_process

__all__ = [
    "DISC_HEAD",
    "DiscriminatorHead",
    "FeatureTap",
    "build_discriminator",
    "discriminator_logits",
    "generator_gan_gradient",
    "seeded_noise_levels",
]

# The head's name among the critic group's trainable modules (ctx.models, checkpoints, metrics).
DISC_HEAD = "disc_head"


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
    convolutions (GroupNorm, SiLU) until the grid is at most 2×2, then a convolution over the whole grid and a
    1×1 convolution to one logit; the heads' logits are averaged. Randomly initialised (PyTorch's defaults).
    Video tokens ``(B, f·h·w, D)`` run as ``B·f`` frames ``(D, h, w)`` whose logits are averaged per video.

    Args:
        hidden_size: D, the transformer's token width.
        grid: ``(h, w)``, the patch grid of the image tokens, or ``(f, h, w)`` for a video.
        num_features: how many tapped blocks feed it.
        channels: the convolutions' width (default ``min(D, 256)``).
    """

    def __init__(self, hidden_size: int, grid: tuple[int, ...], num_features: int = 1, channels: int | None = None):
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

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        """``features``: one ``(B, h·w, D)`` (video: ``(B, f·h·w, D)``) tensor per head → float32 logits ``(B,)``.

        Raises:
            ValueError: if the feature count or a token count does not match the head.
        """
        if len(features) != len(self.heads):
            raise ValueError(f"the discriminator head has {len(self.heads)} inputs, got {len(features)} features")
        frames, (h, w) = math.prod(self.grid[:-2]), self.grid[-2:]
        logits = []
        for head, tokens in zip(self.heads, features):
            batch, count, width = tokens.shape
            if count != frames * h * w:
                raise ValueError(f"expected {'×'.join(map(str, self.grid))} image tokens, got {count}")
            grid = tokens.transpose(1, 2).reshape(batch, width, *self.grid)
            if len(self.grid) == 3:
                # (B, D, f, h, w) → (B·f, D, h, w): each frame through the 2-D head (see the module docstring)
                grid = grid.transpose(1, 2).reshape(batch * frames, width, h, w)
            dtype = next(head.parameters()).dtype
            logit = head(grid.to(dtype)).flatten(1).mean(dim=1).float()
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

    family = get_model_family(args.hf_checkpoint, getattr(args, "diffusion_model_family", None))
    critic = models[DENOISER]
    require(family, TokenFeatures, "the DMD2 GAN head (--dmd2-gan-disc-weight)")
    indices = feature_blocks(args, len(family.blocks(critic)))
    grid = family.token_grid(critic, tuple(family.latent_shape(args.hf_checkpoint)))
    head = DiscriminatorHead(family.token_width(critic), grid, num_features=len(indices))
    # The tap lives on the head: the loss and scoring hooks find it through ctx.models["disc_head"].
    head.tap = FeatureTap(family, critic, indices)
    return {DISC_HEAD: head}


def discriminator_logits(
    ctx,
    x0: torch.Tensor,
    cond: dict[str, torch.Tensor],
    sigma: torch.Tensor,
    timestep: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """D(x0): noise ``x0`` ``(B, C, H, W)`` at ``sigma`` (float64 ``(B,)``) with ``noise``, run the critic
    transformer with ``cond`` under the head's tap and return the head's float32 logits ``(B,)``. Gradients flow to
    ``x0`` and to the critic and head parameters (as they require)."""
    head = ctx.models[DISC_HEAD]
    ctx.predict_velocity(ctx.models[DENOISER], forward_process(x0, sigma, noise), timestep, cond)
    return head(head.tap.features)


def disc_loss_terms(logits_fake: torch.Tensor, logits_real: torch.Tensor) -> torch.Tensor:
    """Per pair ``softplus(D(fake)) + softplus(−D(real))`` (float32 ``(B,)``), tianweiy/DMD2's
    ``guidance_cls_loss``."""
    return F.softplus(logits_fake) + F.softplus(-logits_real)


# discriminator_logits' inputs: it runs D through it, with x0 as the leaf of the gradient.
def generator_gan_gradient(
    ctx,
    x0: torch.Tensor,
    cond: dict[str, torch.Tensor],
    sigma: torch.Tensor,
    timestep: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g_gan = ∂ softplus(−D(noise(x0))) / ∂x0`` per pair, by autograd through the critic and the head with their
    weights untouched (their ``requires_grad`` is off for the pass, so no gradient reaches them).

    Returns:
        ``(g_gan float32 (B, C, H, W), logits float32 (B,))``; each pair's gradient is its own loss's (the sum over
        the batch does not couple them).
    """
    modules = [ctx.models[DENOISER], ctx.models[DISC_HEAD]]
    flags = [[param.requires_grad for param in module.parameters()] for module in modules]
    for module in modules:
        module.requires_grad_(False)
    try:
        with torch.enable_grad():
            x0 = x0.detach().float().requires_grad_(True)
            logits = discriminator_logits(ctx, x0, cond, sigma, timestep, noise)
            (grad,) = torch.autograd.grad(F.softplus(-logits).sum(), x0)
    finally:
        for module, module_flags in zip(modules, flags):
            for param, flag in zip(module.parameters(), module_flags):
                param.requires_grad_(flag)
    return grad.detach(), logits.detach()


def seeded_noise_levels(ctx, purpose: str, microbatch_id: int, x0_shape, grid, allowed):
    """The σ, timestep and noise of one diffusion-GAN draw (:func:`miles.utils.sampling.draw_noise_levels` over the
    ``allowed`` grid positions), from ``make_generator(purpose, seed, rollout, micro-batch, DP rank)``."""
    generator = make_generator(purpose, ctx.args.seed, ctx.rollout_id, microbatch_id, ctx.dp_rank)
    _, sigma, timestep, noise = draw_noise_levels(generator, grid, tuple(x0_shape), allowed)
    return sigma, timestep, noise
