"""DMD2 phase 2: the discriminator head on the critic, its losses, and the GAN gradient the critic ships.

Real parts: a tiny digits critic (an SD3 transformer) from ``init_digits_pipeline``, real sklearn digits as the
real images, FSDP2 on a 1-rank gloo process group for the sharded side.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from miles.backends.fsdp_utils.loss_hub import dmd2 as dmd2_hub
from miles.backends.fsdp_utils.loss_hub.dmd2_types import DMD2Pair
from miles.backends.fsdp_utils.loss_hub.gan import (
    DISC_HEAD,
    DiscriminatorHead,
    build_discriminator,
    disc_loss_terms,
    generator_gan_gradient,
)
from miles.backends.fsdp_utils.loss_hub.types import TrainContext
from miles.backends.fsdp_utils.model import shard_model
from miles.backends.fsdp_utils.trainer import host_values
from miles.models import ModelFamily, TrueCFG, get_model_family
from miles.utils.sampling import forward_process
from miles.utils.types import DenoisingEnv, Sample, TrainPair
from tests.support.trainer import TEXT_DIM, dmd2_args, make_pipeline, single_process_group

COND_LEN = 16


def _args(pipeline, **overrides):
    base = dict(
        hf_checkpoint=str(pipeline),
        diffusion_model_family=None,
        dmd2_gan_feature_blocks=None,
        dmd2_gan_disc_weight=1e-2,
        dmd2_gan_gen_weight=3e-3,
        seed=5,
        fsdp_flow_shift=3.0,
        dmd2_min_timestep_ratio=0.02,
        dmd2_max_timestep_ratio=0.98,
        micro_batch_size=4,
        dmd2_teacher_guidance_scale=1.0,
        sft_uncond_prob=0.0,
    )
    base.update(overrides)
    return dmd2_args(**base)


def _ctx(args, family, models, teacher=None, external=None):
    return TrainContext(
        args=args,
        models=models,
        teacher_models={"transformer": teacher} if teacher is not None else {},
        external_data=external or {},
        family=family,
        device=torch.device("cpu"),
        dtype=torch.float32,
        rollout_id=2,
        microbatch_id=1,
    )


def _cond(batch: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "encoder_hidden_states": torch.randn(batch, COND_LEN, TEXT_DIM, generator=gen),
        "pooled_projections": torch.randn(batch, TEXT_DIM, generator=gen),
    }


def _digits(count: int, offset: int = 0) -> torch.Tensor:
    from sklearn.datasets import load_digits

    images = load_digits().images[offset : offset + count]
    return torch.from_numpy(images / 16.0 * 2 - 1).float().unsqueeze(1)  # (N, 1, 8, 8) in [-1, 1]


def test_the_head_reads_the_middle_block_and_gives_one_logit_per_image(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    critic = family.load_denoiser(pipeline)
    head = build_discriminator(_args(pipeline), {"transformer": critic})[DISC_HEAD]
    assert isinstance(head, DiscriminatorHead) and head.tap.block_indices == [1]  # 2 blocks: the middle is 1
    assert head.grid == (4, 4)  # 8×8 pixels, patch 2
    family.predict_velocity(critic, torch.randn(3, 1, 8, 8), torch.full((3,), 500.0), _cond(3, 0))
    assert len(head.tap.features) == 1 and head.tap.features[0].shape == (3, 16, 32)
    logits = head(head.tap.features)
    assert logits.shape == (3,) and logits.dtype == torch.float32
    # Two tapped blocks: two heads, averaged.
    two = build_discriminator(_args(pipeline, dmd2_gan_feature_blocks=[0, 1]), {"transformer": critic})[DISC_HEAD]
    family.predict_velocity(critic, torch.randn(2, 1, 8, 8), torch.full((2,), 500.0), _cond(2, 1))
    assert len(two.heads) == 2 and two(two.tap.features[-2:]).shape == (2,)


def test_g_gan_equals_autograd_through_an_unsharded_copy(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    args = _args(pipeline)
    x0, cond = _digits(4), _cond(4, 3)
    sigma = torch.tensor([0.3, 0.5, 0.7, 0.9], dtype=torch.float64)
    timestep = (sigma * 1000).float()
    noise = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(9))

    critic = family.load_denoiser(pipeline)
    critic.train().requires_grad_(True)
    head = build_discriminator(args, {"transformer": critic})[DISC_HEAD]
    # The reference: a plain copy of critic and head, its own hook on the middle block, autograd by hand.
    ref_critic, ref_head = copy.deepcopy(critic), copy.deepcopy(head)
    ref_critic._forward_pre_hooks.clear()
    for block in ref_critic.transformer_blocks:
        block._forward_hooks.clear()
    captured = []
    ref_critic.transformer_blocks[1].register_forward_hook(lambda m, i, out: captured.append(out[1]))
    x = x0.clone().requires_grad_(True)
    family.predict_velocity(ref_critic, forward_process(x, sigma, noise), timestep, cond)
    (expected,) = torch.autograd.grad(F.softplus(-ref_head(captured)).sum(), x)

    with single_process_group() as mesh:
        shard_model(critic, [], mesh, torch.float32, reshard_after_forward=False)
        shard_model(head, [], mesh, torch.float32, reshard_after_forward=False)
        ctx = _ctx(args, family, {"transformer": critic, DISC_HEAD: head})
        got, logits = generator_gan_gradient(ctx, x0, cond, sigma, timestep, noise)
        # The weights are untouched: no gradient reached them, and they still require grad afterwards.
        assert all(p.grad is None and p.requires_grad for p in [*critic.parameters(), *head.parameters()])
    assert got.shape == x0.shape and logits.shape == (4,)
    assert (got - expected).abs().max() <= 1e-6
    assert expected.abs().max() > 1e-4  # a real gradient


def test_the_head_learns_real_digits_from_noised_fakes(tmp_path):
    """A separable toy: real digits against uniform-noise 'fakes', both noised at σ ≤ 0.5; the discriminator loss
    of the critic with its head falls at every one of a few Adam steps."""
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    args = _args(pipeline)
    critic = family.load_denoiser(pipeline)
    critic.train().requires_grad_(True)
    head = build_discriminator(args, {"transformer": critic})[DISC_HEAD]
    real = _digits(16)
    fake = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1
    cond = _cond(16, 2)
    sigma = torch.full((32,), 0.25, dtype=torch.float64)
    noise = torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    optimizer = torch.optim.Adam([*critic.parameters(), *head.parameters()], lr=3e-4)
    losses = []
    for _ in range(6):
        both = {key: torch.cat([value, value]) for key, value in cond.items()}
        family.predict_velocity(
            critic, forward_process(torch.cat([fake, real]), sigma, noise), (sigma * 1000).float(), both
        )
        logits = head(head.tap.features)
        loss = disc_loss_terms(logits[:16], logits[16:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1


def _generator_inputs(family, pipeline):
    student = family.load_denoiser(pipeline)
    student.train()
    pairs = []
    latents = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    conds = _cond(3, 5)
    for i in range(3):
        pairs.append(
            DMD2Pair(
                sample_index=i,
                x0=latents[i] * 0.5,
                pos_cond={key: value[i] for key, value in conds.items()},
                latent=latents[i],
                sigma=0.75,
                timestep=750.0,
                step_index=2,
            )
        )
    gen = torch.Generator().manual_seed(8)
    scores = {
        "sample_index": torch.arange(3),
        "x0_real": torch.randn(3, 1, 8, 8, generator=gen),
        "x0_fake": torch.randn(3, 1, 8, 8, generator=gen),
        "g_gan": torch.randn(3, 1, 8, 8, generator=gen) * 1e-2,
    }
    return student, pairs, scores


def _generator_step(family, pipeline, scores, gen_weight, **overrides):
    student, pairs, _ = _generator_inputs(family, pipeline)
    args = _args(pipeline, dmd2_gan_gen_weight=gen_weight, **overrides)
    ctx = _ctx(args, family, {"transformer": student}, external={"critic": scores})
    prepared = dmd2_hub.prepare_generator_batch(ctx, pairs)
    new_pred = ctx.predict_velocity(student, prepared.latents, prepared.timestep, prepared.cond)
    metrics = {}
    loss = dmd2_hub.dmd2_loss_formula(ctx, pairs, prepared, new_pred=new_pred, metrics=metrics)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters()}, host_values(metrics)


def test_with_gan_weight_zero_the_actor_update_is_phase_one_bit_for_bit(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    _, _, scores = _generator_inputs(family, pipeline)
    phase_one = {key: value for key, value in scores.items() if key != "g_gan"}
    loss_a, grads_a, _ = _generator_step(family, pipeline, phase_one, gen_weight=0.0)
    loss_b, grads_b, metrics = _generator_step(family, pipeline, scores, gen_weight=0.0)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[name], grads_b[name]) for name in grads_a)
    assert metrics["dmd2_gan_dm_grad_ratio"] == [0.0, 0.0, 0.0]


def test_the_gan_gradient_enters_the_surrogate_with_the_reference_scaling(tmp_path):
    """∂loss/∂x0 = g/numel + w·g_gan per pair (tianweiy/DMD2's loss_dm + w·gen_cls_loss)."""
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    student, pairs, scores = _generator_inputs(family, pipeline)
    weight = 3e-3
    args = _args(pipeline, dmd2_gan_gen_weight=weight)
    ctx = _ctx(args, family, {"transformer": student}, external={"critic": scores})
    prepared = dmd2_hub.prepare_generator_batch(ctx, pairs)
    v = ctx.predict_velocity(student, prepared.latents, prepared.timestep, prepared.cond).detach().requires_grad_(True)
    metrics = {}
    loss = dmd2_hub.dmd2_loss_formula(ctx, pairs, prepared, new_pred=v, metrics=metrics)
    metrics = host_values(metrics)
    (grad_v,) = torch.autograd.grad(loss, v)
    x0 = prepared.latents - 0.75 * v.detach()
    normalizer = (x0 - scores["x0_real"]).abs().mean(dim=(1, 2, 3), keepdim=True)
    g = (scores["x0_fake"] - scores["x0_real"]) / normalizer
    expected_x0_grad = g / 64 + weight * scores["g_gan"]
    # x0 = x_i − σ·v, so ∂loss/∂v = −σ·∂loss/∂x0.
    torch.testing.assert_close(grad_v, -0.75 * expected_x0_grad, rtol=1e-5, atol=1e-7)
    ratios = (weight * 64 * scores["g_gan"]).flatten(1).norm(dim=1) / g.flatten(1).norm(dim=1)
    np.testing.assert_allclose(metrics["dmd2_gan_dm_grad_ratio"], ratios.numpy(), rtol=1e-5)


def test_the_critic_gan_batch_runs_sft_fakes_and_reals_in_one_forward(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    args = _args(pipeline)
    critic = family.load_denoiser(pipeline)
    critic.train()
    head = build_discriminator(args, {"transformer": critic})[DISC_HEAD]
    ctx = _ctx(args, family, {"transformer": critic, DISC_HEAD: head})
    real, fake, conds, real_conds = _digits(4), _digits(4, offset=50) * 0.3, _cond(4, 0), _cond(4, 1)
    pairs = [
        TrainPair(
            sample_index=i,
            x0=fake[i],
            pos_cond={k: v[i] for k, v in conds.items()},
            extras={
                "real": Sample(i, f"real {i}", env=DenoisingEnv({k: v[i] for k, v in real_conds.items()}), x0=real[i])
            },
        )
        for i in range(4)
    ]
    prepared = dmd2_hub.prepare_critic_gan_batch(ctx, pairs)
    sft = dmd2_hub.prepare_critic_batch(ctx, pairs)
    assert prepared.latents.shape == (12, 1, 8, 8) and prepared.extras["gan_batch"] == 4
    assert torch.equal(prepared.latents[:4], sft.latents) and torch.equal(prepared.target, sft.target)
    assert torch.equal(prepared.cond["encoder_hidden_states"][8:], real_conds["encoder_hidden_states"])
    # The same seed, rollout, micro-batch and rank: the same diffusion-GAN draws.
    assert torch.equal(dmd2_hub.prepare_critic_gan_batch(ctx, pairs).latents, prepared.latents)
    new_pred = ctx.predict_velocity(critic, prepared.latents, prepared.timestep, prepared.cond)
    metrics = {}
    loss = dmd2_hub.critic_gan_loss(ctx, pairs, prepared, new_pred=new_pred, metrics=metrics)
    metrics = host_values(metrics)
    sft_sum = (new_pred[:4] - sft.target).pow(2).flatten(1).mean(dim=1).sum()
    disc = torch.tensor(metrics["gan_disc_loss"]).sum()
    torch.testing.assert_close(loss, sft_sum + 1e-2 * disc, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert all(p.grad is not None for p in head.parameters())  # the head trains
    assert set(metrics) == {"sft_loss", "gan_disc_loss", "gan_logit_real", "gan_logit_fake"}
    missing = [TrainPair(sample_index=0, x0=fake[0], pos_cond=pairs[0].pos_cond)]
    try:
        dmd2_hub.prepare_critic_gan_batch(ctx, missing)
    except ValueError as exc:
        assert "--dmd2-gan-real-data" in str(exc)
    else:
        raise AssertionError("a pair without its real sample was accepted")


def test_a_video_grid_runs_each_frame_through_the_2d_head_and_averages_the_frames():
    torch.manual_seed(0)
    video = DiscriminatorHead(24, (3, 4, 4), num_features=2)
    image = DiscriminatorHead(24, (4, 4), num_features=2)
    image.load_state_dict(video.state_dict())  # one design: the same parameters judge a frame and an image
    gen = torch.Generator().manual_seed(1)
    features = [torch.randn(2, 3 * 16, 24, generator=gen) for _ in range(2)]  # (B, f·h·w, D), row-major f, h, w
    frames = [tokens.view(2, 3, 16, 24).reshape(6, 16, 24) for tokens in features]  # (B·f, h·w, D)
    torch.testing.assert_close(video(features), image(frames).view(2, 3).mean(dim=1), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="expected 3×4×4 image tokens, got 16"):
        video([tokens[:, :16] for tokens in features])
    with pytest.raises(ValueError, match=r"a token grid is \(h, w\) or \(f, h, w\)"):
        DiscriminatorHead(24, (2, 3, 4, 4))


def test_a_family_without_a_feature_tap_gets_no_gan_head(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    args = _args(pipeline, diffusion_model_family=f"{__name__}.NoTapFamily")
    critic = get_model_family(pipeline).load_denoiser(pipeline)
    with pytest.raises(ValueError, match=r"the DMD2 GAN head .* needs a model family that implements .*TokenFeatures"):
        build_discriminator(args, {"transformer": critic})


class NoTapFamily(ModelFamily, TrueCFG):
    """A complete family that declares no TokenFeatures (the GAN head refuses it before calling anything)."""

    name, pipeline_classes = "no_tap_test", ()

    def load_denoiser(self, path, dtype=torch.float32):
        raise AssertionError("not reached")

    load_text_encoder = encode_prompts = latent_shape = predict_velocity = blocks = load_denoiser
