"""Step strategies: seeded, per-sample, uniform stop steps; full trajectories; loading by dotted path."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from miles.rollout.step_strategy_hub import full_trajectory, stop_at_random_step
from miles.utils.misc import load_function, make_generator


def test_stop_steps_are_the_seeded_draws():
    args = SimpleNamespace(rollout_seed=42)
    steps = stop_at_random_step(args, 3, [0, 1, 2, 10], 4)
    expected = [int(torch.randint(4, (1,), generator=make_generator("stop_step", 42, 3, i))) for i in [0, 1, 2, 10]]
    assert steps == expected
    assert all(isinstance(step, int) for step in steps)


def test_a_sample_draw_does_not_depend_on_its_batch_but_on_seed_and_rollout():
    args = SimpleNamespace(rollout_seed=42)
    all_steps = stop_at_random_step(args, 0, list(range(64)), 4)
    assert stop_at_random_step(args, 0, [17, 5], 4) == [all_steps[17], all_steps[5]]
    assert stop_at_random_step(args, 1, list(range(64)), 4) != all_steps
    assert stop_at_random_step(SimpleNamespace(rollout_seed=43), 0, list(range(64)), 4) != all_steps


def test_stop_steps_cover_the_schedule_uniformly():
    args = SimpleNamespace(rollout_seed=0)
    counts = Counter(step for rollout in range(50) for step in stop_at_random_step(args, rollout, list(range(80)), 4))
    assert set(counts) == {0, 1, 2, 3}
    assert all(850 < count < 1150 for count in counts.values()), counts  # 4000 draws, 1000 expected per step
    assert stop_at_random_step(args, 0, [0, 1, 2], 1) == [0, 0, 0]
    with pytest.raises(ValueError, match="--diffusion-num-steps"):
        stop_at_random_step(args, 0, [0], 0)


def test_full_trajectory_and_loading_by_path():
    assert full_trajectory(None, 0, [4, 5, 6], 4) == [None, None, None]
    fn = load_function("miles.rollout.step_strategy_hub.stop_at_random_step")
    assert fn is stop_at_random_step
