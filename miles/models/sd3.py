"""The ``sd3`` family: any diffusers ``StableDiffusion3Pipeline`` directory (SD3, SD3.5 Medium / Large).

Prompts are encoded by the pipeline's own ``encode_prompt`` (two CLIP encoders plus T5, or zeros in T5's place when
the pipeline was saved with ``text_encoder_3=None``). Latents are the VAE's, normalised as the pipeline does:
``z = (vae.encode(x).mode() − shift_factor) · scaling_factor``, decoded by ``x = vae.decode(z / scaling_factor +
shift_factor)`` with pixels ``x`` in [-1, 1] (:class:`~miles.models.diffusers_family.DiffusersFamily`, which loads,
encodes, decodes and runs the forward for every stock family; this module declares what SD3 does differently).

Stock settings (``StableDiffusion3Pipeline.__call__``, diffusers 0.42.1): CFG ``guidance_scale`` 7.0 against
``negative_prompt or ""``; the flow shift is the scheduler config's ``shift`` (3.0 in the SD3 / SD3.5 releases).
"""

from pathlib import Path

import torch
from torch import Tensor

from miles.models.capabilities import DifferentiablePixels, PixelCodec, TokenFeatures, TrueCFG
from miles.models.diffusers_family import DiffusersFamily, PipelinePromptEncoder
from miles.models.memory import ActivationLayout, joint_layout
from miles.models.pipeline_files import DENOISER, read_json
from miles.models.registry import register_family

__all__ = ["CLIP_TOKENS", "SD3Family", "T5_TOKENS", "sd3_latent_shape"]

# T5 tokens per prompt: StableDiffusion3Pipeline's default max_sequence_length; CLIP adds its 77.
T5_TOKENS = 256
CLIP_TOKENS = 77


def sd3_latent_shape(path: str | Path) -> tuple[int, int, int]:
    """``(in_channels, sample_size, sample_size)`` of ``<path>/transformer/config.json``."""
    config = read_json(Path(path) / DENOISER / "config.json", "transformer config")
    return (int(config["in_channels"]), int(config["sample_size"]), int(config["sample_size"]))


@register_family
class SD3Family(DiffusersFamily, TrueCFG, PixelCodec, TokenFeatures, DifferentiablePixels):
    """Diffusers SD3 / SD3.5 pipelines: ``SD3Transformer2DModel`` over VAE latents, CLIP×2 (+T5) text.

    True CFG, a VAE codec (differentiable for the DMD2 reward), image tokens for the GAN head. Cond kwargs:
    ``{"encoder_hidden_states": (B, 77 + T5 length, joint_attention_dim), "pooled_projections": (B, 2 · CLIP
    projection)}``.
    """

    name = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    # StableDiffusion3Pipeline.__call__'s max_sequence_length (T5) and guidance_scale defaults (diffusers 0.42.1)
    max_sequence_length = T5_TOKENS
    stock_guidance = 7.0
    # The teacher and the critic take the student's latents (channels, size) and its prompt encodings.
    compatible_keys = {
        "in_channels": "latent channels",
        "out_channels": "output channels",
        "sample_size": "latent sample size",
        "joint_attention_dim": "text-encoder width",
        "pooled_projection_dim": "pooled text width",
    }

    def prompt_cond(self, encoder: PipelinePromptEncoder, prompts: list[str]) -> dict[str, Tensor]:
        """``{"encoder_hidden_states": (B, 77 + 256, D), "pooled_projections": (B, P)}`` of ``encode_prompt``."""
        states, _, pooled, _ = encoder.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=encoder.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"encoder_hidden_states": states, "pooled_projections": pooled}

    def latent_shape(self, path: str | Path) -> tuple[int, int, int]:
        return sd3_latent_shape(path)

    def text_tokens(self, path: str | Path) -> int:
        """Text tokens per prompt the denoiser attends to: CLIP's, padded to its tokenizer's ``model_max_length`` (77
        in the releases, and without a ``tokenizer/`` folder), then 256 of T5 (padded to its length, or zeros)."""
        tokenizer = Path(path) / "tokenizer" / "tokenizer_config.json"
        clip = CLIP_TOKENS
        if tokenizer.is_file():
            clip = int(read_json(tokenizer, "CLIP tokenizer config").get("model_max_length", CLIP_TOKENS))
        return clip + self.max_sequence_length

    def flow_shift(self, path: str | Path, num_steps: int | None = None) -> float:
        """The shift the stock pipeline samples pipeline ``path`` with: a student export's own k
        (``_miles_flow_shift``), else ``e^mu`` at the sample's ``(H/p)·(W/p)`` tokens for a dynamic scheduler config
        (``StableDiffusion3Pipeline`` computes ``mu`` so), else the scheduler config's ``shift`` (3.0 for the SD3 /
        SD3.5 releases). ``num_steps`` is not used.

        Raises:
            OSError / ValueError: when the scheduler (or, for a dynamic config, the transformer) config is missing
                or unreadable.
        """
        from miles.models.stock_defaults import dynamic_flow_shift
        from miles.models.stock_schedulers import SCHEDULE_KEYS

        config = read_json(Path(path) / "scheduler" / "scheduler_config.json", "scheduler config")
        if SCHEDULE_KEYS["shift"] in config:
            return float(config[SCHEDULE_KEYS["shift"]])
        if config.get("use_dynamic_shifting", False):
            return dynamic_flow_shift(config, self.tokens_per_sample(path)[0])
        return float(config.get("shift", 1.0))

    def image_shape(self, path: str | Path) -> tuple[int, int, int]:
        """``(S·f, S·f, C)``: the transformer's ``sample_size`` S times the VAE's downscale factor ``f =
        2^(len(block_out_channels) − 1)`` (the pipeline's ``vae_scale_factor``; 8 for SD3), C the VAE's
        ``in_channels``. Reads the two configs only."""
        _, height, width = sd3_latent_shape(path)
        vae = read_json(Path(path) / "vae" / "config.json", "VAE config")
        factor = 2 ** (len(vae["block_out_channels"]) - 1)
        return (height * factor, width * factor, int(vae.get("in_channels", 3)))

    def activation_layout(self, config: dict) -> ActivationLayout:
        """Joint blocks (QK-norm where ``qk_norm``, SD3.5's dual-attention layers), no rope; the patch embedding is a
        convolution over ``in_channels · patch²`` latent values per token."""
        return joint_layout(
            config,
            patch_inputs=int(config["in_channels"]) * int(config["patch_size"]) ** 2,
            qk_norm=bool(config.get("qk_norm")),
            rope=False,
            dual_attention_layers=tuple(config.get("dual_attention_layers") or ()),
        )

    def meta_cond(self, config: dict, text_tokens: int) -> dict[str, Tensor]:
        with torch.device("meta"):
            return {
                "encoder_hidden_states": torch.empty(1, text_tokens, int(config["joint_attention_dim"])),
                "pooled_projections": torch.empty(1, int(config["pooled_projection_dim"])),
            }
