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

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.models.base import place_text_encoders
from miles.models.capabilities import PixelCodec, TokenFeatures, TrueCFG, module_on
from miles.models.packed_dit import PACK, PackedDiTFamily, pack_latents, unpack_latents
from miles.models.precision import forward_device_dtype
from miles.models.registry import register_family

__all__ = ["QwenImageFamily", "QwenImagePromptEncoder", "TEXT_TOKENS", "norm_rescaled_cfg", "qwen_image_velocity"]

logger = logging.getLogger(__name__)

# QwenImagePipeline.__call__'s max_sequence_length: the prompt states after the dropped template header are cut to it
TEXT_TOKENS = 512
# QwenImagePipeline.__call__'s true_cfg_scale default (diffusers 0.42.1), the model card's too
STOCK_GUIDANCE_SCALE = 4.0


class QwenImagePromptEncoder:
    """The text half of a Qwen-Image pipeline: ``QwenImagePipeline.encode_prompt`` on a pipeline built without its
    transformer and VAE (``encode_prompt`` reads neither).

    Args:
        path: the pipeline directory.
        device: where the text encoder runs.
        max_sequence_length: prompt states kept after the template header (the call's 512).
        dtype: the text encoder's weights (Qwen2.5-VL-7B: 33 GB in float32, half in bfloat16).
    """

    def __init__(
        self,
        path: str | Path,
        device: str | torch.device = "cpu",
        max_sequence_length: int = TEXT_TOKENS,
        dtype: torch.dtype = torch.float32,
    ):
        from diffusers import QwenImagePipeline

        self.pipe = QwenImagePipeline.from_pretrained(path, transformer=None, vae=None, torch_dtype=dtype)
        self.text_modules = place_text_encoders(self.pipe, device)
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(B, max_sequence_length, D)`` states (zeros past each prompt) and their float32 0/1 mask
        ``(B, max_sequence_length)``; the first ``L`` columns are ``encode_prompt``'s output for the batch."""
        states, mask = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=self.max_sequence_length
        )
        batch, length, width = states.shape
        padded = torch.zeros(batch, self.max_sequence_length, width, dtype=torch.float32)
        padded[:, :length] = states.float().cpu()
        full_mask = torch.zeros(batch, self.max_sequence_length, dtype=torch.float32)
        full_mask[:, :length] = 1.0 if mask is None else mask.float().cpu()
        return padded, full_mask


