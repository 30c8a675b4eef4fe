"""A tiny random ``WanPipeline`` in Wan 2.1 T2V's layout (one transformer, no ``transformer_2``), or in Wan 2.2 T2V
A14B's (two experts: ``transformer`` for high noise, ``transformer_2`` for low noise, switched at ``boundary_ratio``),
nothing downloaded.

Components and the real checkpoints' counterparts (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` / ``-14B-Diffusers``):

* ``transformer``: ``WanTransformer3DModel``, 2 blocks, 2 heads × 12 (real 1.3B: 30 blocks, 12 × 128), patch
  ``(1, 2, 2)`` as in the real one, ``in_channels`` = ``out_channels`` = 4 latent channels (real 16), ``text_dim`` 16
  = UMT5's ``d_model`` (real 4096). The head dim 12 splits into rope axes t, h, w = 4, 4, 4 (the model gives h and w
  ``2 · (head_dim // 6)`` each and t the rest; real 128 → 44, 42, 42).
* ``vae``: ``AutoencoderKLWan`` with ``z_dim`` 4 and three downsamples, two of them temporal, as in the real VAE:
  spatial factor 8, temporal factor 4 (``num_frames = 4·k + 1`` frames → ``k + 1`` latent frames); per-channel
  ``latents_mean`` / ``latents_std`` drawn from the seed.
* ``text_encoder``: ``UMT5EncoderModel`` (2 layers, ``d_model`` 16) with a trained Unigram ``T5TokenizerFast``.
* ``scheduler``: the real checkpoints' ``UniPCMultistepScheduler`` in flow mode (``SCHEDULER_CONFIG``).
* two experts: ``transformer_2`` of the same config with its own random weights (the seed + 1), and the pipeline's
  ``boundary_ratio`` (Wan 2.2 T2V A14B's 0.875 by default: ``model_index.json`` of ``Wan-AI/Wan2.2-T2V-A14B-Diffusers``).

Shapes: video ``(3, 5, 32, 32)`` (C, F, H, W) → latents ``(4, 2, 4, 4)`` → 2 × 2 × 2 = 8 tokens.
"""

from pathlib import Path

from tests.support.tiny_pipelines.common import seeded, video_vae_kwargs, write_pipeline
from tests.support.tiny_pipelines.vocab import t5_tokenizer

__all__ = [
    "A14B_BOUNDARY_RATIO",
    "LATENT_CHANNELS",
    "NUM_FRAMES",
    "PIXEL_SIZE",
    "SCHEDULER_CONFIG",
    "TEXT_HIDDEN",
    "write_tiny_wan",
]

LATENT_CHANNELS = 4
TEXT_HIDDEN = 16
PIXEL_SIZE = 32  # a multiple of vae_scale_factor_spatial (8) × patch (2)
NUM_FRAMES = 5  # 4·1 + 1: two latent frames
# the scheduler diffusers' scripts/convert_wan_to_diffusers.py writes for Wan 2.1 / 2.2 T2V (flow_shift 3.0; 5.0 for
# TI2V-5B); sources in docs/families.md
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
}
# Wan 2.2 T2V A14B's boundary_ratio (its I2V A14B: 0.9)
A14B_BOUNDARY_RATIO = 0.875


def _transformer():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        text_dim=TEXT_HIDDEN,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def write_tiny_wan(folder: str | Path, seed: int = 0, boundary_ratio: float | None = None) -> Path:
    """Write a tiny random ``WanPipeline`` (text-to-video) directory to ``folder``: one expert, or two with
    ``boundary_ratio``.

    Args:
        folder: the pipeline directory (created if needed).
        seed: the weights and the VAE's latent statistics are a function of it.
        boundary_ratio: None for one expert (Wan 2.1 T2V); a ratio in (0, 1) adds ``transformer_2`` and sets the
            pipeline's ``boundary_ratio`` (Wan 2.2 T2V A14B: :data:`A14B_BOUNDARY_RATIO`).

    Returns:
        ``folder`` as a ``Path``; ``WanPipeline.from_pretrained(folder)`` opens it offline.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(model_max_length=512)
    umt5 = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=TEXT_HIDDEN,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    with seeded(seed):
        pipe = WanPipeline(
            transformer=_transformer(),
            vae=AutoencoderKLWan(**video_vae_kwargs(LATENT_CHANNELS, seed)),
            text_encoder=UMT5EncoderModel(umt5),
            tokenizer=tokenizer,
            scheduler=UniPCMultistepScheduler(**SCHEDULER_CONFIG),
        )
    if boundary_ratio is not None:
        with seeded(seed + 1):
            second = _transformer()
        pipe = WanPipeline(**{**pipe.components, "transformer_2": second}, boundary_ratio=boundary_ratio)
    return write_pipeline(pipe, folder)
