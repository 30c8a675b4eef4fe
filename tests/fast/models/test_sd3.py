"""The sd3 family on a tiny random StableDiffusion3Pipeline written with save_pretrained (nothing is downloaded)."""

import pytest
import torch

from miles.driver.arguments import parse_args
from miles.models import ModelFamily, get_model_family
from miles.models.base import read_scheduler_config
from miles.models.sd3 import SD3Family
from tests.support.rollout import STOP_STEPS_HOOK, make_engine, prompt_shard
from tests.support.sd3 import tiny_sd3_pipeline


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3"))


def test_family_is_picked_and_loads_the_saved_transformer(tiny):
    pipe, path = tiny
    family = get_model_family(path)
    assert isinstance(family, SD3Family) and family.name == "sd3"
    assert isinstance(family, ModelFamily)
    assert read_scheduler_config(path) == {"shift": 3.0, "num_train_timesteps": 1000}
    assert family.latent_shape(path) == (4, 8, 8)
    denoiser = family.load_denoiser(path)
    reference = pipe.transformer.state_dict()
    for key, value in denoiser.state_dict().items():
        assert torch.equal(value, reference[key]), key
    # The blocks FSDP shards one by one: diffusers' _no_split_modules of SD3.
    assert family.blocks(denoiser) == list(denoiser.transformer_blocks)
    assert [type(block).__name__ for block in family.blocks(denoiser)] == denoiser._no_split_modules


def test_prompts_encode_like_the_pipeline(tiny):
    pipe, path = tiny
    family = get_model_family(path)
    cond = family.encode_prompts(family.load_text_encoder(path), ["a cat", "two dogs"])
    expected, _, expected_pooled, _ = pipe.encode_prompt(
        ["a cat", "two dogs"], None, None, device="cpu", do_classifier_free_guidance=False
    )
    # 12 CLIP tokens, then 256 zero rows in T5's place (the pipeline was saved without text_encoder_3)
    assert cond["encoder_hidden_states"].shape == (2, 12 + 256, 32)
    assert cond["pooled_projections"].shape == (2, 32)
    torch.testing.assert_close(cond["encoder_hidden_states"], expected.float())
    torch.testing.assert_close(cond["pooled_projections"], expected_pooled.float())
    assert not torch.equal(cond["pooled_projections"][0], cond["pooled_projections"][1])


def test_latents_use_the_vae_scaling_and_shift(tiny):
    pipe, path = tiny
    family = get_model_family(path)
    images = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    latents = family.images_to_latents(images)
    assert latents.shape == (2, 4, 8, 8) and latents.dtype == torch.float32
    with torch.no_grad():
        mode = pipe.vae.encode(images.permute(0, 3, 1, 2).float() / 255 * 2 - 1).latent_dist.mode()
        torch.testing.assert_close(latents, (mode - 0.1) * 1.5)
        decoded = pipe.vae.decode(latents / 1.5 + 0.1).sample
    out = family.latents_to_images(latents)
    assert out.shape == (2, 8, 8, 3) and out.dtype == torch.uint8
    expected = ((decoded + 1) / 2 * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(out, expected)


def test_the_differentiable_decode_is_the_vae_decode_with_the_vaes_gradient(tiny):
    # DMDR's reward reads these pixels: the float decode of latents_to_images, and autograd through the frozen VAE.
    pipe, path = tiny
    family = get_model_family(path)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    pixels = family.latents_to_pixels(latents)
    with torch.no_grad():
        decoded = pipe.vae.decode(latents / 1.5 + 0.1).sample
    torch.testing.assert_close(pixels, (decoded + 1) / 2)
    weights = torch.randn(pixels.shape, generator=torch.Generator().manual_seed(3))
    (grad,) = torch.autograd.grad((pixels * weights).sum(), latents)
    reference = latents.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(
        ((pipe.vae.decode(reference / 1.5 + 0.1).sample + 1) / 2 * weights).sum(), reference
    )
    torch.testing.assert_close(grad, expected)
    assert grad.abs().max() > 0 and not any(p.requires_grad for p in family.vae.parameters())


def test_engine_runs_one_rollout_from_disk(tiny):
    _, path = tiny
    args = parse_args(
        ["--hf-checkpoint", str(path), "--prompt-data", "unused.jsonl", "--num-rollout", "1"]
        + ["--rollout-batch-size", "2", "--diffusion-guidance-scale", "2.0"]
    )
    args.diffusion_step_strategy_path, args.test_stop_steps = STOP_STEPS_HOOK, {0: 2}
    family = get_model_family(path)
    engine = make_engine(args, path, family=family)
    samples = engine.generate(prompt_shard(0, ["a cat", "a dog"]))
    stopped, full = samples
    assert stopped.trajectory.step_indices == [2] and stopped.trajectory.final is None
    assert stopped.trajectory.latents.shape == (1, 4, 8, 8)
    assert full.trajectory.latents.shape == (4, 4, 8, 8) and full.trajectory.final.shape == (4, 8, 8)
    assert set(full.env.neg_cond) == {"encoder_hidden_states", "pooled_projections"}
    # x̂0_2 = x_2 − σ_2·v with CFG, recomputed by hand
    x = stopped.trajectory.latents
    cond = {key: value[None] for key, value in stopped.env.pos_cond.items()}
    neg = {key: value[None] for key, value in stopped.env.neg_cond.items()}
    t = torch.tensor([750.0])
    with torch.no_grad():
        v_c = family.predict_velocity(engine.denoiser, x, t, cond)
        v_u = family.predict_velocity(engine.denoiser, x, t, neg)
    torch.testing.assert_close(stopped.trajectory.x0_preds, x - 0.75 * (v_u + 2.0 * (v_c - v_u)), rtol=0, atol=1e-5)
    assert torch.isfinite(full.trajectory.final).all()
