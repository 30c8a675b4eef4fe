"""A tiny random ``Flux2KleinPipeline`` in FLUX.2-klein's layout, nothing downloaded.

Components and the real checkpoints' counterparts (``black-forest-labs/FLUX.2-klein-base-4B``, the undistilled
teacher, and ``FLUX.2-klein-4B``, its step-distilled release):

* ``transformer``: ``Flux2Transformer2DModel``, 1 double-stream + 1 single-stream block, 2 heads × 16 (real: 5 + 20,
  24 × 128), ``in_channels`` 16 = 4 latent channels × 2×2 patchify (real 128 = 32 × 4), four rope axes (4, 4, 4, 4)
  summing to the head dim (real (32, 32, 32, 32)), no guidance embedding (klein has none), ``joint_attention_dim``
  24 = 3 × the text encoder's width (real 7680 = 3 × 2560: the pipeline stacks three hidden layers).
* ``vae``: ``AutoencoderKLFlux2`` with four blocks (spatial factor 8 as in the real one), 4 latent channels (real 32)
  and batch-norm statistics over the 16 patchified channels drawn from the seed (a new BatchNorm holds mean 0 and
  variance 1, which would hide a missing normalisation).
* ``text_encoder``: ``Qwen3ForCausalLM`` of width 8 with 28 layers, the fewest for which the pipeline's default
  ``text_encoder_out_layers=(9, 18, 27)`` exist (real Qwen3-4B: 36 layers of 2560); ``tokenizer``: a trained
  byte-level BPE ``Qwen2Tokenizer`` with a Qwen3-style chat template.
* ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting (the pipeline computes ``mu`` itself).

Shapes: pixels ``(3, 32, 32)`` → VAE latents ``(4, 4, 4)`` → patchified ``(16, 2, 2)`` → 4 tokens of 16.
"""

from pathlib import Path

import torch

from tests.support.tiny_pipelines.common import image_vae_kwargs, seeded, seeded_values, write_pipeline
from tests.support.tiny_pipelines.vocab import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

__all__ = ["LATENT_CHANNELS", "PIXEL_SIZE", "SCHEDULER_CONFIG", "TEXT_HIDDEN", "write_tiny_flux2_klein"]

LATENT_CHANNELS = 4
PIXEL_SIZE = 32
TEXT_HIDDEN = 8
TEXT_LAYERS = 28
# black-forest-labs/FLUX.2-klein-4B scheduler/scheduler_config.json: dynamic shifting with the exponential map; the
# pipeline's compute_empirical_mu sets mu, so no base/max shift is read (sources in docs/families.md)
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "use_dynamic_shifting": True, "time_shift_type": "exponential"}


def write_tiny_flux2_klein(folder: str | Path, seed: int = 0, distilled: bool = False) -> Path:
    """Write a tiny random ``Flux2KleinPipeline`` directory to ``folder``.

    Args:
        folder: the pipeline directory (created if needed).
        seed: the weights and the VAE's batch-norm statistics are a function of it.
        distilled: the pipeline's ``is_distilled`` flag (``model_index.json``): False as in klein-base (the pipeline
            runs CFG with the empty negative prompt when ``guidance_scale > 1``), True as in the step-distilled
            klein release (CFG is never run).

    Returns:
        ``folder`` as a ``Path``; ``Flux2KleinPipeline.from_pretrained(folder)`` opens it offline.
    """
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = qwen_tokenizer(special_tokens=("<think>", "</think>"), chat_template=QWEN3_CHAT_TEMPLATE)
    text_config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_HIDDEN,
        intermediate_size=16,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=TEXT_HIDDEN // 2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.pad_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    patched = LATENT_CHANNELS * 4
    with seeded(seed):
        vae = AutoencoderKLFlux2(**image_vae_kwargs(LATENT_CHANNELS, PIXEL_SIZE))
        vae.bn.running_mean.copy_(torch.tensor(seeded_values(seed, patched, -0.5, 0.5)))
        vae.bn.running_var.copy_(torch.tensor(seeded_values(seed + 1, patched, 0.5, 4.0)))
        pipe = Flux2KleinPipeline(
            transformer=Flux2Transformer2DModel(
                patch_size=1,
                in_channels=patched,
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=3 * TEXT_HIDDEN,
                timestep_guidance_channels=32,
                mlp_ratio=3.0,
                axes_dims_rope=(4, 4, 4, 4),
                rope_theta=2000,
                guidance_embeds=False,
            ),
            vae=vae,
            text_encoder=Qwen3ForCausalLM(text_config),
            tokenizer=tokenizer,
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
            is_distilled=distilled,
        )
    return write_pipeline(pipe, folder)
