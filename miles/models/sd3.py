"""The ``sd3`` family: any diffusers ``StableDiffusion3Pipeline`` directory (SD3, SD3.5 Medium / Large).

Prompts are encoded by the pipeline's own ``encode_prompt`` (two CLIP encoders plus T5, or zeros in T5's place when
the pipeline was saved with ``text_encoder_3=None``). Latents are the VAE's, normalised as the pipeline does:
``z = (vae.encode(x).mode() − shift_factor) · scaling_factor``, decoded by ``x = vae.decode(z / scaling_factor +
shift_factor)`` with pixels ``x`` in [-1, 1].

Stock settings (``StableDiffusion3Pipeline.__call__``, diffusers 0.42.1): CFG ``guidance_scale`` 7.0 against
``negative_prompt or ""``; the flow shift is the scheduler config's ``shift`` (3.0 in the SD3 / SD3.5 releases).
"""

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.models.base import DENOISER, ModelFamily, place_text_encoders, read_json
from miles.models.capabilities import DifferentiablePixels, PixelCodec, TokenFeatures, TrueCFG, module_on
from miles.models.precision import forward_device_dtype
from miles.models.registry import register_family

__all__ = ["SD3Family", "SD3PromptEncoder", "load_sd3_transformer", "sd3_velocity", "sd3_latent_shape"]

logger = logging.getLogger(__name__)

# T5 tokens per prompt: StableDiffusion3Pipeline's default max_sequence_length; CLIP adds its 77.
T5_TOKENS = 256
CLIP_TOKENS = 77
# StableDiffusion3Pipeline.__call__'s guidance_scale default (diffusers 0.42.1)
STOCK_GUIDANCE_SCALE = 7.0
# Transformer config keys the teacher and the critic must share with the student: they take the student's latents
# (channels, size) and its prompt encodings (text width, pooled width).
COMPATIBLE_KEYS = {
    "in_channels": "latent channels",
    "out_channels": "output channels",
    "sample_size": "latent sample size",
    "joint_attention_dim": "text-encoder width",
    "pooled_projection_dim": "pooled text width",
}


