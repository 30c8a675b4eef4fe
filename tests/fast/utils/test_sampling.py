"""``miles.utils.sampling``: the shifted σ grid shared by the engine and the trainer (docs/architecture.md)."""

import pytest
import torch

from miles.utils.sampling import FlowNoiseSchedule, shift_sigmas


def test_shift3_four_steps_pins_the_design_values():
    schedule = FlowNoiseSchedule(4, 3.0)
    assert schedule.sigmas.dtype == torch.float64
    torch.testing.assert_close(schedule.sigmas, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0], dtype=torch.float64))
    torch.testing.assert_close(schedule.timesteps, torch.tensor([1000.0, 900.0, 750.0, 500.0], dtype=torch.float64))
    assert schedule.num_steps == 4


def test_shift_one_is_linear_and_shift_formula():
    schedule = FlowNoiseSchedule(4, 1.0)
    torch.testing.assert_close(schedule.sigmas, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64))
    s = torch.tensor([0.25], dtype=torch.float64)
    torch.testing.assert_close(shift_sigmas(s, 3.0), torch.tensor([0.75 / 1.5], dtype=torch.float64))


def test_matches_diffusers_flow_match_scheduler_sigmas():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1.0 / 8, 8).tolist())
    ours = FlowNoiseSchedule(8, 3.0)
    torch.testing.assert_close(ours.sigmas.float(), scheduler.sigmas.float(), rtol=0, atol=1e-6)


def test_explicit_timesteps_override_steps_and_shift():
    schedule = FlowNoiseSchedule(4, 3.0, timesteps=[999.0, 750.0, 250.0])
    torch.testing.assert_close(schedule.sigmas, torch.tensor([0.999, 0.75, 0.25, 0.0], dtype=torch.float64))
    assert schedule.num_steps == 3
    with pytest.raises(ValueError, match="descending"):
        FlowNoiseSchedule(4, 3.0, timesteps=[250.0, 750.0])


def test_trainer_grid_has_one_point_per_train_timestep():
    grid = FlowNoiseSchedule(1000, 3.0)
    assert grid.sigmas.shape == (1001,) and grid.timesteps.shape == (1000,)
    assert grid.sigmas[0] == 1.0 and grid.sigmas[-1] == 0.0
    assert bool((grid.sigmas[1:] < grid.sigmas[:-1]).all())
