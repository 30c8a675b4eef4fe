"""The ``qwen_image`` family: diffusers ``QwenImagePipeline`` directories (Qwen/Qwen-Image).

What the stock pipeline does and where (diffusers 0.42, ``pipelines/qwenimage/pipeline_qwenimage.py``; the study is
docs/families.md):

- **Prompts**: the pipeline's own ``encode_prompt`` (the chat template, Qwen2.5-VL's last hidden layer, the first 34
  template states dropped, a 0/1 mask), right-padded here with zeros to ``max_sequence_length`` = 512 tokens (the
  call's default cap) so that every prompt's row has one shape; ``predict_velocity`` cuts a batch back to its longest
  prompt and passes no mask when none is padded, as the pipeline's own padding to the batch's longest does. The
  masked text keys change nothing else: the image tokens' rope positions do not depend on the text length.
- **Latents**: the 3-D VAE's ``(C, 1, H/8, W/8)`` without its frame axis, normalised per channel, ``z = (mode −
  latents_mean) / latents_std``; packed 2×2 into ``(H/16)·(W/16)`` tokens with ``img_shapes = [(1, H/16, W/16)]``
  inside ``predict_velocity``. The transformer takes σ (miles' timestep / 1000).
- **Sample size**: ``_miles_sample_size`` in ``model_index.json``, else the pipeline's default 1024 × 1024
  (:mod:`miles.models.stock_defaults`). **Flow shift**: ``e^mu`` at that size's token count (0.5 → 0.9 over 256 →
  8192 tokens: k = 2.00 at 1024²), without the pipeline's ``shift_terminal`` stretch, which a static shift cannot
  express.
- **Guidance**: true CFG ``comb = u + w·(c − u)``, which the stock pipeline then rescales to the conditional
  prediction's norm per packed token, ``comb · ‖c‖ / ‖comb‖`` (``QwenImagePipeline.__call__``;
  :func:`norm_rescaled_cfg`). The DMD2 teacher applies the rescale by default
  (``--dmd2-teacher-cfg-norm-rescale``), so that ``--dmd2-teacher-guidance-scale w`` is the distribution the stock
  pipeline samples at ``true_cfg_scale=w`` (default 4.0). ``--no-dmd2-teacher-cfg-norm-rescale`` guides plainly, as
  the DMD2 references do: tianweiy/DMD2 ``guidance.py`` (``pred_real_image_uncond + guidance_scale · (cond −
  uncond)``) and NVlabs/FastGen's Qwen-Image DMD2 teacher (``x0 + (w − 1)(x0 − x0_neg)`` in x0 space, the same
  thing, since x0 is affine in v). The negative prompt defaults to the model card's ``" "``
  (:attr:`QwenImageFamily.stock_negative_prompt`): the pipeline runs CFG only with a negative prompt, and the card
  passes one space "if you do not have specific concept to remove".
- **Export**: the pipeline passes ``sigmas=linspace(1, 1/S, S)`` itself, so the export writes a static stock
  scheduler with ``shift`` = k (:func:`~miles.models.stock_schedulers.sigmas_call_scheduler_config`), and the
  student's CFG is the call's ``true_cfg_scale``.
"""

from typing import Any

import torch
from torch import Tensor, nn

from miles.models.capabilities import PixelCodec, TokenFeatures, TrueCFG
from miles.models.diffusers_family import DiffusersFamily, PipelinePromptEncoder
from miles.models.packed_dit import PACK, PackedDiTFamily, pack_latents, unpack_latents
from miles.models.registry import register_family

__all__ = ["QwenImageFamily", "TEXT_TOKENS", "norm_rescaled_cfg"]

# QwenImagePipeline.__call__'s max_sequence_length: the prompt states after the dropped template header are cut to it
# (DiffusersFamily's default)
TEXT_TOKENS = DiffusersFamily.max_sequence_length


