"""The ``flux`` family: diffusers ``FluxPipeline`` directories, FLUX.1-dev (guidance-distilled) and FLUX.1-schnell-style
ones (no guidance input).

What the stock pipeline does and where (diffusers 0.42, ``pipelines/flux/pipeline_flux.py``; the study is
docs/families.md):

- **Prompts**: the pipeline's own ``encode_prompt``: CLIP's pooled output (``pooled_projections``) and T5's last
  hidden state padded to ``max_sequence_length`` = 512 (``encoder_hidden_states``); no mask, ``txt_ids`` zeros.
- **Latents**: ``AutoencoderKL``, ``z = (mode − shift_factor) · scaling_factor``; packed 2×2 into ``(H/16)·(W/16)``
  tokens with ``img_ids = (0, row, col)`` inside ``predict_velocity``; the transformer takes σ (miles' timestep /
  1000).
- **Sample size**: ``_miles_sample_size`` in ``model_index.json``, else the pipeline's default 1024 × 1024
  (:mod:`miles.models.stock_defaults`). **Flow shift**: dev's scheduler is dynamic (0.5 → 1.15 over 256 → 4096
  tokens: ``e^mu`` = 3.16 at 1024², 1.88 at 512²); schnell's is static at 1.
- **Guidance** (:class:`~miles.models.capabilities.EmbeddedGuidance`): a dev transformer (``guidance_embeds``)
  takes the scale as its ``guidance`` input, ``guidance_scale`` of the call (default 3.5), and runs once per step;
  ``--dmd2-teacher-guidance-scale w`` is that input for the teacher. The student and the critic run at
  ``guidance`` = 1 (``--diffusion-guidance-scale``, which DMD2 keeps at 1: the student is unguided and learns the
  teacher's guided distribution, as in tianweiy/DMD2). NVlabs/FastGen's FLUX recipe instead feeds 3.5 to teacher and
  student alike (``fastgen/networks/Flux/network.py``). A schnell transformer has no guidance input: it is never
  given one, and preflight refuses a teacher guidance scale other than 1 for it. The teacher's scale defaults to the
  call's: 3.5 for dev, 1 for schnell (:meth:`FluxFamily.stock_guidance_scale`). A negative prompt is never encoded
  for a dev teacher: its guidance has no unconditional branch.
- **Export**: the pipeline passes ``sigmas=linspace(1, 1/S, S)`` itself, so the export writes a static stock
  scheduler with ``shift`` = k (:func:`~miles.models.stock_schedulers.sigmas_call_scheduler_config`); the call's
  ``guidance_scale`` is the student's guidance input (1).
"""

import logging
from pathlib import Path

import torch
from torch import nn

from miles.models.base import place_text_encoders
from miles.models.capabilities import EmbeddedGuidance, PixelCodec, TokenFeatures, module_on
from miles.models.packed_dit import PACK, PackedDiTFamily, pack_latents, unpack_latents
from miles.models.precision import forward_device_dtype
from miles.models.registry import register_family

__all__ = ["FluxFamily", "FluxPromptEncoder", "STUDENT_GUIDANCE", "TEXT_TOKENS", "flux_velocity", "latent_ids"]

logger = logging.getLogger(__name__)

# FluxPipeline.__call__'s max_sequence_length: T5 is padded to it
TEXT_TOKENS = 512
# The guidance input of a forward that is not given one: the unguided value, which the samplers' guided_velocity at
# scale 1 (--diffusion-guidance-scale, DMD2's student) also passes, so that the student's rollout and its training
# forward agree.
STUDENT_GUIDANCE = 1.0
# FluxPipeline.__call__'s guidance_scale default (diffusers 0.42.1): FLUX.1-dev's guidance input
STOCK_GUIDANCE_SCALE = 3.5