def qwen_image_velocity(
    denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
) -> torch.Tensor:
    """One ``QwenImageTransformer2DModel`` forward (plain or FSDP-wrapped) as ``QwenImagePipeline.__call__`` runs it.

    Args:
        latents: ``(B, C, H, W)`` normalised latents ``x_σ``; packed 2×2 into ``(B, H/2·W/2, 4C)`` tokens.
        timestep: float ``(B,)`` in [0, 1000]; the transformer takes ``timestep / 1000`` (σ).
        cond: ``{"encoder_hidden_states": (B, L, D), "encoder_hidden_states_mask": (B, L) 0/1}``; cut to the batch's
            longest prompt, the mask dropped when no position is padded (the pipeline's own batch padding).

    Returns:
        The velocity ``v = ε − x0``, float32 ``(B, C, H, W)``.
    """
    device, dtype = forward_device_dtype(denoiser)  # latents and cond; the timestep stays float32
    batch, _, height, width = latents.shape
    # The cut and the mask-or-None choice set the call's shapes, so the host needs them: read from the mask where it
    # lies on the host (the sampler's cond, a prompt cache's), they cost no wait for the GPU; a mask a caller already
    # moved to the GPU costs one transfer (there were two, each a sync, in every forward).
    mask = cond["encoder_hidden_states_mask"].detach().cpu() > 0.5
    length = max(int(mask.sum(dim=1).max()), 1)
    mask = mask[:, :length]
    padded = not bool(mask.all())
    out = denoiser(
        hidden_states=pack_latents(latents.to(device, dtype)),
        timestep=timestep.to(device, torch.float32) / 1000,
        encoder_hidden_states=cond["encoder_hidden_states"][:, :length].to(device, dtype),
        encoder_hidden_states_mask=mask.to(device, non_blocking=True) if padded else None,
        img_shapes=[[(1, height // PACK, width // PACK)]] * batch,
        return_dict=False,
    )[0]
    return unpack_latents(out.float(), height, width)


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
    codec, image tokens for the GAN head, and a stock export that ``QwenImagePipeline`` samples.
    """

    name = "qwen_image"
    pipeline_classes = ("QwenImagePipeline",)
    stock_scheduler = True
    # the model card's negative prompt (Qwen/Qwen-Image README); QwenImagePipeline runs no CFG without one
    stock_negative_prompt = " "
    stock_cfg_norm_rescale = True
    transformer_class = "QwenImageTransformer2DModel"
    compatible_keys = {
        "in_channels": "packed latent channels",
        "out_channels": "output channels",
        "joint_attention_dim": "text-encoder width",
    }

    def __init__(self, pipeline_path: str | Path) -> None:
        super().__init__(pipeline_path)
        self._vae = None

    def load_text_encoder(
        self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> QwenImagePromptEncoder:
        return QwenImagePromptEncoder(path, device=device, dtype=dtype)

    def encode_prompts(self, encoder: QwenImagePromptEncoder, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``{"encoder_hidden_states": (B, 512, D), "encoder_hidden_states_mask": (B, 512)}``, float32 on the CPU.

        Raises:
            ValueError: on an empty prompt list.
        """
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        states, mask = encoder.encode(list(prompts))
        return {"encoder_hidden_states": states, "encoder_hidden_states_mask": mask}

    def text_tokens(self, path: str | Path) -> int:
        """512: the prompt states a cond row holds (a bound; a batch runs at its longest prompt)."""
        return TEXT_TOKENS

    def predict_velocity(
        self, denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return qwen_image_velocity(denoiser, latents, timestep, cond)

    def blocks(self, denoiser: nn.Module) -> list[nn.Module]:
        """The ``QwenImageTransformerBlock``s (diffusers' ``_no_split_modules``)."""
        return list(denoiser.transformer_blocks)

    def unused_parameters(self, denoiser: nn.Module) -> list[str]:
        """The last block's text output (``attn.to_add_out``, ``txt_mlp``): ``QwenImageTransformer2DModel`` drops
        the text stream after its last block (SD3's last block is ``context_pre_only`` and has no such layers)."""
        last = len(denoiser.transformer_blocks) - 1
        prefixes = (f"transformer_blocks.{last}.attn.to_add_out.", f"transformer_blocks.{last}.txt_mlp.")
        return [name for name, _ in denoiser.named_parameters() if name.startswith(prefixes)]

    def stock_guidance_scale(self, path: str | Path) -> float:
        """4.0: ``QwenImagePipeline.__call__``'s ``true_cfg_scale`` (diffusers 0.42.1) and the model card's."""
        return STOCK_GUIDANCE_SCALE

    def norm_rescaled_cfg(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """The stock pipeline's norm-rescaled CFG: :func:`norm_rescaled_cfg`."""
        return norm_rescaled_cfg(v_cond, v_uncond, guidance_scale)

    def stock_sampling_kwargs(self, path: str | Path, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The student's CFG as ``true_cfg_scale`` (``guidance_scale`` is the guidance-distilled input Qwen-Image
        has not), and the sample size as ``height`` / ``width``."""
        kwargs = dict(kwargs)
        kwargs["true_cfg_scale"] = kwargs.pop("guidance_scale", 1.0)
        return super().stock_sampling_kwargs(path, kwargs)

    # PixelCodec
    @property
    def vae(self):
        """The pipeline's ``AutoencoderKLQwenImage`` (float32, eval, CPU), loaded on first use."""
        if self._vae is None:
            from diffusers import AutoencoderKLQwenImage

            self._vae = AutoencoderKLQwenImage.from_pretrained(
                self.pipeline_path / "vae", torch_dtype=torch.float32
            ).eval()
        return self._vae

    def _statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.vae.config
        shape = (1, int(config.z_dim), 1, 1)
        return torch.tensor(config.latents_mean).view(shape), torch.tensor(config.latents_std).view(shape)

    @torch.no_grad()
    def images_to_latents(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (or float 0..255) ``(B, H, W, 3)`` → float32 normalised latents ``(B, C, H/8, W/8)``.

        The posterior's mode, as miles' ``sd3`` family takes it (Qwen's img2img pipeline draws a sample; the mode
        keeps a record a function of its image).

        Raises:
            ValueError: for images that are not ``(B, H, W, C)``.
        """
        images = torch.as_tensor(images)
        if images.ndim != 4:
            raise ValueError(f"Qwen-Image images must be (B, H, W, C), got shape {tuple(images.shape)}")
        pixels = (images.float() / 255.0 * 2.0 - 1.0).permute(0, 3, 1, 2).unsqueeze(2)  # (B, 3, 1, H, W)
        latents = self.vae.encode(pixels).latent_dist.mode()[:, :, 0]
        mean, std = self._statistics()
        return ((latents - mean) / std).float()

    @torch.no_grad()
    def latents_to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """float normalised latents ``(B, C, h, w)`` → uint8 ``(B, 8h, 8w, 3)``."""
        mean, std = self._statistics()
        latents = latents.detach().float() * std.to(latents.device) + mean.to(latents.device)
        with module_on(self.vae, latents.device) as vae:  # decoded where the latents are (the worker's GPU)
            pixels = vae.decode(latents.unsqueeze(2), return_dict=False)[0][:, :, 0]
        pixels = ((pixels.clamp(-1.0, 1.0) + 1.0) / 2.0 * 255.0).round()
        return pixels.to(torch.uint8).cpu().permute(0, 2, 3, 1).contiguous()
