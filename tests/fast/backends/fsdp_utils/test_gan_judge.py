"""The options that make the DMD2 discriminator judge the prompt and resist pixel noise: the projection term
(Miyato & Koyama 2018) against a hand computation, the approximate R1 against autograd's R1, the matching-aware
rows (Reed et al. 2016), the critic batch and loss that hold them, and the GAN phase's start rollout.

Real parts: the tiny digits critic (an SD3 transformer), real sklearn digits; no process group is needed."""

import pytest
import torch
import torch.nn.functional as F

from miles.backends.fsdp_utils.loss_hub import dmd2 as dmd2_hub
from miles.backends.fsdp_utils.loss_hub.gan import (
    DISC_HEAD,
    DiscriminatorHead,
    approximate_r1,
    build_discriminator,
    mismatched_rows,
)
from miles.backends.fsdp_utils.trainer import host_values
from miles.models import get_model_family
from miles.utils.misc import make_generator
from miles.utils.sampling import forward_process
from miles.utils.types import DenoisingEnv, Sample, TrainPair
from tests.fast.backends.fsdp_utils.test_gan import _args, _cond, _ctx, _digits, _generator_inputs, _generator_step
from tests.support.trainer import TEXT_DIM, make_pipeline


def _tokens(batch: int, seed: int, width: int = 32) -> list[torch.Tensor]:
    return [torch.randn(batch, 16, width, generator=torch.Generator().manual_seed(seed))]


def test_the_projection_logit_is_psi_of_phi_plus_y_v_phi():
    torch.manual_seed(0)
    head = DiscriminatorHead(32, (4, 4), cond_dim=6, channels=16)
    features, y = _tokens(3, 1), torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    got = head(features, y)
    # by hand: φ = the trunk's (B, C) output, ψ = the last 1×1 convolution (w·φ + b), V = the projection's matrix
    grid = features[0].transpose(1, 2).reshape(3, 32, 4, 4)
    phi = head.heads[0][:-1](grid).flatten(1)
    psi = head.heads[0][-1]
    v = head.projections[0].weight  # (C, P)
    expected = phi @ psi.weight.view(-1) + psi.bias + ((y @ v.T) * phi).sum(dim=1)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # the prompt enters only through yᵀVφ: two prompts' logits differ by (y1 − y2)ᵀVφ
    other = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        head(features, other) - got, (((other - y) @ v.T) * phi).sum(dim=1), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="needs \\(B, P\\) prompt embeddings, got None"):
        head(features)


def test_without_projection_the_head_is_the_unconditional_head_bit_for_bit():
    torch.manual_seed(0)
    head = DiscriminatorHead(32, (4, 4), channels=16)
    features = _tokens(4, 5)
    grid = features[0].transpose(1, 2).reshape(4, 32, 4, 4)
    assert head.projections is None
    assert torch.equal(head(features), head.heads[0](grid).flatten(1).mean(dim=1))


