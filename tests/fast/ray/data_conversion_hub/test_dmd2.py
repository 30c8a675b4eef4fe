"""DMD2 converter: one train pair per rollout stopped at step i; full or overlong trajectories are rejected."""

from types import SimpleNamespace

import pytest
import torch

from miles.ray.data_conversion_hub.dmd2 import expand_samples_to_train_pairs
from miles.utils.sampling import FlowNoiseSchedule
from miles.utils.types import DenoisingEnv, DiTTrajectory, Sample

C, H, W = 1, 8, 8
SCHEDULE = FlowNoiseSchedule(4, 3.0)  # σ = 1, 0.9, 0.75, 0.5, 0
ARGS = SimpleNamespace()


def make_env(gen, with_neg=True):
    def cond():
        return {
            "encoder_hidden_states": torch.randn(3, 5, generator=gen),
            "pooled_projections": torch.randn(5, generator=gen),
        }

    return DenoisingEnv(pos_cond=cond(), neg_cond=cond() if with_neg else {}, guidance_scale=1.0)


def stopped_sample(index: int, step: int, seed: int = 0, with_neg: bool = True) -> Sample:
    gen = torch.Generator().manual_seed(seed + index)
    trajectory = DiTTrajectory(
        sigmas=SCHEDULE.sigmas.clone(),
        timesteps=SCHEDULE.timesteps.clone(),
        step_indices=[step],
        latents=torch.randn(1, C, H, W, generator=gen),
        x0_preds=torch.randn(1, C, H, W, generator=gen),
        final=None,
    )
    return Sample(
        index=index, prompt=f"digit {index}", env=make_env(gen, with_neg), trajectory=trajectory, reward=0.25 * index
    )


def full_sample(index: int) -> Sample:
    gen = torch.Generator().manual_seed(index)
    trajectory = DiTTrajectory(
        sigmas=SCHEDULE.sigmas.clone(),
        timesteps=SCHEDULE.timesteps.clone(),
        step_indices=[0, 1, 2, 3],
        latents=torch.randn(4, C, H, W, generator=gen),
        x0_preds=torch.randn(4, C, H, W, generator=gen),
        final=torch.randn(C, H, W, generator=gen),
    )
    return Sample(index=index, prompt="full", env=make_env(gen), trajectory=trajectory)


def test_one_pair_per_stopped_sample():
    samples = [stopped_sample(index, step) for index, step in [(4, 0), (5, 2), (6, 3), (7, 1)]]
    pairs = expand_samples_to_train_pairs(ARGS, samples)
    assert [pair.sample_index for pair in pairs] == [4, 5, 6, 7]
    assert [pair.step_index for pair in pairs] == [0, 2, 3, 1]
    for pair, sample in zip(pairs, samples):
        step = sample.trajectory.step_indices[0]
        assert torch.equal(pair.latent, sample.trajectory.latents[0])
        assert torch.equal(pair.x0, sample.trajectory.x0_preds[0])
        assert pair.sigma == pytest.approx([1.0, 0.9, 0.75, 0.5][step])
        assert pair.timestep == pytest.approx(1000 * pair.sigma)
        assert isinstance(pair.sigma, float) and isinstance(pair.timestep, float)
        assert pair.pos_cond.keys() == sample.env.pos_cond.keys()
        assert torch.equal(pair.pos_cond["pooled_projections"], sample.env.pos_cond["pooled_projections"])
        assert torch.equal(pair.neg_cond["encoder_hidden_states"], sample.env.neg_cond["encoder_hidden_states"])


def test_missing_negative_cond_stays_empty_and_rewards_are_ignored():
    with_reward = stopped_sample(3, 1, with_neg=False)
    without_reward = stopped_sample(3, 1, with_neg=False)
    without_reward.reward = None
    first, second = expand_samples_to_train_pairs(ARGS, [with_reward, without_reward])
    assert first.neg_cond == {} and second.neg_cond == {}
    assert torch.equal(first.x0, second.x0) and first.sigma == second.sigma


def test_full_trajectory_is_rejected_with_its_sample_index():
    samples = [stopped_sample(0, 1), full_sample(9)]
    with pytest.raises(ValueError, match=r"sample 9 is a full trajectory.*stop_at_random_step"):
        expand_samples_to_train_pairs(ARGS, samples)


def test_trajectory_past_its_first_returned_step_is_rejected():
    two_steps = stopped_sample(11, 1)
    two_steps.trajectory.step_indices = [1, 2]
    two_steps.trajectory.latents = torch.zeros(2, C, H, W)
    two_steps.trajectory.x0_preds = torch.zeros(2, C, H, W)
    with pytest.raises(ValueError, match="sample 11"):
        expand_samples_to_train_pairs(ARGS, [two_steps])

    finished = stopped_sample(12, 3)
    finished.trajectory.final = torch.zeros(C, H, W)
    with pytest.raises(ValueError, match="sample 12 is a full trajectory"):
        expand_samples_to_train_pairs(ARGS, [finished])

    extra_rows = stopped_sample(13, 0)
    extra_rows.trajectory.latents = torch.zeros(2, C, H, W)
    with pytest.raises(ValueError, match="sample 13 .*ran past its first returned step"):
        expand_samples_to_train_pairs(ARGS, [extra_rows])


def test_malformed_samples_name_the_sample():
    no_steps = stopped_sample(21, 0)
    no_steps.trajectory.step_indices = []
    with pytest.raises(ValueError, match="sample 21 returned no step"):
        expand_samples_to_train_pairs(ARGS, [no_steps])

    out_of_range = stopped_sample(22, 0)
    out_of_range.trajectory.step_indices = [4]
    with pytest.raises(ValueError, match="sample 22 stopped at step 4"):
        expand_samples_to_train_pairs(ARGS, [out_of_range])

    data_sample = Sample(index=23, prompt="a 3", x0=torch.zeros(C, H, W))
    with pytest.raises(ValueError, match="sample 23 has no trajectory"):
        expand_samples_to_train_pairs(ARGS, [data_sample])
