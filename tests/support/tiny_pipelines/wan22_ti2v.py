"""A tiny random ``WanPipeline`` in Wan 2.2 TI2V-5B's layout (``expand_timesteps=True``, the Wan 2.2 VAE), nothing
downloaded.

The tiny Wan 2.1 pipeline's transformer, UMT5 and tokenizer (:mod:`tests.support.tiny_pipelines.wan`) with the parts
that make TI2V-5B (``Wan-AI/Wan2.2-TI2V-5B-Diffusers``):

* ``vae``: ``AutoencoderKLWan`` as Wan 2.2's: residual down/up blocks (``is_residual``), a 2×2 pixel patchify
  before the encoder (``patch_size`` 2, so 12 input channels), spatial factor 16, temporal factor 4; ``z_dim`` 4
  (real 48), width 8 (real 160), per-channel statistics drawn from the seed.
* ``expand_timesteps=True`` in ``model_index.json``: the pipeline hands the transformer one timestep per token.
* ``scheduler``: UniPC in flow mode with ``flow_shift`` 5.0, as ``convert_wan_to_diffusers.py`` writes TI2V-5B's.

Shapes: a 5 × 32 × 64 clip → latents ``(4, 2, 2, 4)`` → a 2 × 1 × 2 grid of tokens.
"""

import tempfile
from pathlib import Path

from tests.support.tiny_pipelines.common import seeded, seeded_values, write_pipeline
from tests.support.tiny_pipelines.wan import LATENT_CHANNELS, SCHEDULER_CONFIG, write_tiny_wan

__all__ = ["write_tiny_wan22_ti2v"]


def write_tiny_wan22_ti2v(folder: str | Path, seed: int = 0) -> Path:
    """Write a tiny random TI2V-5B-layout ``WanPipeline`` directory to ``folder``; ``WanPipeline.from_pretrained``
    opens it offline."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    with tempfile.TemporaryDirectory() as scratch:
        base = WanPipeline.from_pretrained(write_tiny_wan(Path(scratch) / "wan", seed))
        with seeded(seed):
            vae = AutoencoderKLWan(
                base_dim=8,
                z_dim=LATENT_CHANNELS,
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
                is_residual=True,
                in_channels=12,
                out_channels=12,
                patch_size=2,
                scale_factor_spatial=16,
                latents_mean=seeded_values(seed + 2, LATENT_CHANNELS, -1.0, 1.0),
                latents_std=seeded_values(seed + 3, LATENT_CHANNELS, 1.0, 3.0),
            )
        pipe = WanPipeline(
            tokenizer=base.tokenizer,
            text_encoder=base.text_encoder,
            vae=vae,
            scheduler=UniPCMultistepScheduler(**{**SCHEDULER_CONFIG, "flow_shift": 5.0}),
            transformer=base.transformer,
            expand_timesteps=True,
        )
        return write_pipeline(pipe, folder)
