"""The ``flux2`` family: diffusers ``Flux2KleinPipeline`` directories (FLUX.2-klein 4B / 9B, base and distilled).

**Latents.** miles keeps the latent the pipeline denoises, unpacked: ``(4·C, H/16, W/16)`` for an ``H × W`` image,
the VAE latent ``(C, H/8, W/8)`` cut into 2×2 patches (``Flux2KleinPipeline._patchify_latents``: channel
``c·4 + 2·dy + dx``) and normalised per patched channel by the VAE's batch-norm statistics, ``z = (patches − mean) /
sqrt(var + eps)`` (``_encode_vae_image``). The transformer (``patch_size`` 1, ``in_channels`` = 4·C) sees one token
per latent pixel in raster order with position ids ``(t=0, h, w, l=0)``; the text tokens get ``(0, 0, 0, l)``
(``_prepare_latent_ids``, ``_prepare_text_ids``). The stock call takes this latent as ``latents=``.

**Prompts.** ``Flux2KleinPipeline.encode_prompt``: the Qwen3 chat template (``enable_thinking=False``), padded to 512
tokens, the hidden states of layers (9, 18, 27) stacked along the width (3 · 2560 = 7680 for klein-4B). No mask
reaches the transformer; the negative prompt of CFG is ``""`` (the pipeline's own).

**Timestep.** The transformer takes σ ∈ [0, 1] (the pipeline passes ``timestep / 1000``).

**Guidance.** True CFG with the empty prompt (klein-base), at ``guidance_scale`` 4.0 by default (the call's). The
step-distilled klein release (``is_distilled`` in ``model_index.json``) runs no CFG:
:meth:`Flux2Family.max_guidance_scale` and :meth:`Flux2Family.stock_guidance_scale` are 1 and preflight rejects more.

**Flow shift.** The pipeline passes ``sigmas = linspace(1, 1/S, S)`` and ``mu = compute_empirical_mu(tokens, S)``
to a dynamic exponential scheduler, the static shift ``e^mu`` (docs/families.md); :meth:`Flux2Family.flow_shift`
is that at the pipeline's sample size and the stock default of 50 steps.
"""

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.models.base import DENOISER, ModelFamily, place_text_encoders, read_json
from miles.models.capabilities import PixelCodec, TokenFeatures, TrueCFG, module_on
from miles.models.precision import forward_device_dtype
from miles.models.registry import register_family
from miles.models.stock_defaults import read_sample_size
from miles.models.stock_schedulers import sigmas_call_scheduler_config

__all__ = ["Flux2Family", "Flux2PromptEncoder", "patchify", "unpatchify"]

