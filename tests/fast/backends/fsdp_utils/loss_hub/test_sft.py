"""Flow-matching SFT hooks: seeded σ/noise draws, the x_σ/target formulas and the summed MSE."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from miles.backends.fsdp_utils.loss_hub.sft import prepare_sft_batch, sft_loss_formula
from miles.backends.fsdp_utils.loss_hub.types import TrainContext
from miles.backends.fsdp_utils.trainer import host_values
from miles.utils.misc import make_generator
from miles.utils.sampling import FlowNoiseSchedule
from miles.utils.types import TrainPair

C, H, W, L, D, P = 2, 4, 4, 3, 5, 6


def make_pairs(count: int, seed: int = 0) -> list[TrainPair]:
    gen = torch.Generator().manual_seed(seed)
    return [
        TrainPair(
            sample_index=10 + j,
            x0=torch.randn(C, H, W, generator=gen),
            pos_cond={
                "encoder_hidden_states": torch.randn(L, D, generator=gen),
                "pooled_projections": torch.randn(P, generator=gen),
            },
        )
        for j in range(count)
    ]


def make_ctx(rollout_id=2, microbatch_id=5, dp_rank=1, seed=7, shift=3.0) -> TrainContext:
    args = SimpleNamespace(seed=seed, fsdp_flow_shift=shift, sft_uncond_prob=0.0)
    return TrainContext(
        args=args,
        models={"transformer": nn.Identity()},
        teacher_models={},
        external_data={},
        family=None,
        device=torch.device("cpu"),
        dtype=torch.float32,
        rollout_id=rollout_id,
        microbatch_id=microbatch_id,
        dp_rank=dp_rank,
        dp_size=2,
    )


def test_prepare_sft_batch_reproduces_seeded_grid_and_noise():
    pairs = make_pairs(3)
    ctx = make_ctx()
    batch = prepare_sft_batch(ctx, pairs)

    gen = make_generator("sample", 7, 2, 5, 1)
    index = torch.randint(0, 1000, (3,), generator=gen)
    noise = torch.randn(3, C, H, W, generator=gen)
    grid = FlowNoiseSchedule(1000, 3.0)
    sigma = grid.sigmas[index]
    x0 = torch.stack([p.x0 for p in pairs])
    s = sigma.float().view(-1, 1, 1, 1)

    assert torch.equal(batch.extras["grid_index"], index)
    assert torch.equal(batch.extras["noise"], noise)
    assert torch.equal(batch.extras["sigma"], sigma)
    assert batch.extras["sigma"].dtype == torch.float64
    assert torch.equal(batch.extras["x0"], x0)
    torch.testing.assert_close(batch.latents, (1 - s) * x0 + s * noise, rtol=0, atol=0)
    torch.testing.assert_close(batch.target, noise - x0, rtol=0, atol=0)
    assert batch.timestep.dtype == torch.float32
    torch.testing.assert_close(batch.timestep, (sigma * 1000).float())
    assert torch.equal(
        batch.cond["pooled_projections"], torch.stack([p.pos_cond["pooled_projections"] for p in pairs])
    )
    assert batch.cond["encoder_hidden_states"].shape == (3, L, D)
    assert batch.component == "transformer"


def test_sft_grid_is_the_fsdp_flow_shift_grid():
    # Shift 1 keeps the linear grid: σ = 1 − k/1000, so every drawn σ is a multiple of 1/1000 at or above 1/1000.
    batch = prepare_sft_batch(make_ctx(shift=1.0), make_pairs(16))
    sigma = batch.extras["sigma"]
    torch.testing.assert_close(sigma, 1 - batch.extras["grid_index"].double() / 1000)
    shifted = prepare_sft_batch(make_ctx(shift=3.0), make_pairs(16))
    assert torch.equal(shifted.extras["grid_index"], batch.extras["grid_index"])
    s = 1 - batch.extras["grid_index"].double() / 1000
    torch.testing.assert_close(shifted.extras["sigma"], 3 * s / (1 + 2 * s))


@pytest.mark.parametrize(
    "change", [{"dp_rank": 0}, {"microbatch_id": 6}, {"rollout_id": 3}, {"seed": 8}], ids=lambda c: next(iter(c))
)
def test_sft_draws_depend_on_every_seed_part(change):
    pairs = make_pairs(4)
    base = prepare_sft_batch(make_ctx(), pairs)
    again = prepare_sft_batch(make_ctx(), pairs)
    other = prepare_sft_batch(make_ctx(**change), pairs)
    assert torch.equal(base.extras["noise"], again.extras["noise"])
    assert torch.equal(base.extras["grid_index"], again.extras["grid_index"])
    assert not torch.equal(base.extras["noise"], other.extras["noise"])
    assert not torch.equal(base.extras["grid_index"], other.extras["grid_index"])


def test_sft_loss_is_sum_of_per_pair_mse_and_backpropagates():
    pairs = make_pairs(3)
    ctx = make_ctx()
    batch = prepare_sft_batch(ctx, pairs)
    pred = torch.randn(3, C, H, W, generator=torch.Generator().manual_seed(1), requires_grad=True)
    metrics: dict[str, list[float]] = {}
    loss = sft_loss_formula(ctx, pairs, batch, new_pred=pred, metrics=metrics)
    metrics = host_values(metrics)  # the trainer's one read of a window's figures

    per_pair = [((pred[j] - batch.target[j]) ** 2).mean() for j in range(3)]
    torch.testing.assert_close(loss, torch.stack(per_pair).sum())
    assert metrics["sft_loss"] == pytest.approx([v.item() for v in per_pair], rel=1e-6)
    loss.backward()
    numel = C * H * W
    torch.testing.assert_close(pred.grad, 2 * (pred.detach() - batch.target) / numel)

    exact: dict[str, list[float]] = {}
    assert sft_loss_formula(ctx, pairs, batch, new_pred=batch.target.clone(), metrics=exact).item() == 0.0
    assert host_values(exact)["sft_loss"] == [0.0, 0.0, 0.0]


def test_sft_rejects_empty_micro_batch():
    with pytest.raises(ValueError, match="empty micro-batch"):
        prepare_sft_batch(make_ctx(), [])


def test_sft_uncond_prob_trains_the_seeded_share_of_pairs_on_the_negative_cond():
    pairs = make_pairs(16)
    for pair in pairs:
        pair.neg_cond = {key: torch.zeros_like(value) for key, value in pair.pos_cond.items()}
    ctx = make_ctx()
    ctx.args.sft_uncond_prob = 0.5
    batch = prepare_sft_batch(ctx, pairs)

    gen = make_generator("sample", 7, 2, 5, 1)
    torch.randint(0, 1000, (16,), generator=gen)
    torch.randn(16, C, H, W, generator=gen)
    drop = torch.rand(16, generator=gen) < 0.5
    assert 0 < drop.sum() < 16
    for j, pair in enumerate(pairs):
        expected = pair.neg_cond if drop[j] else pair.pos_cond
        assert torch.equal(batch.cond["pooled_projections"][j], expected["pooled_projections"])
    # Dropout draws come after the noise, so x_σ is the same as without dropout.
    ctx.args.sft_uncond_prob = 0.0
    assert torch.equal(prepare_sft_batch(ctx, pairs).latents, batch.latents)


def test_sft_uncond_prob_without_negative_cond_names_the_flag():
    ctx = make_ctx()
    ctx.args.sft_uncond_prob = 0.99
    with pytest.raises(ValueError, match="--sft-uncond-prob"):
        prepare_sft_batch(ctx, make_pairs(8))