class SD3PromptEncoder:
    """The text half of an SD3 pipeline, run through ``StableDiffusion3Pipeline.encode_prompt``.

    The pipeline object is built with a weightless (meta-device) transformer, because ``encode_prompt`` reads only its
    config (``joint_attention_dim``), and without the VAE, so the encoder holds just the text models.

    Args:
        path: the pipeline directory.
        device: where the text encoders run.
        max_sequence_length: T5 token count (256 in diffusers' pipeline).
        dtype: the text encoders' weights (SD3.5's T5-XXL and two CLIPs: 22 GB in float32, half in bfloat16).
    """

    def __init__(
        self,
        path: str | Path,
        device: str | torch.device = "cpu",
        max_sequence_length: int = 256,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from accelerate import init_empty_weights
        from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

        path = Path(path)
        model_index = read_json(path / "model_index.json", "pipeline model_index.json")
        # from_pretrained refuses to build a pipeline with components saved as null unless they are passed as None.
        absent = {
            name: None
            for name in ("text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor")
            if not isinstance(model_index.get(name), list) or model_index[name][0] is None
        }
        with init_empty_weights():
            meta_transformer = SD3Transformer2DModel.from_config(SD3Transformer2DModel.load_config(path / DENOISER))
        self.pipe = StableDiffusion3Pipeline.from_pretrained(
            path, transformer=meta_transformer, vae=None, torch_dtype=dtype, **absent
        )
        self.text_modules = place_text_encoders(self.pipe, device)
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return float32 ``(B, 77 + T5 length, joint_attention_dim)`` and float32 ``(B, 2 · CLIP projection)``."""
        prompt_embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return prompt_embeds.float(), pooled.float()


def load_sd3_transformer(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``<path>/transformer`` as an ``SD3Transformer2DModel`` in eval mode on the CPU, in ``dtype``.

    Raises:
        FileNotFoundError: if ``<path>/transformer/config.json`` is missing.
    """
    from diffusers import SD3Transformer2DModel

    folder = Path(path) / DENOISER
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no transformer/config.json under pipeline directory {path}")
    return SD3Transformer2DModel.from_pretrained(folder, torch_dtype=dtype).eval()


def sd3_latent_shape(path: str | Path) -> tuple[int, int, int]:
    """``(in_channels, sample_size, sample_size)`` of ``<path>/transformer/config.json``."""
    config = read_json(Path(path) / DENOISER / "config.json", "transformer config")
    return (int(config["in_channels"]), int(config["sample_size"]), int(config["sample_size"]))


def sd3_velocity(
    denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
) -> torch.Tensor:
    """One ``SD3Transformer2DModel`` forward (plain or FSDP-wrapped).

    Args:
        latents: ``(B, C, H, W)`` model input ``x_σ``, any float dtype; cast to the denoiser's dtype.
        timestep: float ``(B,)`` in [0, 1000] (``σ · 1000``); kept in float32, as diffusers' pipelines do.
        cond: ``{"encoder_hidden_states": (B, L, D), "pooled_projections": (B, P)}``.

    Returns:
        The velocity ``v = ε − x0``, float32 ``(B, C, H, W)``.
    """
    device, dtype = forward_device_dtype(denoiser)  # latents and cond; the timestep stays float32
    kwargs = {key: value.to(device, dtype) for key, value in cond.items()}
    out = denoiser(
        hidden_states=latents.to(device, dtype),
        timestep=timestep.to(device, torch.float32),
        return_dict=False,
        **kwargs,
    )[0]
    return out.float()


@register_family
class SD3Family(ModelFamily, TrueCFG, PixelCodec, TokenFeatures, DifferentiablePixels):
    """Diffusers SD3 / SD3.5 pipelines: ``SD3Transformer2DModel`` over VAE latents, CLIP×2 (+T5) text.

    True CFG, a VAE codec (differentiable for the DMD2 reward), image tokens for the GAN head. Cond kwargs: ``{"encoder_hidden_states": (B, 77 + T5 length,
    joint_attention_dim), "pooled_projections": (B, 2 · CLIP projection)}``.
    """

    name = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    # StableDiffusion3Pipeline samples the export: it gets FlowMatchLCMScheduler (dmd2 rule) with the student's grid
    stock_scheduler = True

    def __init__(self, pipeline_path: str | Path) -> None:
        super().__init__(pipeline_path)
        self._vae = None

    def load_denoiser(self, path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
        return load_sd3_transformer(path, dtype)

    def load_text_encoder(
        self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> SD3PromptEncoder:
        return SD3PromptEncoder(path, device=device, dtype=dtype)

    def encode_prompts(self, encoder: SD3PromptEncoder, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``{"encoder_hidden_states": (B, L, D), "pooled_projections": (B, P)}``, float32 on the CPU.

        Raises:
            ValueError: on an empty prompt list.
        """
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        hidden, pooled = encoder.encode(list(prompts))
        return {
            "encoder_hidden_states": hidden.detach().to("cpu", torch.float32),
            "pooled_projections": pooled.detach().to("cpu", torch.float32),
        }

    def latent_shape(self, path: str | Path) -> tuple[int, int, int]:
        return sd3_latent_shape(path)

    def text_tokens(self, path: str | Path) -> int:
        """Text tokens per prompt the denoiser attends to: 77 CLIP + 256 T5 (T5 padded to its length)."""
        return CLIP_TOKENS + T5_TOKENS

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
            transformer = read_json(Path(path) / DENOISER / "config.json", "transformer config")
            _, height, width = sd3_latent_shape(path)
            patch = int(transformer.get("patch_size", 2))
            return dynamic_flow_shift(config, (height // patch) * (width // patch))
        return float(config.get("shift", 1.0))

    def stock_guidance_scale(self, path: str | Path) -> float:
        """7.0: ``StableDiffusion3Pipeline.__call__``'s ``guidance_scale`` (diffusers 0.42.1)."""
        return STOCK_GUIDANCE_SCALE

    def compatibility_signature(self, path: str | Path) -> dict[str, Any]:
        """The transformer config keys of :data:`COMPATIBLE_KEYS`, labelled ``"latent channels (in_channels)"``."""
        config = read_json(Path(path) / DENOISER / "config.json", "transformer config")
        return {f"{what} ({key})": config.get(key) for key, what in COMPATIBLE_KEYS.items()}

    def image_shape(self, path: str | Path) -> tuple[int, int, int]:
        """``(S·f, S·f, C)``: the transformer's ``sample_size`` S times the VAE's downscale factor ``f =
        2^(len(block_out_channels) − 1)`` (the pipeline's ``vae_scale_factor``; 8 for SD3), C the VAE's
        ``in_channels``. Reads the two configs only."""
        _, height, width = sd3_latent_shape(path)
        vae = read_json(Path(path) / "vae" / "config.json", "VAE config")
        factor = 2 ** (len(vae["block_out_channels"]) - 1)
        return (height * factor, width * factor, int(vae.get("in_channels", 3)))

    def predict_velocity(
        self, denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return sd3_velocity(denoiser, latents, timestep, cond)

    def blocks(self, denoiser: nn.Module) -> list[nn.Module]:
        """The ``JointTransformerBlock``s (diffusers' ``_no_split_modules`` of SD3)."""
        return list(denoiser.transformer_blocks)

    def image_tokens(self, block_output) -> torch.Tensor:
        """The image tokens ``(B, N, D)`` of a ``JointTransformerBlock``'s output ``(text_tokens, image_tokens)``
        (the DMD2 GAN head's features)."""
        return block_output[1]

    def token_grid(self, denoiser: nn.Module, latent_shape: tuple[int, ...]) -> tuple[int, int]:
        """The patch grid ``(h, w)`` of the image tokens: the latent's ``(H, W)`` over ``patch_size``."""
        patch = int(denoiser.config.patch_size)
        _, height, width = latent_shape
        return height // patch, width // patch

    def token_width(self, denoiser: nn.Module) -> int:
        """``num_attention_heads · attention_head_dim``, the joint blocks' token width."""
        return int(denoiser.config.num_attention_heads) * int(denoiser.config.attention_head_dim)

    @property
    def vae(self):
        """The pipeline's ``AutoencoderKL`` (float32, eval, CPU), loaded on first use."""
        if self._vae is None:
            from diffusers import AutoencoderKL

            vae = AutoencoderKL.from_pretrained(self.pipeline_path / "vae", torch_dtype=torch.float32).eval()
            self._vae = vae.requires_grad_(False)  # frozen: a reward's gradient reaches the latents, not the VAE
        return self._vae

    def _factors(self) -> tuple[float, float]:
        config = self.vae.config
        return float(config.scaling_factor), float(config.shift_factor or 0.0)

    @torch.no_grad()
    def images_to_latents(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (or float 0..255) ``(B, H, W, 3)`` → float32 VAE latents ``(B, C, H/f, W/f)`` (posterior mode)."""
        images = torch.as_tensor(images)
        if images.ndim != 4:
            raise ValueError(f"SD3 images must be (B, H, W, C), got shape {tuple(images.shape)}")
        pixels = (images.float() / 255.0 * 2.0 - 1.0).permute(0, 3, 1, 2)
        scaling, shift = self._factors()
        latents = self.vae.encode(pixels).latent_dist.mode()
        return ((latents - shift) * scaling).float()

    @torch.no_grad()
    def latents_to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """float VAE latents ``(B, C, h, w)`` → uint8 ``(B, h·f, w·f, 3)``."""
        scaling, shift = self._factors()
        with module_on(self.vae, latents.device) as vae:  # decoded where the latents are (the worker's GPU)
            pixels = vae.decode(latents.detach().float() / scaling + shift, return_dict=False)[0]
        pixels = ((pixels + 1.0) / 2.0 * 255.0).round().clamp(0, 255)
        return pixels.to(torch.uint8).cpu().permute(0, 2, 3, 1).contiguous()

    def latents_to_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """float VAE latents ``(B, C, h, w)`` → float32 pixels ``(B, 3, h·f, w·f)``, ``(decode + 1) / 2``, unclipped,
        with autograd through the frozen float32 VAE decoder, which moves to the latents' device (and stays there)."""
        scaling, shift = self._factors()
        vae = self.vae.to(latents.device)
        pixels = vae.decode(latents.float() / scaling + shift, return_dict=False)[0]
        return (pixels.float() + 1.0) / 2.0
