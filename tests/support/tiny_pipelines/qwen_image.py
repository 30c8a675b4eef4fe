"""A tiny random ``QwenImagePipeline`` (Qwen-Image's layout, nothing downloaded).

Components and the real checkpoint's counterpart (``Qwen/Qwen-Image``):

* ``transformer``: ``QwenImageTransformer2DModel``, 2 double-stream blocks, 2 heads × 16 (real: 60 blocks, 24 × 128),
  ``in_channels`` 16 = 4 latent channels × 2×2 patch (real 64 = 16 × 4), rope axes (8, 4, 4) summing to the head
  dim (real (16, 56, 56)), ``joint_attention_dim`` 16 = the text encoder's hidden size (real 3584).
* ``vae``: ``AutoencoderKLQwenImage`` with ``z_dim`` 4 and three downsamples (real: 16 channels, the same three),
  so the spatial factor is 8 as in the real VAE; per-channel ``latents_mean`` / ``latents_std`` drawn from the seed.
* ``text_encoder``: ``Qwen2_5_VLForConditionalGeneration``, 2 text layers of width 16 and a 1-block vision tower;
  ``tokenizer``: a trained byte-level BPE ``Qwen2Tokenizer`` in which the pipeline's template header is 34 tokens,
  the drop index the pipeline hard-codes.
* ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's dynamic shift (see ``SCHEDULER_CONFIG``).

Shapes: pixels ``(3, 32, 32)`` → latents ``(4, 1, 4, 4)`` (the VAE is 3-D: a frame axis of 1) → 4 tokens of 16.
"""

from pathlib import Path

from tests.support.tiny_pipelines.common import seeded, video_vae_kwargs, write_pipeline
from tests.support.tiny_pipelines.vocab import qwen_tokenizer

__all__ = ["LATENT_CHANNELS", "PIXEL_SIZE", "SCHEDULER_CONFIG", "TEXT_HIDDEN", "write_tiny_qwen_image"]

LATENT_CHANNELS = 4
TEXT_HIDDEN = 16
PIXEL_SIZE = 32  # the smallest size the pipeline takes: a multiple of vae_scale_factor (8) × 2
# Qwen/Qwen-Image scheduler/scheduler_config.json (the sources are in docs/families.md)
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def write_tiny_qwen_image(folder: str | Path, seed: int = 0) -> Path:
    """Write a tiny random ``QwenImagePipeline`` directory to ``folder``.

    Args:
        folder: the pipeline directory (created if needed).
        seed: the weights and the VAE's latent statistics are a function of it.

    Returns:
        ``folder`` as a ``Path``; ``QwenImagePipeline.from_pretrained(folder)`` opens it offline.
    """
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = qwen_tokenizer(special_tokens=_VISION_TOKENS)
    vision_ids = tokenizer.convert_tokens_to_ids(list(_VISION_TOKENS))
    text_config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 2048,
            # multimodal rope: the (t, h, w) sections sum to half the head dim (16 / 2 / 2 = 4)
            "rope_scaling": {"type": "default", "rope_type": "default", "mrope_section": [1, 1, 2]},
            "rope_theta": 1000000.0,
            "bos_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.pad_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        vocab_size=len(tokenizer),
        vision_start_token_id=vision_ids[0],
        vision_end_token_id=vision_ids[1],
        image_token_id=vision_ids[2],
        video_token_id=vision_ids[3],
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.pad_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with seeded(seed):
        pipe = QwenImagePipeline(
            transformer=QwenImageTransformer2DModel(
                patch_size=2,
                in_channels=LATENT_CHANNELS * 4,
                out_channels=LATENT_CHANNELS,
                num_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=TEXT_HIDDEN,
                guidance_embeds=False,
                axes_dims_rope=(8, 4, 4),
            ),
            vae=AutoencoderKLQwenImage(**video_vae_kwargs(LATENT_CHANNELS, seed)),
            text_encoder=Qwen2_5_VLForConditionalGeneration(text_config),
            tokenizer=tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        )
    return write_pipeline(pipe, folder)