# Flux2KleinPipeline's max_sequence_length (the prompt is padded to it), default step count and default
# guidance_scale (diffusers 0.42.1; the klein-base model card's 4.0)
TEXT_TOKENS = 512
STOCK_NUM_STEPS = 50
STOCK_GUIDANCE_SCALE = 4.0
# Flux2KleinPipeline.default_sample_size (latent pixels): 128 · vae_scale_factor 8 = 1024 pixels
DEFAULT_SAMPLE_SIZE = 128
# transformer config keys a teacher and a critic must share with the student
COMPATIBLE_KEYS = {
    "in_channels": "patched latent channels",
    "out_channels": "output channels",
    "joint_attention_dim": "text-encoder width",
}


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """VAE latents ``(B, C, h, w)`` → ``(B, 4·C, h/2, w/2)`` (``Flux2KleinPipeline._patchify_latents``)."""
    batch, channels, height, width = latents.shape
    patches = latents.reshape(batch, channels, height // 2, 2, width // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(batch, channels * 4, height // 2, width // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """``(B, 4·C, h/2, w/2)`` → VAE latents ``(B, C, h, w)``, the inverse of :func:`patchify`."""
    batch, channels, height, width = latents.shape
    patches = latents.reshape(batch, channels // 4, 2, 2, height, width).permute(0, 1, 4, 2, 5, 3)
    return patches.reshape(batch, channels // 4, height * 2, width * 2)


def _grid_ids(frames: int, height: int, width: int, length: int) -> torch.Tensor:
    """``(frames·height·width·length, 4)`` int64 position ids ``(t, h, w, l)`` in raster order."""
    axes = [torch.arange(n) for n in (frames, height, width, length)]
    return torch.cartesian_prod(*axes)


class Flux2PromptEncoder:
    """The text half of a ``Flux2KleinPipeline`` (Qwen3 and its tokenizer), run through the pipeline's own
    ``encode_prompt``; the pipeline object holds a weightless (meta-device) transformer and no VAE.

    Args:
        path: the pipeline directory.
        device: where the text encoder runs.
        dtype: the text encoder's weights.
    """

    def __init__(
        self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        from accelerate import init_empty_weights
        from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

        with init_empty_weights():
            meta = Flux2Transformer2DModel.from_config(Flux2Transformer2DModel.load_config(Path(path) / DENOISER))
        self.pipe = Flux2KleinPipeline.from_pretrained(path, transformer=meta, vae=None, torch_dtype=dtype)
        self.text_modules = place_text_encoders(self.pipe, device)
        self.device = torch.device(device)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        """float32 ``(B, 512, 3 · text width)``: the stacked hidden states of layers (9, 18, 27)."""
        embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device, max_sequence_length=TEXT_TOKENS)
        return embeds.float()


@register_family
class Flux2Family(ModelFamily, TrueCFG, PixelCodec, TokenFeatures):
    """``Flux2KleinPipeline``: ``Flux2Transformer2DModel`` (double- then single-stream blocks) over patched,
    batch-normalised ``AutoencoderKLFlux2`` latents ``(4·C, H/16, W/16)``, Qwen3 text. Cond kwargs:
    ``{"encoder_hidden_states": (B, 512, joint_attention_dim)}``."""

    name = "flux2"
    pipeline_classes = ("Flux2KleinPipeline",)
    # the export gets a static scheduler that maps the pipeline's own linspace(1, 1/S, S) to the student's grid
    stock_scheduler = True

    def __init__(self, pipeline_path: str | Path) -> None:
        super().__init__(pipeline_path)
        self._vae = None

    @staticmethod
    def _config(path: str | Path) -> dict:
        return read_json(Path(path) / DENOISER / "config.json", "transformer config")

    def _vae_factor(self, path: str | Path) -> int:
        vae = read_json(Path(path) / "vae" / "config.json", "VAE config")
        return 2 ** (len(vae["block_out_channels"]) - 1)

    def load_denoiser(self, path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
        """``<path>/transformer`` as a ``Flux2Transformer2DModel`` in eval mode on the CPU.

        Raises:
            FileNotFoundError: if ``<path>/transformer/config.json`` is missing.
        """
        from diffusers import Flux2Transformer2DModel

        self._config(path)
        return Flux2Transformer2DModel.from_pretrained(Path(path) / DENOISER, torch_dtype=dtype).eval()

    def load_text_encoder(
        self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> Flux2PromptEncoder:
        return Flux2PromptEncoder(path, device=device, dtype=dtype)

    def encode_prompts(self, encoder: Flux2PromptEncoder, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``{"encoder_hidden_states": (B, 512, D)}``, float32 on the CPU.

        Raises:
            ValueError: on an empty prompt list.
        """
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        return {"encoder_hidden_states": encoder.encode(list(prompts)).detach().to("cpu", torch.float32)}

    def image_shape(self, path: str | Path) -> tuple[int, int, int]:
        """``(H, W, 3)``: ``_miles_sample_size`` of ``model_index.json`` (:mod:`miles.models.stock_defaults`), else the
        pipeline's default ``128 · vae_scale_factor`` square, rounded down to a multiple of 16 as the pipeline does."""
        multiple = 2 * self._vae_factor(path)
        default = (DEFAULT_SAMPLE_SIZE * self._vae_factor(path),) * 2
        height, width = read_sample_size(path, default)
        return (height // multiple * multiple, width // multiple * multiple, 3)

    def latent_shape(self, path: str | Path) -> tuple[int, int, int]:
        """``(in_channels, H/16, W/16)`` (``in_channels`` = 4 · the VAE's latent channels)."""
        height, width, _ = self.image_shape(path)
        multiple = 2 * self._vae_factor(path)
        return (int(self._config(path)["in_channels"]), height // multiple, width // multiple)

    def text_tokens(self, path: str | Path) -> int:
        """512: the pipeline pads every prompt to ``max_sequence_length``."""
        return TEXT_TOKENS

    def compatibility_signature(self, path: str | Path) -> dict[str, Any]:
        """The latent shape and the transformer config keys of :data:`COMPATIBLE_KEYS`."""
        config = self._config(path)
        signature = {f"{what} ({key})": config.get(key) for key, what in COMPATIBLE_KEYS.items()}
        return {**super().compatibility_signature(path), **signature}

    def flow_shift(self, path: str | Path, num_steps: int | None = None) -> float:
        """``e^mu`` with ``mu = compute_empirical_mu(tokens, num_steps or 50)`` (diffusers' ``pipeline_flux2_klein``;
        50 is the call's default) at the pipeline's sample size, tokens = ``(H/16)·(W/16)``; the scheduler config's
        ``shift`` where it is static."""
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        config = read_json(Path(path) / "scheduler" / "scheduler_config.json", "scheduler config")
        if not config.get("use_dynamic_shifting", False):
            return float(config.get("shift", 1.0))
        _, height, width = self.latent_shape(path)
        steps = num_steps or STOCK_NUM_STEPS
        return math.exp(compute_empirical_mu(image_seq_len=height * width, num_steps=steps))

    def max_guidance_scale(self, path: str | Path) -> float | None:
        """1 for a step-distilled checkpoint (``is_distilled`` in ``model_index.json``: the pipeline never runs CFG
        on it), else no limit."""
        index = read_json(Path(path) / "model_index.json", "pipeline model_index.json")
        return 1.0 if index.get("is_distilled") else None

    def stock_guidance_scale(self, path: str | Path) -> float:
        """4.0 (``Flux2KleinPipeline.__call__``'s ``guidance_scale``) for klein-base; 1 for a step-distilled
        checkpoint, on which the pipeline never runs CFG."""
        return STOCK_GUIDANCE_SCALE if self.max_guidance_scale(path) is None else 1.0

    def stock_scheduler_config(self, schedule: dict[str, Any]) -> dict[str, Any]:
        """A static scheduler at the student's shift: ``Flux2KleinPipeline`` passes ``linspace(1, 1/S, S)`` itself
        (:func:`~miles.models.stock_schedulers.sigmas_call_scheduler_config`)."""
        return sigmas_call_scheduler_config(**schedule)

    def predict_velocity(
        self, denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One ``Flux2Transformer2DModel`` forward on ``(B, C, h, w)`` latents at ``timestep`` ∈ [0, 1000]: tokens in
        raster order, σ = timestep / 1000 as the pipeline passes it; returns float32 ``(B, C, h, w)``."""
        device, dtype = forward_device_dtype(denoiser)  # latents and cond; the timestep stays float32
        batch, channels, height, width = latents.shape
        tokens = latents.to(device, dtype).reshape(batch, channels, height * width).permute(0, 2, 1)
        text = cond["encoder_hidden_states"].to(device, dtype)
        out = denoiser(
            hidden_states=tokens,
            encoder_hidden_states=text,
            timestep=timestep.to(device, torch.float32) / 1000,
            img_ids=_grid_ids(1, height, width, 1).to(device),
            txt_ids=_grid_ids(1, 1, 1, text.shape[1]).to(device),
            guidance=None,
            return_dict=False,
        )[0]
        return out.float().permute(0, 2, 1).reshape(batch, channels, height, width)

    def blocks(self, denoiser: nn.Module) -> list[nn.Module]:
        """The double-stream then the single-stream blocks (``_no_split_modules``), in forward order."""
        return [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]

    def image_tokens(self, block_output) -> torch.Tensor:
        """The image tokens ``(B, N, D)``: the second of a double-stream block's ``(text, image)``, the tokens after
        the 512 text tokens of a single-stream block's joint sequence."""
        if isinstance(block_output, tuple):
            return block_output[1]
        return block_output[:, TEXT_TOKENS:]

    def token_grid(self, denoiser: nn.Module, latent_shape: tuple[int, ...]) -> tuple[int, int]:
        """``(h, w)``: one token per latent pixel (``patch_size`` 1)."""
        _, height, width = latent_shape
        return height, width

    def token_width(self, denoiser: nn.Module) -> int:
        """``num_attention_heads · attention_head_dim``."""
        return int(denoiser.config.num_attention_heads) * int(denoiser.config.attention_head_dim)

    @property
    def vae(self):
        """The pipeline's ``AutoencoderKLFlux2`` (float32, eval, CPU), loaded on first use."""
        if self._vae is None:
            from diffusers import AutoencoderKLFlux2

            self._vae = AutoencoderKLFlux2.from_pretrained(self.pipeline_path / "vae", torch_dtype=torch.float32)
            self._vae.eval()
        return self._vae

    def _batch_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std ``(1, 4·C, 1, 1)`` of the patched latents (the VAE's batch-norm running statistics)."""
        bn = self.vae.bn
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
        return bn.running_mean.view(1, -1, 1, 1), std

    def to_vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """miles' latents ``(B, 4·C, h, w)`` → the VAE's ``(B, C, 2h, 2w)`` (what the stock call returns with
        ``output_type="latent"``)."""
        mean, std = self._batch_norm()  # on the VAE's device
        return unpatchify(latents.detach().float().to(mean.device) * std + mean)

    @torch.no_grad()
    def images_to_latents(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (or float 0..255) ``(B, H, W, 3)`` → float32 ``(B, 4·C, H/16, W/16)`` (posterior mode, patched,
        normalised as ``Flux2KleinPipeline._encode_vae_image``)."""
        images = torch.as_tensor(images)
        if images.ndim != 4:
            raise ValueError(f"FLUX.2 images must be (B, H, W, C), got shape {tuple(images.shape)}")
        pixels = (images.float() / 255.0 * 2.0 - 1.0).permute(0, 3, 1, 2)
        mean, std = self._batch_norm()
        return ((patchify(self.vae.encode(pixels).latent_dist.mode()) - mean) / std).float()

    @torch.no_grad()
    def latents_to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """float ``(B, 4·C, h, w)`` → uint8 ``(B, 16h, 16w, 3)``."""
        with module_on(self.vae, latents.device) as vae:  # decoded where the latents are (the worker's GPU)
            pixels = vae.decode(self.to_vae_latents(latents), return_dict=False)[0]
        pixels = ((pixels + 1.0) / 2.0 * 255.0).round().clamp(0, 255)
        return pixels.to(torch.uint8).cpu().permute(0, 2, 3, 1).contiguous()
