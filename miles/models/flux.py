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
  call's: 3.5 for dev, 1 for schnell (``stock_guidance``, cut to :meth:`FluxFamily.max_guidance_scale`). A negative prompt is never encoded
  for a dev teacher: its guidance has no unconditional branch.
- **Export**: the pipeline passes ``sigmas=linspace(1, 1/S, S)`` itself, so the export writes a static stock
  scheduler with ``shift`` = k (:func:`~miles.models.stock_schedulers.sigmas_call_scheduler_config`); the call's
  ``guidance_scale`` is the student's guidance input (1).
"""

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from miles.models.capabilities import EmbeddedGuidance, PixelCodec, TokenFeatures
from miles.models.diffusers_family import DiffusersFamily, PipelinePromptEncoder
from miles.models.packed_dit import PACK, PackedDiTFamily, pack_latents
from miles.models.registry import register_family

__all__ = ["FluxFamily", "STUDENT_GUIDANCE", "TEXT_TOKENS", "latent_ids"]

# FluxPipeline.__call__'s max_sequence_length: T5 is padded to it (DiffusersFamily's default)
TEXT_TOKENS = DiffusersFamily.max_sequence_length
# The guidance input of a forward that is not given one: the unguided value, which the samplers' guided_velocity at
# scale 1 (--diffusion-guidance-scale, DMD2's student) also passes, so that the student's rollout and its training
# forward agree.
STUDENT_GUIDANCE = 1.0


def latent_ids(height: int, width: int) -> torch.Tensor:
    """float32 ``(h·w, 3)`` position ids ``(0, row, col)`` of the packed tokens in raster order, ``h × w`` the token
    grid (``FluxPipeline._prepare_latent_image_ids``)."""
    rows = torch.arange(height, dtype=torch.float32).view(-1, 1).expand(height, width)
    cols = torch.arange(width, dtype=torch.float32).view(1, -1).expand(height, width)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(height * width, 3)


@register_family
class FluxFamily(PackedDiTFamily, EmbeddedGuidance, PixelCodec, TokenFeatures):
    """Diffusers FLUX.1 pipelines: ``FluxTransformer2DModel`` over packed VAE latents, CLIP-L pooled + T5 text.

    Cond kwargs: ``{"encoder_hidden_states": (B, 512, joint_attention_dim), "pooled_projections": (B, 768)}``. Embedded
    guidance (the teacher's scale is its ``guidance`` input; see the module docstring), a VAE codec, image tokens for
    the GAN head, and a stock export that ``FluxPipeline`` samples.
    """

    name = "flux"
    pipeline_classes = ("FluxPipeline",)
    # FluxPipeline.__call__'s guidance_scale default (diffusers 0.42.1): FLUX.1-dev's guidance input
    stock_guidance = 3.5
    block_attributes = ("transformer_blocks", "single_transformer_blocks")
    # a schnell student may learn from a dev teacher: guidance_embeds is not among them
    compatible_keys = {
        "in_channels": "packed latent channels",
        "joint_attention_dim": "T5 width",
        "pooled_projection_dim": "CLIP pooled width",
    }

    def prompt_cond(self, encoder: PipelinePromptEncoder, prompts: list[str]) -> dict[str, Tensor]:
        """``{"encoder_hidden_states": (B, 512, D) T5 states, "pooled_projections": (B, P) CLIP pooled}``."""
        states, pooled, _ = encoder.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=encoder.device, max_sequence_length=self.max_sequence_length
        )
        return {"encoder_hidden_states": states, "pooled_projections": pooled}

    def guidance_cond(self, guidance_scale: float, batch: int) -> dict[str, torch.Tensor]:
        """``{"guidance": (batch,)}`` filled with the scale (float32): the pipeline's ``guidance`` tensor."""
        return {"guidance": torch.full((batch,), float(guidance_scale), dtype=torch.float32)}

    def max_guidance_scale(self, path: str | Path) -> float | None:
        """1 for a transformer without ``guidance_embeds`` (FLUX.1-schnell: no guidance input, no CFG), else None."""
        return None if self.transformer_config(path).get("guidance_embeds", False) else 1.0

    def forward_inputs(
        self, denoiser: nn.Module, latents: Tensor, timestep: Tensor, cond: dict[str, Tensor]
    ) -> dict[str, Any]:
        """``FluxPipeline.__call__``'s forward: the latents packed 2×2, ``img_ids`` ``(0, row, col)`` of the token
        grid, ``txt_ids`` zeros; a transformer with ``guidance_embeds`` gets ``cond["guidance"]`` (float32, default
        :data:`STUDENT_GUIDANCE`), one without never gets one."""
        device, dtype = latents.device, latents.dtype
        batch, _, height, width = latents.shape
        states = cond["encoder_hidden_states"]
        guidance = None
        if denoiser.config.guidance_embeds:
            guidance = cond.get("guidance")
            if guidance is None:
                guidance = torch.full((batch,), STUDENT_GUIDANCE)
            guidance = guidance.to(device, torch.float32)
        return {
            "hidden_states": pack_latents(latents),
            "timestep": timestep,
            "guidance": guidance,
            "pooled_projections": cond["pooled_projections"].to(device, dtype),
            "encoder_hidden_states": states.to(device, dtype),
            "txt_ids": torch.zeros(states.shape[1], 3, device=device),
            "img_ids": latent_ids(height // PACK, width // PACK).to(device),
        }

    def meta_cond(self, config: dict, text_tokens: int) -> dict[str, Tensor]:
        with torch.device("meta"):
            return {
                "encoder_hidden_states": torch.empty(1, text_tokens, int(config["joint_attention_dim"])),
                "pooled_projections": torch.empty(1, int(config["pooled_projection_dim"])),
            }
