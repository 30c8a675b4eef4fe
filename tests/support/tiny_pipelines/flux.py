"""A tiny random ``FluxPipeline`` in FLUX.1-dev's layout (guidance-distilled: ``guidance_embeds=True``, dynamic
shift) or FLUX.1-schnell's (no guidance input, static shift 1), nothing downloaded.

Components and the real checkpoints' counterparts (``black-forest-labs/FLUX.1-dev`` / ``-schnell``):

* ``transformer``: ``FluxTransformer2DModel``, 1 double-stream + 1 single-stream block, 2 heads × 16 (real: 19 + 38,
  24 × 128), ``in_channels`` 16 = 4 latent channels × 2×2 packing (real 64 = 16 × 4), rope axes (4, 6, 6) summing to
  the head dim (real (16, 56, 56)), ``joint_attention_dim`` 32 = T5's ``d_model`` (real 4096),
  ``pooled_projection_dim`` 32 = CLIP's hidden size (real 768).
* ``vae``: ``AutoencoderKL`` with four blocks (spatial factor 8 as in the real one), 4 latent channels (real 16) and
  FLUX.1's ``scaling_factor`` 0.3611 / ``shift_factor`` 0.1159.
* ``text_encoder``: ``CLIPTextModel`` (2 layers, width 32; the pipeline takes its ``pooler_output``) with a trained
  ``CLIPTokenizer`` padded to 77; ``text_encoder_2``: ``T5EncoderModel`` (2 layers, ``d_model`` 32) with a trained
  Unigram ``T5TokenizerFast``.
* ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with the variant's real settings (``SCHEDULER_CONFIGS``).

Shapes: pixels ``(3, 32, 32)`` → latents ``(4, 4, 4)`` → 4 packed tokens of 16.
"""

from pathlib import Path

from tests.support.tiny_pipelines.common import image_vae_kwargs, seeded, write_pipeline
from tests.support.tiny_pipelines.vocab import clip_tokenizer, t5_tokenizer

__all__ = ["LATENT_CHANNELS", "PIXEL_SIZE", "SCHEDULER_CONFIGS", "VAE_FACTORS", "write_tiny_flux"]

LATENT_CHANNELS = 4
PIXEL_SIZE = 32
CLIP_HIDDEN = 32
T5_HIDDEN = 32
# black-forest-labs/FLUX.1-{dev,schnell} scheduler/scheduler_config.json (sources in docs/families.md)
SCHEDULER_CONFIGS = {
    "dev": {
        "base_image_seq_len": 256,
        "base_shift": 0.5,
        "max_image_seq_len": 4096,
        "max_shift": 1.15,
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": True,
    },
    "schnell": {
        "base_image_seq_len": 256,
        "base_shift": 0.5,
        "max_image_seq_len": 4096,
        "max_shift": 1.15,
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": False,
    },
}
# FLUX.1's VAE normalisation: z = (mode − shift_factor) · scaling_factor
VAE_FACTORS = {"scaling_factor": 0.3611, "shift_factor": 0.1159}


def write_tiny_flux(folder: str | Path, seed: int = 0, variant: str = "dev") -> Path:
    """Write a tiny random ``FluxPipeline`` directory to ``folder``.

    Args:
        folder: the pipeline directory (created if needed).
        seed: the weights are a function of it.
        variant: ``"dev"`` (guidance-distilled: ``guidance_embeds=True``, dynamic shift from the token count) or
            ``"schnell"`` (no guidance embedding, static shift 1).

    Returns:
        ``folder`` as a ``Path``; ``FluxPipeline.from_pretrained(folder)`` opens it offline.

    Raises:
        ValueError: on another variant.
    """
    if variant not in SCHEDULER_CONFIGS:
        raise ValueError(f"FLUX.1 variant {variant!r} is unknown; choose one of {list(SCHEDULER_CONFIGS)}")
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = clip_tokenizer(model_max_length=77)
    tokenizer_2 = t5_tokenizer(model_max_length=512)
    clip = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=CLIP_HIDDEN,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    t5 = T5Config(
        vocab_size=len(tokenizer_2),
        d_model=T5_HIDDEN,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id,
        decoder_start_token_id=tokenizer_2.pad_token_id,
    )
    with seeded(seed):
        pipe = FluxPipeline(
            transformer=FluxTransformer2DModel(
                patch_size=1,
                in_channels=LATENT_CHANNELS * 4,
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=T5_HIDDEN,
                pooled_projection_dim=CLIP_HIDDEN,
                guidance_embeds=variant == "dev",
                axes_dims_rope=(4, 6, 6),
            ),
            vae=AutoencoderKL(
                **image_vae_kwargs(LATENT_CHANNELS, PIXEL_SIZE),
                use_quant_conv=False,  # as in FLUX.1's VAE config
                use_post_quant_conv=False,
                **VAE_FACTORS,
            ),
            text_encoder=CLIPTextModel(clip),
            tokenizer=tokenizer,
            text_encoder_2=T5EncoderModel(t5),
            tokenizer_2=tokenizer_2,
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS[variant]),
        )
    return write_pipeline(pipe, folder)
