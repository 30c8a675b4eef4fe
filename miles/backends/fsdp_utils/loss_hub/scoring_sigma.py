"""The DMD2 scoring noise level: where along the noise axis the teacher and the critic compare the student's samples.

DMD2's gradient at σ judges what is still undecided at that noise level: high σ the layout, low σ the strokes and
the background. ``--dmd2-scoring-sigma`` picks the density of that σ (:func:`scoring_sigmas`); every rule keeps σ
inside ``[--dmd2-min-timestep-ratio, --dmd2-max-timestep-ratio]``.
"""

import math

import torch

from miles.backends.fsdp_utils.loss_hub.dmd2_types import SCORING_SIGMA_RULES, DMD2Settings
from miles.backends.fsdp_utils.loss_hub.sft import NUM_TRAIN_TIMESTEPS
from miles.utils.sampling import FlowNoiseSchedule, draw_noise_levels

__all__ = ["SCORING_SIGMA_RULES", "draw_scoring_levels", "scoring_sigmas", "shift_sigma"]


def shift_sigma(s: torch.Tensor, k: float) -> torch.Tensor:
    """SD3's time shift ``σ = k·s / (1 + (k − 1)·s)`` (Esser et al. 2024, §5.3.2), the same map as the
    ``--fsdp-flow-shift`` grid's."""
    return k * s / (1 + (k - 1) * s)


def scoring_sigmas(
    settings: DMD2Settings,
    grid: FlowNoiseSchedule,
    allowed: torch.Tensor | None,
    count: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scoring noise levels of ``count`` pairs, drawn with ``generator`` by ``--dmd2-scoring-sigma``:

    * ``grid`` (default): one index uniform over ``allowed`` (:func:`scoring_grid_indices`; ``None`` for the other
      rules, which do not read it) of the
      ``--fsdp-flow-shift`` grid (``torch.randint``): σ is then distributed like the grid, at shift 3 only 7.5% of
      the draws below σ = 0.2, where an 8×8 digit's strokes and background are decided.
    * ``shift``: ``s`` uniform, ``σ = k·s / (1 + (k − 1)·s)`` with ``k = --dmd2-scoring-shift`` (SD3's time shift,
      Esser et al. 2024 §5.3.2), restricted to the scoring range by drawing ``s`` uniformly between the range's
      pre-images (one ``torch.rand`` per pair): ``k = 1`` is uniform σ (tianweiy/DMD2 draws its timestep
      uniformly), ``k < 1`` puts more draws at low σ (share below σ = 0.2: ``0.2 / (0.8·k + 0.2)`` before the
      range cut).
    * ``logit-normal``: ``σ = sigmoid(μ + s·z)``, z standard normal truncated to the scoring range by inverse-CDF
      sampling of one ``torch.rand`` per pair (SD3's logit-normal timestep density, Esser et al. 2024 §3.1; FastGen's
      ``sample_t_cfg`` ``logitnormal``); μ = ``--dmd2-scoring-logit-mean``, s = ``--dmd2-scoring-logit-std``.

    The range is ``[--dmd2-min-timestep-ratio, --dmd2-max-timestep-ratio]`` in every rule; the last two give
    continuous σ (float64), not grid points.

    Returns:
        ``(sigma float64 (count,) in [0, 1], timestep float32 (count,) = σ · 1000)``.

    Raises:
        ValueError: for an unknown rule.
    """
    rule = settings.scoring_sigma
    if rule == "grid":
        index = allowed[torch.randint(0, len(allowed), (count,), generator=generator)]
        return grid.sigmas[index], grid.timesteps[index].float()
    low, high = float(settings.min_timestep_ratio), float(settings.max_timestep_ratio)
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    if rule == "shift":
        k = float(settings.scoring_shift)
        # the inverse of σ = k·s / (1 + (k − 1)·s) is s = σ / (k − (k − 1)·σ)
        s_low, s_high = low / (k - (k - 1) * low), high / (k - (k - 1) * high)
        sigma = shift_sigma(s_low + (s_high - s_low) * u, k)
    elif rule == "logit-normal":
        mean, std = float(settings.scoring_logit_mean), float(settings.scoring_logit_std)
        normal = torch.distributions.Normal(
            torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
        )

        def cdf(sigma: float) -> torch.Tensor:
            return normal.cdf(torch.tensor((math.log(sigma / (1 - sigma)) - mean) / std, dtype=torch.float64))

        c_low, c_high = cdf(max(low, 1e-12)), cdf(min(high, 1 - 1e-12))
        z = normal.icdf((c_low + (c_high - c_low) * u).clamp(1e-15, 1 - 1e-15))
        sigma = torch.sigmoid(mean + std * z).clamp(low, high)
    else:
        raise ValueError(f"--dmd2-scoring-sigma {rule!r} is not one of {SCORING_SIGMA_RULES}")
    return sigma, (sigma * NUM_TRAIN_TIMESTEPS).float()


def draw_scoring_levels(
    settings: DMD2Settings,
    generator: torch.Generator,
    grid: FlowNoiseSchedule,
    shape: tuple[int, ...],
    allowed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One scoring micro-batch's noise levels (:func:`scoring_sigmas`), then its noise ``ε`` of ``shape``, from
    ``generator`` in that order. The ``grid`` rule is :func:`miles.utils.sampling.draw_noise_levels` itself, so the
    default draws what every trainer-side noise level draws.

    Returns:
        ``(sigma float64 (B,), timestep float32 (B,), noise float32 shape)``.
    """
    if settings.scoring_sigma == "grid":
        _, sigma, timestep, noise = draw_noise_levels(generator, grid, tuple(shape), allowed)
        return sigma, timestep, noise
    sigma, timestep = scoring_sigmas(settings, grid, allowed, shape[0], generator)
    return sigma, timestep, torch.randn(tuple(shape), generator=generator, dtype=torch.float32)