def norm_rescaled_cfg(v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """True CFG as ``QwenImagePipeline.__call__`` samples with it (diffusers 0.42.1, ``pipeline_qwenimage.py``):
    ``comb = u + w·(c − u)``, then ``comb · ‖c‖ / ‖comb‖`` with the L2 norms per packed token, over its ``4·C``
    values (one 2×2 patch of latent pixels: the pipeline's ``dim=-1`` of the ``(B, N, 4·C)`` tokens).

    Args:
        v_cond, v_uncond: velocities ``(B, C, H, W)`` of the prompt and the negative prompt, any float dtype.
        guidance_scale: w (the pipeline's ``true_cfg_scale``).

    Returns:
        float32 ``(B, C, H, W)``. A token whose ``comb`` is zero gives NaN, as in the pipeline.
    """
    height, width = v_cond.shape[-2:]
    cond, uncond = pack_latents(v_cond.float()), pack_latents(v_uncond.float())
    comb = uncond + guidance_scale * (cond - uncond)
    rescaled = comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    return unpack_latents(rescaled, height, width)


@register_family
class QwenImageFamily(PackedDiTFamily, TrueCFG, PixelCodec, TokenFeatures):
    """Diffusers Qwen-Image pipelines: ``QwenImageTransformer2DModel`` over packed VAE latents, Qwen2.5-VL text.

    Cond kwargs: ``{"encoder_hidden_states": (B, 512, joint_attention_dim), "encoder_hidden_states_mask": (B, 512)}``
    (float32, the mask 0/1). True CFG with the stock pipeline's optional norm rescale (the module docstring), a VAE
    codec (a 3-D VAE, one frame per image), image tokens for the GAN head, and a stock export that
    ``QwenImagePipeline`` samples.
    """

    name = "qwen_image"
    pipeline_classes = ("QwenImagePipeline",)
    # QwenImagePipeline.__call__'s true_cfg_scale default (diffusers 0.42.1), the model card's too
    stock_guidance = 4.0
    # the model card's negative prompt (Qwen/Qwen-Image README); QwenImagePipeline runs no CFG without one
    stock_negative_prompt = " "
    stock_cfg_norm_rescale = True
    single_frame_vae = True
    compatible_keys = {
        "in_channels": "packed latent channels",
        "out_channels": "output channels",
        "joint_attention_dim": "text-encoder width",
    }

    def prompt_cond(self, encoder: PipelinePromptEncoder, prompts: list[str]) -> dict[str, Tensor]:
        """``encode_prompt``'s states and 0/1 mask (the first ``L`` columns, ``L`` the batch's longest prompt),
        zero-padded to ``(B, 512, D)`` and ``(B, 512)`` so that every prompt's row has one shape."""
        states, mask = encoder.pipe.encode_prompt(
            prompt=prompts, device=encoder.device, max_sequence_length=self.max_sequence_length
        )
        return self.padded_cond(states, mask)

    def padded_cond(self, states: Tensor, mask: Tensor | None) -> dict[str, Tensor]:
        """``encode_prompt``'s ``(B, L, D)`` states and 0/1 mask (None: none padded) zero-padded to
        :attr:`max_sequence_length` rows, float32 on the CPU.

        Raises:
            ValueError: if L exceeds :attr:`max_sequence_length`.
        """
        batch, length, width = states.shape
        if length > self.max_sequence_length:
            raise ValueError(
                f"the {self.name} prompt encoding is {length} tokens long, more than the family's "
                f"{self.max_sequence_length}"
            )
        padded = torch.zeros(batch, self.max_sequence_length, width, dtype=torch.float32)
        padded[:, :length] = states.float().cpu()
        full_mask = torch.zeros(batch, self.max_sequence_length, dtype=torch.float32)
        full_mask[:, :length] = 1.0 if mask is None else mask.float().cpu()
        return {"encoder_hidden_states": padded, "encoder_hidden_states_mask": full_mask}

    def forward_inputs(
        self, denoiser: nn.Module, latents: Tensor, timestep: Tensor, cond: dict[str, Tensor]
    ) -> dict[str, Any]:
        """``QwenImagePipeline.__call__``'s forward: the latents packed 2×2 with ``img_shapes`` ``[(1, H/2, W/2)]``
        per sample; the text cut to the batch's longest prompt, its mask dropped when no position is padded (the
        pipeline's own batch padding)."""
        batch, _, height, width = latents.shape
        # The cut and the mask-or-None choice set the call's shapes, so the host needs them: read from the mask where
        # it lies on the host (the sampler's cond, a prompt cache's), they cost no wait for the GPU; a mask a caller
        # already moved to the GPU costs one transfer (there were two, each a sync, in every forward).
        mask = cond["encoder_hidden_states_mask"].detach().cpu() > 0.5
        length = max(int(mask.sum(dim=1).max()), 1)
        mask = mask[:, :length]
        padded = not bool(mask.all())
        return {
            "hidden_states": pack_latents(latents),
            "timestep": timestep,
            "encoder_hidden_states": cond["encoder_hidden_states"][:, :length].to(latents.device, latents.dtype),
            "encoder_hidden_states_mask": mask.to(latents.device, non_blocking=True) if padded else None,
            "img_shapes": [[(1, height // PACK, width // PACK)]] * batch,
        }

    def unused_parameters(self, denoiser: nn.Module) -> list[str]:
        """The last block's text output (``attn.to_add_out``, ``txt_mlp``): ``QwenImageTransformer2DModel`` drops
        the text stream after its last block (SD3's last block is ``context_pre_only`` and has no such layers)."""
        last = len(denoiser.transformer_blocks) - 1
        prefixes = (f"transformer_blocks.{last}.attn.to_add_out.", f"transformer_blocks.{last}.txt_mlp.")
        return [name for name, _ in denoiser.named_parameters() if name.startswith(prefixes)]

    def norm_rescaled_cfg(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """The stock pipeline's norm-rescaled CFG: :func:`norm_rescaled_cfg`."""
        return norm_rescaled_cfg(v_cond, v_uncond, guidance_scale)

    def stock_sampling_kwargs(self, path, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The student's CFG as ``true_cfg_scale`` (``guidance_scale`` is the guidance-distilled input Qwen-Image
        has not), and the sample size as ``height`` / ``width``."""
        kwargs = dict(kwargs)
        kwargs["true_cfg_scale"] = kwargs.pop("guidance_scale", 1.0)
        return super().stock_sampling_kwargs(path, kwargs)

    def meta_cond(self, config: dict, text_tokens: int) -> dict[str, Tensor]:
        """Meta states and a real all-ones mask: the forward reads the mask's lengths on the host."""
        with torch.device("meta"):
            states = torch.empty(1, text_tokens, int(config["joint_attention_dim"]))
        return {"encoder_hidden_states": states, "encoder_hidden_states_mask": torch.ones(1, text_tokens)}