def test_approximate_r1_is_alpha_squared_times_autograds_r1():
    """E_ε (D(x) − D(x + α·ε))² = α²·‖∇_x D(x)‖² + O(α³): the finite-difference R1 of FastGen against the
    gradient penalty of Mescheder et al. 2018, on a float64 conv head over a fixed linear patch embedding."""
    torch.manual_seed(0)
    head = DiscriminatorHead(8, (4, 4), channels=8, cond_dim=5).double()
    embed = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def disc(x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:  # x (B, 1, 8, 8) → 2×2 patches → tokens
        patches = x.unfold(2, 2, 2).unfold(3, 2, 2).reshape(len(x), 16, 4)
        return head([patches @ embed], cond)

    x = _digits(2).double().requires_grad_(True)
    (grad,) = torch.autograd.grad(disc(x, y).sum(), x)
    r1 = grad.flatten(1).pow(2).sum(dim=1)  # ‖∇_x D‖² per image
    alpha, draws = 1e-4, 20_000
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        base = disc(x, y)
        total = torch.zeros(2, dtype=torch.float64)
        for _ in range(draws // 500):
            eps = torch.randn(500, 2, 1, 8, 8, dtype=torch.float64, generator=generator)
            bumped = disc((x + alpha * eps).flatten(0, 1), y.repeat(500, 1)).view(500, 2)
            total += approximate_r1(base.expand(500, 2), bumped).double().sum(dim=0)
    estimate = total / draws / alpha**2
    assert r1.min() > 1e-3  # a real gradient
    # 20k draws of a one-degree chi-square: 1% relative standard error
    torch.testing.assert_close(estimate, r1, rtol=0.04, atol=0.0)


def test_mismatched_rows_pick_the_next_other_prompt():
    cond = {"pooled_projections": torch.tensor([[1.0], [1.0], [2.0], [3.0]])}
    rows, valid = mismatched_rows(cond)
    assert rows.tolist() == [2, 2, 3, 0] and valid.tolist() == [True] * 4
    rows, valid = mismatched_rows({"pooled_projections": torch.ones(3, 2)})
    assert rows.tolist() == [0, 1, 2] and valid.tolist() == [False] * 3


def _gan_pairs(count: int = 4) -> list[TrainPair]:
    real, fake, conds = _digits(count), _digits(count, offset=50) * 0.3, _cond(count, 0)
    real_conds = {key: value.clone() for key, value in conds.items()}
    real_conds["pooled_projections"][1] = real_conds["pooled_projections"][0]  # two reals share a prompt
    real_conds["encoder_hidden_states"][1] = real_conds["encoder_hidden_states"][0]
    return [
        TrainPair(
            sample_index=i,
            x0=fake[i],
            pos_cond={k: v[i] for k, v in conds.items()},
            extras={
                "real": Sample(i, f"real {i}", env=DenoisingEnv({k: v[i] for k, v in real_conds.items()}), x0=real[i])
            },
        )
        for i in range(count)
    ]


def test_the_critic_batch_adds_mismatched_and_perturbed_reals_and_the_loss_weighs_them(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    weights = dict(dmd2_gan_mismatch_weight=0.5, dmd2_gan_r1_weight=7.0, dmd2_gan_r1_alpha=0.1)
    args = _args(pipeline, dmd2_gan_projection=True, **weights)
    critic = family.load_denoiser(pipeline)
    critic.train()
    head = build_discriminator(args, {"transformer": critic})[DISC_HEAD]
    assert head.projections is not None and head.projections[0].in_features == TEXT_DIM
    ctx = _ctx(args, family, {"transformer": critic, DISC_HEAD: head})
    pairs = _gan_pairs()
    prepared = dmd2_hub.prepare_critic_gan_batch(ctx, pairs)
    plain = dmd2_hub.prepare_critic_gan_batch(_ctx(_args(pipeline), family, ctx.models), pairs)
    assert prepared.extras["gan_groups"] == ["fake", "real", "mismatch", "r1"] and prepared.latents.shape[0] == 20
    # the first 12 rows are the plain phase-2 batch's, bit for bit
    assert torch.equal(prepared.latents[:12], plain.latents) and torch.equal(prepared.timestep[:12], plain.timestep)
    # mismatch rows: the same noised reals with the next other real's prompt (rows 0 and 1 share one)
    assert torch.equal(prepared.latents[12:16], prepared.latents[8:12])
    pooled = prepared.cond["pooled_projections"]
    assert torch.equal(pooled[12:16], pooled[8:12][torch.tensor([2, 2, 3, 0])])
    # R1 rows: the reals bumped by α·ε' ("gan_r1" generator) before the reals' own noising
    real = torch.stack([p.extras["real"].x0 for p in pairs])
    bump = 0.1 * torch.randn(real.shape, generator=make_generator("gan_r1", 5, 2, 1, 0))
    sigma = prepared.extras["gan_sigma"][4:]
    noise = (prepared.latents[8:12] - (1 - sigma.float().view(-1, 1, 1, 1)) * real) / sigma.float().view(-1, 1, 1, 1)
    torch.testing.assert_close(
        prepared.latents[16:20], forward_process(real + bump, sigma, noise), rtol=1e-5, atol=1e-5
    )
    assert torch.equal(prepared.timestep[16:20], prepared.timestep[8:12])

    new_pred = ctx.predict_velocity(critic, prepared.latents, prepared.timestep, prepared.cond)
    metrics = {}
    loss = dmd2_hub.critic_gan_loss(ctx, pairs, prepared, new_pred=new_pred, metrics=metrics)
    metrics = host_values(metrics)  # the trainer's one read of a window's figures
    logits = head([f[4:] for f in head.tap.features], pooled[4:]).detach()
    fake_l, real_l, mismatch_l, r1_l = logits.split(4)
    sft = (new_pred[:4] - prepared.target).pow(2).flatten(1).mean(dim=1).detach()
    gan = F.softplus(fake_l) + F.softplus(-real_l) + 0.5 * F.softplus(mismatch_l) + 7.0 * (real_l - r1_l).pow(2)
    torch.testing.assert_close(loss.detach(), (sft + 1e-2 * gan).sum(), rtol=1e-5, atol=1e-6)
    assert metrics["gan_logit_mismatch"] == pytest.approx(mismatch_l.tolist(), abs=1e-6)
    assert metrics["gan_r1"] == pytest.approx((real_l - r1_l).pow(2).tolist(), abs=1e-6)
    loss.backward()
    assert head.projections[0].weight.grad.abs().sum() > 0  # the projection trains


def test_before_the_gan_start_rollout_the_student_update_is_phase_one(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    _, _, scores = _generator_inputs(family, pipeline)
    phase_one = {key: value for key, value in scores.items() if key != "g_gan"}
    loss_a, grads_a, _ = _generator_step(family, pipeline, phase_one, gen_weight=0.0)
    # the test context runs rollout 2: a start at 3 leaves the GAN out, a start at 2 takes it in
    loss_b, grads_b, _ = _generator_step(family, pipeline, scores, gen_weight=0.03, dmd2_gan_start_rollout=3)
    assert torch.equal(loss_a, loss_b) and all(torch.equal(grads_a[name], grads_b[name]) for name in grads_a)
    loss_c, _, _ = _generator_step(family, pipeline, scores, gen_weight=0.03, dmd2_gan_start_rollout=2)
    assert not torch.equal(loss_a, loss_c)


def test_a_projection_head_without_a_pooled_cond_is_named(tmp_path):
    from miles.backends.fsdp_utils.loss_hub.gan import pooled_embedding

    head = DiscriminatorHead(32, (4, 4), cond_dim=6, channels=16)
    with pytest.raises(ValueError, match="reads the prompt's pooled embedding cond\\['pooled_projections'\\]"):
        pooled_embedding(head, {"encoder_hidden_states": torch.zeros(1, 2, 3)})
    assert pooled_embedding(DiscriminatorHead(32, (4, 4), channels=16), {}) is None
