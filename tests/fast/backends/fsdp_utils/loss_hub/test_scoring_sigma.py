"""The DMD2 scoring σ draws (``--dmd2-scoring-sigma``): the default repeats the grid draw bit for bit, the shifted
and logit-normal rules follow their analytic distributions inside the scoring range, from their seed alone."""

import numpy as np
import pytest
import torch
from scipy.special import logit, ndtr

from miles.backends.fsdp_utils.loss_hub.dmd2 import scoring_grid_indices
from miles.backends.fsdp_utils.loss_hub.scoring_sigma import draw_scoring_levels, scoring_sigmas, shift_sigma
from miles.backends.fsdp_utils.loss_hub.sft import trainer_flow_grid
from miles.utils.sampling import draw_noise_levels
from tests.support.trainer import dmd2_args

LOW, HIGH = 0.02, 0.98
DRAWS = 40_000


def _args(rule: str, **overrides):
    values = dict(
        fsdp_flow_shift=3.0,
        dmd2_min_timestep_ratio=LOW,
        dmd2_max_timestep_ratio=HIGH,
        dmd2_scoring_sigma=rule,
        dmd2_scoring_shift=1.0,
        dmd2_scoring_logit_mean=0.0,
        dmd2_scoring_logit_std=1.0,
    )
    return dmd2_args(**{**values, **overrides})


def _draw(args, count=DRAWS, seed=0):
    grid = trainer_flow_grid(args)
    allowed = scoring_grid_indices(args, grid)
    return scoring_sigmas(args.method_settings, grid, allowed, count, torch.Generator().manual_seed(seed))


def test_the_grid_rule_is_the_uniform_grid_draw_of_before():
    args = _args("grid")
    grid = trainer_flow_grid(args)
    allowed = scoring_grid_indices(args, grid)
    sigma, timestep = _draw(args, count=64, seed=3)
    index = allowed[torch.randint(0, len(allowed), (64,), generator=torch.Generator().manual_seed(3))]
    assert torch.equal(sigma, grid.sigmas[index]) and torch.equal(timestep, grid.timesteps[index].float())
    # the scoring hook's draw is the trainer-wide noise-level draw itself: σ first, then the noise
    levels = draw_scoring_levels(args.method_settings, torch.Generator().manual_seed(3), grid, (64, 1, 8, 8), allowed)
    _, *expected = draw_noise_levels(torch.Generator().manual_seed(3), grid, (64, 1, 8, 8), allowed)
    assert all(torch.equal(got, want) for got, want in zip(levels, expected, strict=True))
    # on the shift-3 grid few draws fall where an 8x8 digit's detail is decided
    share = float((_draw(args)[0] < 0.2).double().mean())
    assert 0.065 < share < 0.085


def _ks(sigma: torch.Tensor, cdf) -> float:
    values = np.sort(sigma.numpy())
    empirical = np.arange(1, len(values) + 1) / len(values)
    return float(np.max(np.abs(empirical - cdf(values))))


@pytest.mark.parametrize("k", [1.0, 0.5, 3.0])
def test_the_shift_rule_is_uniform_s_through_the_time_shift(k):
    args = _args("shift", dmd2_scoring_shift=k)
    sigma, timestep = _draw(args)
    assert sigma.dtype == torch.float64 and timestep.dtype == torch.float32
    assert sigma.min() >= LOW and sigma.max() <= HIGH
    torch.testing.assert_close(timestep, (sigma * 1000).float())

    def pre_image(value):
        return value / (k - (k - 1) * value)

    def cdf(values):
        return (pre_image(values) - pre_image(LOW)) / (pre_image(HIGH) - pre_image(LOW))

    # Kolmogorov–Smirnov distance of 40k draws: ~0.007 at the 99th percentile for the right distribution
    assert _ks(sigma, cdf) < 0.008
    assert torch.equal(_draw(args)[0], sigma)  # the seed alone fixes the draw
    assert not torch.equal(_draw(args, seed=1)[0], sigma)
    # the map is the grid's: shift 3 of s = 0.5 is 0.75
    assert float(shift_sigma(torch.tensor(0.5, dtype=torch.float64), 3.0)) == 0.75


@pytest.mark.parametrize("mean, std", [(0.0, 1.0), (-1.0, 0.8)])
def test_the_logit_normal_rule_is_the_truncated_logit_normal(mean, std):
    args = _args("logit-normal", dmd2_scoring_logit_mean=mean, dmd2_scoring_logit_std=std)
    sigma, _ = _draw(args)
    assert sigma.min() >= LOW and sigma.max() <= HIGH

    def cdf(values):
        low, high = ndtr((logit(LOW) - mean) / std), ndtr((logit(HIGH) - mean) / std)
        return (ndtr((logit(values) - mean) / std) - low) / (high - low)

    assert _ks(sigma, cdf) < 0.008
    assert torch.equal(_draw(args)[0], sigma)
    if mean < 0:
        assert float((sigma < 0.2).double().mean()) > 0.3  # a negative mean puts the draws at low noise


def test_an_unknown_rule_is_named():
    with pytest.raises(ValueError, match="--dmd2-scoring-sigma 'cosine' is not one of"):
        _draw(_args("cosine"), count=2)
