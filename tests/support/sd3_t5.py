"""A tiny random SD3 pipeline with all three text encoders (CLIP-L and CLIP-G shaped CLIPs plus a T5), nothing
downloaded.

The layout is the one SD3 / SD3.5 checkpoints ship: ``transformer/``, ``vae/``, ``scheduler/``, ``text_encoder/``,
``text_encoder_2/``, ``text_encoder_3/`` (``T5EncoderModel``) and their tokenizers, written by ``save_pretrained``.
The sizes are chosen so that one forward takes milliseconds on a CPU while every shape rule of the real pipeline
holds: CLIP pads to 77 tokens, T5 to the pipeline's ``max_sequence_length`` (256), both CLIP hidden states
together and T5's ``d_model`` equal the transformer's ``joint_attention_dim`` (32), and the two pooled CLIP
projections make its ``pooled_projection_dim`` (32). The VAE has two blocks, so its downscale factor is 2 and the
pipeline's pixel size is 16 × 16 for 8 × 8 latents.
"""

import json
import string
from pathlib import Path

import torch

__all__ = ["CLIP_TOKENS", "JOINT_DIM", "PIXEL_SIZE", "tiny_sd3_t5_pipeline"]

CLIP_TOKENS = 77  # CLIP's model_max_length in SD3's tokenizers
JOINT_DIM = 32  # transformer joint_attention_dim = T5 d_model = 2 × CLIP hidden size
PIXEL_SIZE = 16  # transformer sample_size 8 × VAE downscale factor 2


def _clip_tokenizer(folder: Path):
    """A byte-level CLIP BPE tokenizer with no merges (every character is a token), padded to 77 tokens."""
    from transformers import CLIPTokenizer

    codes = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars = [chr(c) for c in codes] + [chr(256 + i) for i in range(256 - len(codes))]
    vocab = ["<|startoftext|>", "<|endoftext|>"] + chars + [c + "</w>" for c in chars]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=CLIP_TOKENS)
    return tokenizer, len(vocab)


def _t5_tokenizer():
    """A Unigram T5 tokenizer over single characters: ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2 as in T5, then the
    word-start marker, printable ASCII with and without it; no sentinel tokens."""
    from transformers import T5TokenizerFast

    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{c}", -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def tiny_sd3_t5_pipeline(folder: str | Path, seed: int = 0) -> Path:
    """Write a tiny random ``StableDiffusion3Pipeline`` with CLIP×2 and T5 to ``<folder>/pipe``.

    Args:
        folder: a directory (created if needed); the CLIP vocabulary files go beside the pipeline.
        seed: the weights are a function of it (the global RNG is forked, so the caller's stays untouched).

    Returns:
        The pipeline directory ``<folder>/pipe``: latents ``(4, 8, 8)``, pixels ``16 × 16 × 3``, prompt embeddings
        ``(77 + 256, 32)``, pooled ``(32,)``, scheduler ``FlowMatchEulerDiscreteScheduler(shift=3)``.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    folder = Path(folder)
    clip_tokenizer, clip_vocab = _clip_tokenizer(folder / "clip_vocab")
    t5_tokenizer = _t5_tokenizer()
    clip = CLIPTextConfig(
        vocab_size=clip_vocab,
        hidden_size=JOINT_DIM // 2,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_TOKENS,
        projection_dim=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    t5 = T5Config(
        vocab_size=len(t5_tokenizer),
        d_model=JOINT_DIM,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(
                sample_size=8,
                patch_size=2,
                in_channels=4,
                out_channels=4,
                num_layers=2,
                attention_head_dim=8,
                num_attention_heads=2,
                joint_attention_dim=JOINT_DIM,
                caption_projection_dim=16,  # diffusers 0.42: must equal heads × head_dim
                pooled_projection_dim=32,
                pos_embed_max_size=4,
            ),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=AutoencoderKL(
                in_channels=3,
                out_channels=3,
                down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
                block_out_channels=(8, 8),
                layers_per_block=1,
                latent_channels=4,
                norm_num_groups=2,
                sample_size=PIXEL_SIZE,
                scaling_factor=1.5,
                shift_factor=0.1,
                use_quant_conv=False,
                use_post_quant_conv=False,
            ),
            text_encoder=CLIPTextModelWithProjection(clip),
            tokenizer=clip_tokenizer,
            text_encoder_2=CLIPTextModelWithProjection(clip),
            tokenizer_2=clip_tokenizer,
            text_encoder_3=T5EncoderModel(t5),
            tokenizer_3=t5_tokenizer,
        )
    pipe.save_pretrained(folder / "pipe")
    return folder / "pipe"
