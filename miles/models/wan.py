"""The ``wan`` family: diffusers ``WanPipeline`` directories with one expert (Wan 2.1 T2V 1.3B / 14B, Wan 2.2
TI2V-5B in text-to-video mode). A two-expert Wan 2.2 A14B pipeline (``transformer_2``) is refused: miles trains one
denoiser.

**Latents.** Video latents ``(C, F', H/8, W/8)`` of an ``F × H × W`` clip, ``F' = (F − 1)/4 + 1``, normalised per
channel as the pipeline undoes it before decoding: ``z = (vae.encode(x).mode() − latents_mean) / latents_std``
(``WanPipeline.__call__``). The transformer patchifies ``(1, 2, 2)`` itself, so miles hands it the latent as is
(``(B, C, F', h, w)`` is also the stock call's ``latents=``).

**Prompts.** ``WanPipeline.encode_prompt``: the prompt cleaned (``prompt_clean``), UMT5 over 512 tokens (the call's
``max_sequence_length``), the states past each prompt's length zeroed; no mask reaches the transformer. The
pipeline's negative prompt defaults to ``""``.

**Timestep.** ``timestep`` ∈ [0, 1000] as the scheduler gives it (σ·1000); per token where the pipeline's
``expand_timesteps`` is set (TI2V-5B).

**Flow shift.** Static: the scheduler's ``flow_shift`` (UniPC, 3.0 for 480p T2V, 5.0 for 720p / TI2V-5B) or
``shift``. ``WanPipeline`` calls ``set_timesteps(S)`` with neither ``sigmas`` nor ``mu``, so the export writes a
static scheduler whose ``shift`` and ``shift_terminal`` rebuild the student's grid
(:func:`~miles.models.stock_schedulers.terminal_scheduler_config`; explicit ``--diffusion-timesteps`` cannot be
exported this way).
"""

from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.models.base import DENOISER, ModelFamily, place_text_encoders, read_json
from miles.models.capabilities import PixelCodec, TokenFeatures, TrueCFG, module_on
from miles.models.precision import forward_device_dtype
from miles.models.registry import register_family
from miles.models.stock_defaults import read_sample_size
from miles.models.stock_schedulers import terminal_scheduler_config

__all__ = ["WanFamily", "WanPromptEncoder"]

# WanPipeline.__call__'s max_sequence_length, default clip (frames, height, width) and default guidance_scale
# (diffusers 0.42.1)
TEXT_TOKENS = 512
DEFAULT_SAMPLE_SIZE = (81, 480, 832)
STOCK_GUIDANCE_SCALE = 5.0
# transformer config keys a teacher and a critic must share with the student
COMPATIBLE_KEYS = {
    "in_channels": "latent channels",
    "out_channels": "output channels",
    "patch_size": "patch size",
    "text_dim": "text-encoder width",
}


def _model_index(path: str | Path) -> dict:
    return read_json(Path(path) / "model_index.json", "pipeline model_index.json")


def _is_component(entry: Any) -> bool:
    return isinstance(entry, list) and entry[0] is not None


class WanPromptEncoder:
    """UMT5 and its tokenizer, run through ``WanPipeline.encode_prompt``; the pipeline object holds a weightless
    (meta-device) transformer and no VAE.

    Args:
        path: the pipeline directory.
        device: where the text encoder runs.
        dtype: the text encoder's weights.
    """

    def __init__(
        self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        from accelerate import init_empty_weights
        from diffusers import WanPipeline, WanTransformer3DModel

        with init_empty_weights():
            meta = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(Path(path) / DENOISER))
        absent = {"transformer_2": None} if not _is_component(_model_index(path).get("transformer_2")) else {}
        self.pipe = WanPipeline.from_pretrained(path, transformer=meta, vae=None, torch_dtype=dtype, **absent)
        self.text_modules = place_text_encoders(self.pipe, device)
        self.device = torch.device(device)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        """float32 ``(B, 512, text_dim)``, zero past each prompt's tokens."""
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=False,
            max_sequence_length=TEXT_TOKENS,
            device=self.device,
        )
        return embeds.float()


