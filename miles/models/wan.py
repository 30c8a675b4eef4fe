"""The ``wan`` family: diffusers ``WanPipeline`` directories: Wan 2.1 T2V 1.3B / 14B, Wan 2.2 TI2V-5B in
text-to-video mode (one expert) and Wan 2.2 T2V A14B (two experts).

**Two experts** (Wan 2.2 A14B). ``model_index.json`` holds ``transformer`` (high noise), ``transformer_2`` (low
noise) and ``boundary_ratio`` (0.875 for T2V A14B); ``WanPipeline.__call__`` runs ``transformer`` where
``t >= boundary_ratio · num_train_timesteps`` and ``transformer_2`` below. miles distills them into one network:

* the frozen teacher is both experts (:meth:`WanFamily.expert_boundary`, :class:`miles.models.experts.ExpertSwitch`):
  each scoring σ goes to the expert the stock pipeline would run at it, with the one teacher guidance scale
  (``--dmd2-teacher-guidance-scale``; the stock call's ``guidance_scale_2`` for the low-noise expert is not taken);
* the student and the critic are one network each, started from ``transformer`` (the high-noise expert, the folder
  every one-network reader loads). One critic, not one per expert: the critic models the student's distribution,
  which one network produces at every σ, and a second critic would add a whole trainable 14B network (float32
  master weights, AdamW's two moments: about 224 GB sharded over the ranks) for a model of the same distribution;
* the ``--save-hf`` export is a one-network ``WanPipeline``: ``transformer_2`` dropped, ``boundary_ratio`` null, so
  the stock pipeline samples every step with the student (:meth:`WanFamily.write_one_denoiser_index`).

A two-network (phased) student is not built.

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

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from miles.models.capabilities import PixelCodec, TokenFeatures, TrueCFG
from miles.models.diffusers_family import DiffusersFamily, PipelinePromptEncoder
from miles.models.memory import ActivationLayout, cross_attention_layout
from miles.models.pipeline_files import SECOND_EXPERT, is_component, read_json, read_model_index
from miles.models.registry import register_family
from miles.models.stock_defaults import read_sample_size
from miles.models.stock_schedulers import terminal_scheduler_config

__all__ = ["WanFamily"]

# WanPipeline.__call__'s default clip (frames, height, width) (diffusers 0.42.1); its max_sequence_length is
# DiffusersFamily's 512
DEFAULT_SAMPLE_SIZE = (81, 480, 832)


@register_family
class WanFamily(DiffusersFamily, TrueCFG, PixelCodec, TokenFeatures):
    """``WanPipeline``: ``WanTransformer3DModel`` over normalised ``AutoencoderKLWan`` video latents ``(C, F', h, w)``,
    UMT5 text. Cond kwargs: ``{"encoder_hidden_states": (B, 512, text_dim)}``."""

    name = "wan"
    pipeline_classes = ("WanPipeline",)
    # WanPipeline.__call__'s guidance_scale (its guidance_scale_2 for Wan 2.2's second expert defaults to it; miles
    # guides both experts with one scale)
    stock_guidance = 5.0
    block_attributes = ("blocks",)
    compatible_keys = {
        "in_channels": "latent channels",
        "out_channels": "output channels",
        "patch_size": "patch size",
        "text_dim": "text-encoder width",
    }
    latent_shape_compatible = True
    video = True

    @staticmethod
    def _factors(path: str | Path) -> tuple[int, int]:
        """The VAE's ``(scale_factor_temporal, scale_factor_spatial)`` (4, 8; 4, 16 for Wan 2.2's VAE)."""
        vae = read_json(Path(path) / "vae" / "config.json", "VAE config")
        return int(vae.get("scale_factor_temporal", 4)), int(vae.get("scale_factor_spatial", 8))

    def prompt_cond(self, encoder: PipelinePromptEncoder, prompts: list[str]) -> dict[str, Tensor]:
        """``{"encoder_hidden_states": (B, 512, text_dim)}``, zero past each prompt's tokens."""
        embeds, _ = encoder.pipe.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=encoder.device,
        )
        return {"encoder_hidden_states": embeds}

    def image_shape(self, path: str | Path) -> tuple[int, int, int, int]:
        """``(F, H, W, 3)``: ``_miles_sample_size`` ``[frames, height, width]`` of ``model_index.json``
        (:mod:`miles.models.stock_defaults`), else the pipeline's default 81 × 480 × 832, rounded as the pipeline
        rounds them (F to ``4k + 1``, H and W down to multiples of ``8 · patch``)."""
        temporal, spatial = self._factors(path)
        _, patch_h, patch_w = self.transformer_config(path)["patch_size"]
        frames, height, width = read_sample_size(path, DEFAULT_SAMPLE_SIZE)
        frames = (frames - 1) // temporal * temporal + 1
        height, width = (
            height // (spatial * patch_h) * spatial * patch_h,
            width // (spatial * patch_w) * spatial * patch_w,
        )
        return (frames, height, width, 3)

    def sample_size_rule(self, path: str | Path) -> tuple[tuple[str, int, int], ...]:
        """Frames ``4k + 1`` (the VAE's temporal factor), height and width multiples of the VAE's spatial factor times
        the patch (16 for Wan 2.1: 8 × 2): the sizes :meth:`image_shape` keeps as they are."""
        temporal, spatial = self._factors(path)
        _, patch_h, patch_w = self.transformer_config(path)["patch_size"]
        return (("frames", temporal, 1), ("height", spatial * patch_h, 0), ("width", spatial * patch_w, 0))

    def latent_shape(self, path: str | Path) -> tuple[int, int, int, int]:
        """``(in_channels, (F − 1)/4 + 1, H/8, W/8)``."""
        frames, height, width, _ = self.image_shape(path)
        temporal, spatial = self._factors(path)
        channels = int(self.transformer_config(path)["in_channels"])
        return (channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)

    def flow_shift(self, path: str | Path, num_steps: int | None = None) -> float:
        """The scheduler's static shift, whatever the step count: ``flow_shift`` (``UniPCMultistepScheduler``) or
        ``shift``."""
        config = read_json(Path(path) / "scheduler" / "scheduler_config.json", "scheduler config")
        return float(config.get("flow_shift", config.get("shift", 1.0)))

    def expert_boundary(self, path: str | Path) -> float | None:
        """``boundary_ratio · num_train_timesteps`` of a two-expert pipeline (``model_index.json`` names a
        ``transformer_2`` and a ``boundary_ratio``; Wan 2.2 T2V A14B: 0.875 · 1000 = 875), the timestep from which down
        ``WanPipeline.__call__`` runs ``transformer_2``; None for one expert.

        Raises:
            ValueError: for a ``transformer_2`` without a ``boundary_ratio`` (the stock pipeline would never run it)
                or a ``boundary_ratio`` outside (0, 1).
        """
        index = read_model_index(path)
        if not is_component(index.get(SECOND_EXPERT)):
            return None
        ratio = index.get("boundary_ratio")
        if not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) < 1.0:
            raise ValueError(
                f"{path}/model_index.json has a {SECOND_EXPERT} but boundary_ratio {ratio!r}; a two-expert WanPipeline "
                "needs a boundary_ratio in (0, 1) (Wan 2.2 T2V A14B: 0.875)"
            )
        config = read_json(Path(path) / "scheduler" / "scheduler_config.json", "scheduler config")
        return float(ratio) * float(config.get("num_train_timesteps", 1000))

    def write_one_denoiser_index(self, folder: Path) -> None:
        """A two-expert export becomes a one-network ``WanPipeline``: ``transformer_2/`` removed, its
        ``model_index.json`` entry ``[null, null]`` (how ``save_pretrained`` writes an absent optional component) and
        ``boundary_ratio`` null, so ``WanPipeline.__call__`` runs ``transformer`` at every step. No-op for one
        expert."""
        index_path = Path(folder) / "model_index.json"
        index = read_model_index(folder)
        if not is_component(index.get(SECOND_EXPERT)):
            return
        shutil.rmtree(Path(folder) / SECOND_EXPERT, ignore_errors=True)
        index[SECOND_EXPERT] = [None, None]
        index["boundary_ratio"] = None
        index_path.unlink()  # a hard link to the source's file: replace it, never write through it
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def stock_scheduler_config(self, schedule: dict[str, Any]) -> dict[str, Any] | None:
        """A static scheduler whose ``set_timesteps(S)`` builds the student's grid (``shift`` m, ``shift_terminal``),
        or None for explicit timesteps (:func:`~miles.models.stock_schedulers.terminal_scheduler_config`)."""
        return terminal_scheduler_config(**schedule)

    @functools.cached_property
    def _expands_timesteps(self) -> bool:
        """``expand_timesteps`` of the pipeline's ``model_index.json`` (Wan 2.2 TI2V-5B): a timestep per token."""
        return bool(read_model_index(self.pipeline_path).get("expand_timesteps", False))

    def forward_inputs(
        self, denoiser: nn.Module, latents: Tensor, timestep: Tensor, cond: dict[str, Tensor]
    ) -> dict[str, Any]:
        """The latents ``(B, C, F', h, w)`` as they are (the transformer patchifies them), ``timestep`` ∈ [0, 1000]
        per sample, or per token ``(B, f·h·w)`` with ``expand_timesteps``."""
        if self._expands_timesteps:
            p_t, p_h, p_w = denoiser.config.patch_size
            _, _, frames, height, width = latents.shape
            tokens = (frames // p_t) * (height // p_h) * (width // p_w)
            timestep = timestep[:, None].expand(-1, tokens)
        return super().forward_inputs(denoiser, latents, timestep, cond)

    def activation_layout(self, config: dict) -> ActivationLayout:
        """``WanTransformerBlock``: self-attention with QK-norm and rope, cross-attention to the text, a GELU MLP
        ``ffn_dim`` wide; the patch embedding is a 3-D convolution over ``in_channels · prod(patch_size)`` values."""
        patch = config["patch_size"]
        return cross_attention_layout(
            config,
            patch_inputs=int(config["in_channels"]) * int(patch[0]) * int(patch[1]) * int(patch[2]),
            text_dim=int(config["text_dim"]),
            ffn_dim=int(config["ffn_dim"]),
            qk_norm=bool(config.get("qk_norm")),
        )

    def meta_cond(self, config: dict, text_tokens: int) -> dict[str, Tensor]:
        with torch.device("meta"):
            return {"encoder_hidden_states": torch.empty(1, text_tokens, int(config["text_dim"]))}
