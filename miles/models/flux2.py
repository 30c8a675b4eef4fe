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
from torch import Tensor, nn

from miles.models.capabilities import PixelCodec, TokenFeatures, TrueCFG
from miles.models.diffusers_family import DiffusersFamily, PipelinePromptEncoder
from miles.models.memory import ActivationLayout, joint_layout
from miles.models.pipeline_files import read_json, read_model_index
from miles.models.registry import register_family
from miles.models.stock_defaults import read_sample_size
from miles.models.stock_schedulers import sigmas_call_scheduler_config

__all__ = ["Flux2Family", "patchify", "unpatchify"]

# Flux2KleinPipeline's default step count (diffusers 0.42.1); its max_sequence_length is DiffusersFamily's 512
STOCK_NUM_STEPS = 50
# Flux2KleinPipeline.default_sample_size (latent pixels): 128 · vae_scale_factor 8 = 1024 pixels
DEFAULT_SAMPLE_SIZE = 128


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


@register_family
class Flux2Family(DiffusersFamily, TrueCFG, PixelCodec, TokenFeatures):
    """``Flux2KleinPipeline``: ``Flux2Transformer2DModel`` (double- then single-stream blocks) over patched,
    batch-normalised ``AutoencoderKLFlux2`` latents ``(4·C, H/16, W/16)``, Qwen3 text. Cond kwargs:
    ``{"encoder_hidden_states": (B, 512, joint_attention_dim)}``."""

    name = "flux2"
    pipeline_classes = ("Flux2KleinPipeline",)
    # Flux2KleinPipeline.__call__'s guidance_scale default (the klein-base model card's 4.0)
    stock_guidance = 4.0
    timestep_divisor = 1000.0
    block_attributes = ("transformer_blocks", "single_transformer_blocks")
    compatible_keys = {
        "in_channels": "patched latent channels",
        "out_channels": "output channels",
        "joint_attention_dim": "text-encoder width",
    }
    latent_shape_compatible = True

    def _vae_factor(self, path: str | Path) -> int:
        vae = read_json(Path(path) / "vae" / "config.json", "VAE config")
        return 2 ** (len(vae["block_out_channels"]) - 1)

    def prompt_cond(self, encoder: PipelinePromptEncoder, prompts: list[str]) -> dict[str, Tensor]:
        """``{"encoder_hidden_states": (B, 512, 3 · text width)}``: the stacked hidden states of layers (9, 18, 27)."""
        embeds, _ = encoder.pipe.encode_prompt(
            prompt=prompts, device=encoder.device, max_sequence_length=self.max_sequence_length
        )
        return {"encoder_hidden_states": embeds}

    def image_shape(self, path: str | Path) -> tuple[int, int, int]:
        """``(H, W, 3)``: ``_miles_sample_size`` of ``model_index.json`` (:mod:`miles.models.stock_defaults`), else the
        pipeline's default ``128 · vae_scale_factor`` square, rounded down to a multiple of 16 as the pipeline does."""
        multiple = 2 * self._vae_factor(path)
        default = (DEFAULT_SAMPLE_SIZE * self._vae_factor(path),) * 2
        height, width = read_sample_size(path, default)
        return (height // multiple * multiple, width // multiple * multiple, 3)

    def sample_size_rule(self, path: str | Path) -> tuple[tuple[str, int, int], ...]:
        """Height and width, multiples of twice the VAE's scale factor (16 for klein: its 8, times the 2×2 patch),
        the sizes :meth:`image_shape` keeps as they are."""
        multiple = 2 * self._vae_factor(path)
        return (("height", multiple, 0), ("width", multiple, 0))

    def latent_shape(self, path: str | Path) -> tuple[int, int, int]:
        """``(in_channels, H/16, W/16)`` (``in_channels`` = 4 · the VAE's latent channels)."""
        height, width, _ = self.image_shape(path)
        multiple = 2 * self._vae_factor(path)
        return (int(self.transformer_config(path)["in_channels"]), height // multiple, width // multiple)

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
        return 1.0 if read_model_index(path).get("is_distilled") else None

    def stock_scheduler_config(self, schedule: dict[str, Any]) -> dict[str, Any]:
        """A static scheduler at the student's shift: ``Flux2KleinPipeline`` passes ``linspace(1, 1/S, S)`` itself
        (:func:`~miles.models.stock_schedulers.sigmas_call_scheduler_config`)."""
        return sigmas_call_scheduler_config(**schedule)

    def forward_inputs(
        self, denoiser: nn.Module, latents: Tensor, timestep: Tensor, cond: dict[str, Tensor]
    ) -> dict[str, Any]:
        """``Flux2KleinPipeline.__call__``'s forward: one token per latent pixel in raster order, position ids
        ``(0, h, w, 0)`` for the image and ``(0, 0, 0, l)`` for the text, no guidance input."""
        batch, channels, height, width = latents.shape
        text = cond["encoder_hidden_states"].to(latents.device, latents.dtype)
        return {
            "hidden_states": latents.reshape(batch, channels, height * width).permute(0, 2, 1),
            "encoder_hidden_states": text,
            "timestep": timestep,
            "img_ids": _grid_ids(1, height, width, 1).to(latents.device),
            "txt_ids": _grid_ids(1, 1, 1, text.shape[1]).to(latents.device),
            "guidance": None,
        }

    def velocity_from_output(self, out: Tensor, latent_shape: tuple[int, ...]) -> Tensor:
        """The ``(B, h·w, C)`` output tokens as latents ``(B, C, h, w)``."""
        return out.permute(0, 2, 1).reshape(latent_shape)

    def image_tokens(self, block_output) -> torch.Tensor:
        """The image tokens ``(B, N, D)``: the second of a double-stream block's ``(text, image)``, the tokens after
        the 512 text tokens of a single-stream block's joint sequence."""
        if isinstance(block_output, tuple):
            return block_output[1]
        return block_output[:, self.max_sequence_length :]

    def activation_layout(self, config: dict) -> ActivationLayout:
        """Double-stream then single-stream blocks with QK-norm, rope and a SwiGLU MLP ``mlp_ratio`` wide, over one
        token of ``in_channels`` values per latent pixel."""
        return joint_layout(config, patch_inputs=int(config["in_channels"]), swiglu=True)

    def meta_cond(self, config: dict, text_tokens: int) -> dict[str, Tensor]:
        with torch.device("meta"):
            return {"encoder_hidden_states": torch.empty(1, text_tokens, int(config["joint_attention_dim"]))}

    def _batch_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std ``(1, 4·C, 1, 1)`` of the patched latents (the VAE's batch-norm running statistics)."""
        bn = self.vae.bn
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
        return bn.running_mean.view(1, -1, 1, 1), std

    def normalize_latents(self, raw: Tensor) -> Tensor:
        """The VAE's ``(B, C, h, w)`` → ``(B, 4·C, h/2, w/2)``: patched, then ``(x − mean) / std`` with the VAE's
        batch-norm statistics (``Flux2KleinPipeline._encode_vae_image``)."""
        mean, std = self._batch_norm()
        return (patchify(raw) - mean) / std

    def denormalize_latents(self, latents: Tensor) -> Tensor:
        """miles' ``(B, 4·C, h, w)`` → the VAE's ``(B, C, 2h, 2w)``: ``x · std + mean``, unpatched, on the VAE's
        device (what the stock call returns with ``output_type="latent"``)."""
        mean, std = self._batch_norm()
        return unpatchify(latents.to(mean.device) * std + mean)

    def to_vae_latents(self, latents: Tensor) -> Tensor:
        """miles' latents ``(B, 4·C, h, w)`` → the VAE's ``(B, C, 2h, 2w)`` (:meth:`denormalize_latents`)."""
        return self.denormalize_latents(latents.detach().float())