@register_family
class WanFamily(ModelFamily, TrueCFG, PixelCodec, TokenFeatures):
    """``WanPipeline``: ``WanTransformer3DModel`` over normalised ``AutoencoderKLWan`` video latents ``(C, F', h, w)``,
    UMT5 text. Cond kwargs: ``{"encoder_hidden_states": (B, 512, text_dim)}``."""

    name = "wan"
    pipeline_classes = ("WanPipeline",)
    # the export gets a static scheduler whose set_timesteps(S) builds the student's grid
    stock_scheduler = True

    def __init__(self, pipeline_path: str | Path) -> None:
        super().__init__(pipeline_path)
        self._vae = None
        self._expand_timesteps = None

    @staticmethod
    def _config(path: str | Path) -> dict:
        return read_json(Path(path) / DENOISER / "config.json", "transformer config")

    @staticmethod
    def _factors(path: str | Path) -> tuple[int, int]:
        """The VAE's ``(scale_factor_temporal, scale_factor_spatial)`` (4, 8; 4, 16 for Wan 2.2's VAE)."""
        vae = read_json(Path(path) / "vae" / "config.json", "VAE config")
        return int(vae.get("scale_factor_temporal", 4)), int(vae.get("scale_factor_spatial", 8))

    def load_denoiser(self, path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
        """``<path>/transformer`` as a ``WanTransformer3DModel`` in eval mode on the CPU.

        Raises:
            FileNotFoundError: if ``<path>/transformer/config.json`` is missing.
        """
        from diffusers import WanTransformer3DModel

        self._config(path)
        return WanTransformer3DModel.from_pretrained(Path(path) / DENOISER, torch_dtype=dtype).eval()

    def load_text_encoder(
        self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> WanPromptEncoder:
        return WanPromptEncoder(path, device=device, dtype=dtype)

    def encode_prompts(self, encoder: WanPromptEncoder, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``{"encoder_hidden_states": (B, 512, text_dim)}``, float32 on the CPU.

        Raises:
            ValueError: on an empty prompt list.
        """
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        return {"encoder_hidden_states": encoder.encode(list(prompts)).detach().to("cpu", torch.float32)}

    def image_shape(self, path: str | Path) -> tuple[int, int, int, int]:
        """``(F, H, W, 3)``: ``_miles_sample_size`` ``[frames, height, width]`` of ``model_index.json``
        (:mod:`miles.models.stock_defaults`), else the pipeline's default 81 × 480 × 832, rounded as the pipeline
        rounds them (F to ``4k + 1``, H and W down to multiples of ``8 · patch``).

        Raises:
            ValueError: for a two-expert pipeline (``transformer_2``: Wan 2.2 A14B).
        """
        if _is_component(_model_index(path).get("transformer_2")):
            raise ValueError(
                f"{path} is a two-expert Wan 2.2 pipeline (transformer_2); the wan family distills one expert "
                "(Wan 2.1 T2V, Wan 2.2 TI2V-5B)"
            )
        temporal, spatial = self._factors(path)
        _, patch_h, patch_w = self._config(path)["patch_size"]
        frames, height, width = read_sample_size(path, DEFAULT_SAMPLE_SIZE)
        frames = (frames - 1) // temporal * temporal + 1
        height, width = (
            height // (spatial * patch_h) * spatial * patch_h,
            width // (spatial * patch_w) * spatial * patch_w,
        )
        return (frames, height, width, 3)

    def latent_shape(self, path: str | Path) -> tuple[int, int, int, int]:
        """``(in_channels, (F − 1)/4 + 1, H/8, W/8)``. Raises as :meth:`image_shape`."""
        frames, height, width, _ = self.image_shape(path)
        temporal, spatial = self._factors(path)
        channels = int(self._config(path)["in_channels"])
        return (channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)

    def text_tokens(self, path: str | Path) -> int:
        """512: the pipeline pads every prompt to ``max_sequence_length``."""
        return TEXT_TOKENS

    def compatibility_signature(self, path: str | Path) -> dict[str, Any]:
        """The latent shape and the transformer config keys of :data:`COMPATIBLE_KEYS`."""
        config = self._config(path)
        signature = {f"{what} ({key})": config.get(key) for key, what in COMPATIBLE_KEYS.items()}
        return {**super().compatibility_signature(path), **signature}

    def flow_shift(self, path: str | Path, num_steps: int | None = None) -> float:
        """The scheduler's static shift, whatever the step count: ``flow_shift`` (``UniPCMultistepScheduler``) or
        ``shift``."""
        config = read_json(Path(path) / "scheduler" / "scheduler_config.json", "scheduler config")
        return float(config.get("flow_shift", config.get("shift", 1.0)))

    def stock_guidance_scale(self, path: str | Path) -> float:
        """5.0: ``WanPipeline.__call__``'s ``guidance_scale`` (one expert; Wan 2.2's second expert has its own
        ``guidance_scale_2``, which miles does not train)."""
        return STOCK_GUIDANCE_SCALE

    def stock_scheduler_config(self, schedule: dict[str, Any]) -> dict[str, Any] | None:
        """A static scheduler whose ``set_timesteps(S)`` builds the student's grid (``shift`` m, ``shift_terminal``),
        or None for explicit timesteps (:func:`~miles.models.stock_schedulers.terminal_scheduler_config`)."""
        return terminal_scheduler_config(**schedule)

    def predict_velocity(
        self, denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One ``WanTransformer3DModel`` forward on ``(B, C, F', h, w)`` latents at ``timestep`` ∈ [0, 1000] (float32,
        per token with ``expand_timesteps``); returns float32 ``(B, C, F', h, w)``."""
        device, dtype = forward_device_dtype(denoiser)  # latents and cond; the timestep stays float32
        timestep = timestep.to(device, torch.float32)
        if self._expands_timesteps():
            p_t, p_h, p_w = denoiser.config.patch_size
            _, _, frames, height, width = latents.shape
            tokens = (frames // p_t) * (height // p_h) * (width // p_w)
            timestep = timestep[:, None].expand(-1, tokens)
        out = denoiser(
            hidden_states=latents.to(device, dtype),
            timestep=timestep,
            encoder_hidden_states=cond["encoder_hidden_states"].to(device, dtype),
            return_dict=False,
        )[0]
        return out.float()

    def _expands_timesteps(self) -> bool:
        if self._expand_timesteps is None:
            self._expand_timesteps = bool(_model_index(self.pipeline_path).get("expand_timesteps", False))
        return self._expand_timesteps

    def blocks(self, denoiser: nn.Module) -> list[nn.Module]:
        """The ``WanTransformerBlock``s (``_no_split_modules``)."""
        return list(denoiser.blocks)

    def image_tokens(self, block_output) -> torch.Tensor:
        """A ``WanTransformerBlock`` returns the video tokens ``(B, f·h·w, D)`` themselves."""
        return block_output

    def token_grid(self, denoiser: nn.Module, latent_shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(f, h, w)``: the latent's sizes over the patch ``(1, 2, 2)``."""
        _, frames, height, width = latent_shape
        p_t, p_h, p_w = denoiser.config.patch_size
        return frames // p_t, height // p_h, width // p_w

    def token_width(self, denoiser: nn.Module) -> int:
        """``num_attention_heads · attention_head_dim``."""
        return int(denoiser.config.num_attention_heads) * int(denoiser.config.attention_head_dim)

    @property
    def vae(self):
        """The pipeline's ``AutoencoderKLWan`` (float32, eval, CPU), loaded on first use."""
        if self._vae is None:
            from diffusers import AutoencoderKLWan

            self._vae = AutoencoderKLWan.from_pretrained(self.pipeline_path / "vae", torch_dtype=torch.float32)
            self._vae.eval()
        return self._vae

    def _statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``latents_mean`` and ``latents_std`` as ``(1, C, 1, 1, 1)``."""
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        return torch.tensor(config.latents_mean).view(shape), torch.tensor(config.latents_std).view(shape)

    @torch.no_grad()
    def images_to_latents(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (or float 0..255) clips ``(B, F, H, W, 3)`` → float32 latents ``(B, C, F', H/8, W/8)`` (posterior
        mode, normalised)."""
        images = torch.as_tensor(images)
        if images.ndim != 5:
            raise ValueError(f"Wan videos must be (B, F, H, W, C), got shape {tuple(images.shape)}")
        pixels = (images.float() / 255.0 * 2.0 - 1.0).permute(0, 4, 1, 2, 3)
        mean, std = self._statistics()
        return ((self.vae.encode(pixels).latent_dist.mode() - mean) / std).float()

    @torch.no_grad()
    def latents_to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """float latents ``(B, C, F', h, w)`` → uint8 clips ``(B, F, 8h, 8w, 3)``."""
        mean, std = self._statistics()
        latents = latents.detach().float() * std.to(latents.device) + mean.to(latents.device)
        with module_on(self.vae, latents.device) as vae:  # decoded where the latents are (the worker's GPU)
            pixels = vae.decode(latents, return_dict=False)[0]
        pixels = ((pixels + 1.0) / 2.0 * 255.0).round().clamp(0, 255)
        return pixels.to(torch.uint8).cpu().permute(0, 2, 3, 4, 1).contiguous()
