"""The sd3 family on a tiny random StableDiffusion3Pipeline written with save_pretrained (nothing is downloaded)."""

import json

import pytest
import torch

from miles.models import get_model_family
from miles.models.sd3 import SD3Family
from miles.rollout.engine import DiffusionEngine
from miles.utils.arguments import parse_args


def _tiny_clip_tokenizer(folder):
    """A byte-level CLIP BPE tokenizer with no merges: every character is a token."""
    from transformers import CLIPTokenizer

    codes = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars = [chr(c) for c in codes] + [chr(256 + i) for i in range(256 - len(codes))]
    vocab = ["<|startoftext|>", "<|endoftext|>"] + chars + [c + "</w>" for c in chars]
    (folder / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=12), len(vocab)


def _tiny_sd3_pipeline(folder):
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab_size = _tiny_clip_tokenizer(folder)
    torch.manual_seed(0)
    clip = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=12,
        projection_dim=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,
            caption_projection_dim=16,
            pooled_projection_dim=32,
            pos_embed_max_size=4,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",),
            block_out_channels=(8,),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=2,
            sample_size=8,
            scaling_factor=1.5,
            shift_factor=0.1,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
        text_encoder=CLIPTextModelWithProjection(clip),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(clip),
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.save_pretrained(folder / "pipe")
    return pipe, folder / "pipe"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3"))


def test_family_is_picked_and_loads_the_saved_transformer(tiny):
    pipe, path = tiny
    family = get_model_family(path)
    assert isinstance(family, SD3Family) and family.name == "sd3"
    assert family.load_scheduler_config(path) == {"shift": 3.0, "num_train_timesteps": 1000}
    assert family.latent_shape(path) == (4, 8, 8)
    denoiser = family.load_denoiser(path)
    reference = pipe.transformer.state_dict()
    for key, value in denoiser.state_dict().items():
        assert torch.equal(value, reference[key]), key
    assert family.no_split_modules(denoiser) == ["JointTransformerBlock"]


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


def test_engine_runs_one_rollout_from_disk(tiny):
    _, path = tiny
    args = parse_args(
        ["--hf-checkpoint", str(path), "--prompt-data", "unused.jsonl", "--num-rollout", "1"]
        + ["--rollout-batch-size", "2", "--diffusion-guidance-scale", "2.0"]
    )
    family = get_model_family(path)
    engine = DiffusionEngine(args, family, path, device="cpu")
    samples = engine.generate(["a cat", "a dog"], [0, 1], rollout_id=0, stop_steps=[2, None])
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