class FluxPromptEncoder:
    """The text half of a FLUX.1 pipeline: ``FluxPipeline.encode_prompt`` on a pipeline built without its transformer
    and VAE (``encode_prompt`` reads neither while the CLIP encoder is present).

    Args:
        path: the pipeline directory.
        device: where the text encoders run.
        max_sequence_length: T5 tokens (the call's 512).
        dtype: the text encoders' weights.
    """

    def __init__(
        self,
        path: str | Path,
        device: str | torch.device = "cpu",
        max_sequence_length: int = TEXT_TOKENS,
        dtype: torch.dtype = torch.float32,
    ):
        from diffusers import FluxPipeline

        self.pipe = FluxPipeline.from_pretrained(path, transformer=None, vae=None, torch_dtype=dtype)
        self.text_modules = place_text_encoders(self.pipe, device)
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 T5 states ``(B, max_sequence_length, joint_attention_dim)`` and float32 CLIP pooled
        ``(B, pooled_projection_dim)``, on the CPU."""
        states, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return states.float().cpu(), pooled.float().cpu()


def latent_ids(height: int, width: int) -> torch.Tensor:
    """float32 ``(h·w, 3)`` position ids ``(0, row, col)`` of the packed tokens in raster order, ``h × w`` the token
    grid (``FluxPipeline._prepare_latent_image_ids``)."""
    rows = torch.arange(height, dtype=torch.float32).view(-1, 1).expand(height, width)
    cols = torch.arange(width, dtype=torch.float32).view(1, -1).expand(height, width)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(height * width, 3)


def flux_velocity(
    denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
) -> torch.Tensor:
    """One ``FluxTransformer2DModel`` forward (plain or FSDP-wrapped) as ``FluxPipeline.__call__`` runs it.

    Args:
        latents: ``(B, C, H, W)`` normalised latents ``x_σ``; packed 2×2 into ``(B, H/2·W/2, 4C)`` tokens.
        timestep: float ``(B,)`` in [0, 1000]; the transformer takes ``timestep / 1000`` (σ).
        cond: ``{"encoder_hidden_states": (B, L, D), "pooled_projections": (B, P)}``, and ``"guidance": (B,)`` for a
            guided forward. A transformer with ``guidance_embeds`` gets ``guidance`` (default
            :data:`STUDENT_GUIDANCE`), one without never does.

    Returns:
        The velocity ``v = ε − x0``, float32 ``(B, C, H, W)``.
    """
    device, dtype = forward_device_dtype(denoiser)  # latents and cond; the timestep stays float32
    batch, _, height, width = latents.shape
    states = cond["encoder_hidden_states"]
    guidance = None
    if denoiser.config.guidance_embeds:
        guidance = cond.get("guidance")
        if guidance is None:
            guidance = torch.full((batch,), STUDENT_GUIDANCE)
        guidance = guidance.to(device, torch.float32)
    out = denoiser(
        hidden_states=pack_latents(latents.to(device, dtype)),
        timestep=timestep.to(device, torch.float32) / 1000,
        guidance=guidance,
        pooled_projections=cond["pooled_projections"].to(device, dtype),
        encoder_hidden_states=states.to(device, dtype),
        txt_ids=torch.zeros(states.shape[1], 3, device=device),
        img_ids=latent_ids(height // PACK, width // PACK).to(device),
        return_dict=False,
    )[0]
    return unpack_latents(out.float(), height, width)


@register_family
class FluxFamily(PackedDiTFamily, EmbeddedGuidance, PixelCodec, TokenFeatures):
    """Diffusers FLUX.1 pipelines: ``FluxTransformer2DModel`` over packed VAE latents, CLIP-L pooled + T5 text.

    Cond kwargs: ``{"encoder_hidden_states": (B, 512, joint_attention_dim), "pooled_projections": (B, 768)}``. Embedded
    guidance (the teacher's scale is its ``guidance`` input; see the module docstring), a VAE codec, image tokens for
    the GAN head, and a stock export that ``FluxPipeline`` samples.
    """

    name = "flux"
    pipeline_classes = ("FluxPipeline",)
    stock_scheduler = True
    transformer_class = "FluxTransformer2DModel"
    # a schnell student may learn from a dev teacher: guidance_embeds is not among them
    compatible_keys = {
        "in_channels": "packed latent channels",
        "joint_attention_dim": "T5 width",
        "pooled_projection_dim": "CLIP pooled width",
    }

    def __init__(self, pipeline_path: str | Path) -> None:
        super().__init__(pipeline_path)
        self._vae = None

    def load_text_encoder(
        self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> FluxPromptEncoder:
        return FluxPromptEncoder(path, device=device, dtype=dtype)

    def encode_prompts(self, encoder: FluxPromptEncoder, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``{"encoder_hidden_states": (B, 512, D), "pooled_projections": (B, P)}``, float32 on the CPU.

        Raises:
            ValueError: on an empty prompt list.
        """
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        states, pooled = encoder.encode(list(prompts))
        return {"encoder_hidden_states": states, "pooled_projections": pooled}

    def guidance_cond(self, guidance_scale: float, batch: int) -> dict[str, torch.Tensor]:
        """``{"guidance": (batch,)}`` filled with the scale (float32): the pipeline's ``guidance`` tensor."""
        return {"guidance": torch.full((batch,), float(guidance_scale), dtype=torch.float32)}

    def max_guidance_scale(self, path: str | Path) -> float | None:
        """1 for a transformer without ``guidance_embeds`` (FLUX.1-schnell: no guidance input, no CFG), else None."""
        return None if self.transformer_config(path).get("guidance_embeds", False) else 1.0

    def stock_guidance_scale(self, path: str | Path) -> float:
        """3.5 (``FluxPipeline.__call__``'s ``guidance_scale``, the dev model card's) for a transformer with
        ``guidance_embeds``; 1 for one without (schnell: the pipeline passes no guidance whatever the call says)."""
        return STOCK_GUIDANCE_SCALE if self.max_guidance_scale(path) is None else 1.0

    def text_tokens(self, path: str | Path) -> int:
        """512 T5 tokens (the pooled CLIP vector is no token)."""
        return TEXT_TOKENS

    def predict_velocity(
        self, denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return flux_velocity(denoiser, latents, timestep, cond)

    def blocks(self, denoiser: nn.Module) -> list[nn.Module]:
        """The ``FluxTransformerBlock``s, then the ``FluxSingleTransformerBlock``s (diffusers' ``_no_split_modules``,
        in forward order)."""
        return [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]

    # PixelCodec
    @property
    def vae(self):
        """The pipeline's ``AutoencoderKL`` (float32, eval, CPU), loaded on first use."""
        if self._vae is None:
            from diffusers import AutoencoderKL

            self._vae = AutoencoderKL.from_pretrained(self.pipeline_path / "vae", torch_dtype=torch.float32).eval()
        return self._vae

    def _factors(self) -> tuple[float, float]:
        config = self.vae.config
        return float(config.scaling_factor), float(config.shift_factor or 0.0)

    @torch.no_grad()
    def images_to_latents(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (or float 0..255) ``(B, H, W, 3)`` → float32 normalised latents ``(B, C, H/8, W/8)`` (the posterior's
        mode; FLUX's img2img pipeline draws a sample).

        Raises:
            ValueError: for images that are not ``(B, H, W, C)``.
        """
        images = torch.as_tensor(images)
        if images.ndim != 4:
            raise ValueError(f"FLUX.1 images must be (B, H, W, C), got shape {tuple(images.shape)}")
        pixels = (images.float() / 255.0 * 2.0 - 1.0).permute(0, 3, 1, 2)
        scaling, shift = self._factors()
        return ((self.vae.encode(pixels).latent_dist.mode() - shift) * scaling).float()

    @torch.no_grad()
    def latents_to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """float normalised latents ``(B, C, h, w)`` → uint8 ``(B, 8h, 8w, 3)``."""
        scaling, shift = self._factors()
        with module_on(self.vae, latents.device) as vae:  # decoded where the latents are (the worker's GPU)
            pixels = vae.decode(latents.detach().float() / scaling + shift, return_dict=False)[0]
        pixels = ((pixels.clamp(-1.0, 1.0) + 1.0) / 2.0 * 255.0).round()
        return pixels.to(torch.uint8).cpu().permute(0, 2, 3, 1).contiguous()
