"""A tiny random SD3 pipeline written with ``save_pretrained`` (nothing is downloaded): the sd3 family's tests and
the DMD2 end-to-end run use it."""

import json
from pathlib import Path

import torch


def tiny_clip_tokenizer(folder: Path):
    """A byte-level CLIP BPE tokenizer with no merges, written to ``folder``: every character is a token.

    Returns:
        ``(tokenizer, vocab_size)``.
    """
    from transformers import CLIPTokenizer

    codes = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars = [chr(c) for c in codes] + [chr(256 + i) for i in range(256 - len(codes))]
    vocab = ["<|startoftext|>", "<|endoftext|>"] + chars + [c + "</w>" for c in chars]
    (folder / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=12), len(vocab)


def tiny_sd3_pipeline(folder: Path):
    """A tiny random ``StableDiffusion3Pipeline`` (1 transformer layer over 4×8×8 latents, two 2-layer CLIP text
    encoders of width 16, no T5, a one-block VAE with scaling 1.5 and shift 0.1), saved to ``folder/pipe``.

    Returns:
        ``(pipe, folder / "pipe")``: the in-memory pipeline and its directory.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab_size = tiny_clip_tokenizer(folder)
    # diffusers and transformers initialise weights from the global RNG: fork it, so the caller's stays untouched.
    with torch.random.fork_rng(devices=[]):
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
