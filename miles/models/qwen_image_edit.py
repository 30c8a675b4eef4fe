"""The ``qwen_image_edit`` family: diffusers ``QwenImageEditPipeline`` directories (Qwen/Qwen-Image-Edit) and
``QwenImageEditPlusPipeline`` ones (Qwen-Image-Edit-2509 / 2511) with one reference image, an image-conditioned
family: each record carries a reference image that the student edits.

Edit-Plus with one reference calls the transformer as Edit does (the same reference latents and ``img_shapes``; a
2511 transformer's ``zero_cond_t`` acts inside the transformer on the same inputs); its prompt encoding sees the
reference at about 384² pixels (``CONDITION_IMAGE_SIZE``) under its own template. Several references per record are
not built.

What the stock pipeline does and where (diffusers 0.42.1, ``pipelines/qwenimage/pipeline_qwenimage_edit.py``,
``__call__`` and ``prepare_latents``; the study is docs/families.md):

- **Reference latents**: the input image resized (``VaeImageProcessor.resize``, Lanczos) to
  ``calculate_dimensions(1024², w / h)`` (about a megapixel, sides multiples of 32, the aspect ratio kept), encoded
  by the VAE as one frame, the posterior's mode, normalised per channel like the target latents (``(mode −
  latents_mean) / latents_std``), packed 2×2. Each forward's ``hidden_states`` are the noisy target's tokens followed
  by the reference's, ``img_shapes = [(1, h/2, w/2), (1, h'/2, w'/2)]`` per sample, and the velocity is the output's
  first ``(h/2)·(w/2)`` tokens (``noise_pred[:, : latents.size(1)]``). The reference is clean at every step.
- **Prompts**: ``encode_prompt(prompt, image)``: the edit chat template with the image's Qwen2.5-VL vision tokens
  (``Qwen2VLProcessor``), the last hidden layer, the first 64 template states dropped. A pipeline saved without its
  ``processor`` (transformers' ``Qwen2VLProcessor`` needs torchvision for its video half, which the offline test
  machines lack) encodes the prompt as ``QwenImagePipeline`` does, text only (:meth:`QwenImageEditFamily.prompt_cond`),
  and says so once in the log: the vision tokens are then left out of the prompt encoding, the reference latents
  are not.
- **Negative prompt**: the stock pipeline encodes it with the same image; miles encodes ``--negative-prompt`` once,
  text only (:meth:`QwenImageEditFamily.prompt_cond`), and the unconditional branch takes each sample's reference
  latents from its conditional branch (:meth:`QwenImageEditFamily._guide`). With a processor, the vision tokens are
  thus missing from the negative branch only.
- **Guidance, flow shift, export**: as ``qwen_image`` (:mod:`miles.models.qwen_image`): true CFG with the norm
  rescale, ``true_cfg_scale`` 4.0, the static shift at the target's token count (the pipeline computes ``mu`` from
  the target's tokens only), the ``sigmas=`` stock export.

Records name the reference under ``--condition-image-key`` (default ``condition_image``): a path to a ``.png`` /
``.npy`` file (relative to the JSONL file) or nested uint8 pixels, as ``--image-key`` images are given.
"""

import functools
import logging
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from miles.models.capabilities import ImageConditioned
from miles.models.diffusers_family import PipelinePromptEncoder
from miles.models.packed_dit import PACK, pack_latents, unpack_latents
from miles.models.qwen_image import QwenImageFamily
from miles.models.registry import register_family

__all__ = ["CONDITION_KEY", "QwenImageEditFamily", "REFERENCE_AREA", "reference_size"]

logger = logging.getLogger(__name__)

# the cond kwarg that carries the reference image's normalised latents (B, C, h', w')
CONDITION_KEY = "image_latents"
# QwenImageEditPipeline.__call__: the reference is resized to about this many pixels (calculate_dimensions(1024 * 1024))
REFERENCE_AREA = 1024 * 1024
# QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE: the vision encoder's copy of the reference is about 384² pixels
PLUS_VISION_AREA = 384 * 384


def reference_size(width: int, height: int, area: int = REFERENCE_AREA) -> tuple[int, int]:
    """``(width, height)`` the stock pipeline resizes a ``width × height`` reference image to: about ``area`` pixels
    (:data:`REFERENCE_AREA` for the VAE), the aspect ratio kept, each side rounded to a multiple of 32 (diffusers'
    ``calculate_dimensions``)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    new_width, new_height, _ = calculate_dimensions(area, width / height)
    return int(new_width), int(new_height)


@register_family
class QwenImageEditFamily(QwenImageFamily, ImageConditioned):
    """Diffusers Qwen-Image-Edit pipelines: Qwen-Image's transformer over the noisy target's packed tokens followed by
    the reference image's (the module docstring).

    Cond kwargs: Qwen-Image's ``{"encoder_hidden_states": (B, L, D), "encoder_hidden_states_mask": (B, L)}`` (L =
    :attr:`max_sequence_length`) and ``{"image_latents": (B, C, h', w')}``, the reference's normalised latents.
    """

    name = "qwen_image_edit"
    pipeline_classes = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    # the vision tokens of a megapixel reference (about 1,340 with Qwen2.5-VL's 28-pixel merged patches) join the
    # prompt's in the states, so the rows are longer than Qwen-Image's 512
    max_sequence_length = 2048

    # -- prompts and references ----------------------------------------------------------------------------------

    def prompt_cond(self, encoder: PipelinePromptEncoder, prompts: list[str]) -> dict[str, Tensor]:
        """The prompts without an image, as ``QwenImagePipeline.encode_prompt`` encodes them (its template, 34 states
        dropped): the negative prompt's branch, and every prompt of a pipeline saved without a processor."""
        from diffusers import QwenImagePipeline

        pipe = encoder.pipe
        text_only = getattr(encoder, "_text_only_pipe", None)
        if text_only is None:
            # the same text encoder and tokenizer under QwenImagePipeline's own template (no image tokens)
            text_only = QwenImagePipeline(
                scheduler=pipe.scheduler,
                vae=None,
                text_encoder=pipe.text_encoder,
                tokenizer=pipe.tokenizer,
                transformer=pipe.transformer,
            )
            encoder._text_only_pipe = text_only
        states, mask = text_only.encode_prompt(
            prompt=prompts, device=encoder.device, max_sequence_length=QwenImageFamily.max_sequence_length
        )
        return self.padded_cond(states, mask)

    def reference_latents(self, images: list[Tensor]) -> Tensor:
        """The references' normalised latents as the stock pipeline makes them: each uint8 ``(H, W, 3)`` image resized
        with Lanczos to :func:`reference_size`, encoded by the VAE (one frame, the posterior's mode), normalised.

        Returns:
            float32 ``(B, C, h', w')``.

        Raises:
            ValueError: if the references resize to different sizes (one batch, one shape: give references of one
                aspect ratio), or an image is not ``(H, W, 3)``.
        """
        from PIL import Image

        resized = []
        for image in images:
            array = np.asarray(torch.as_tensor(image).numpy(), dtype=np.uint8)
            if array.ndim != 3 or array.shape[-1] != 3:
                raise ValueError(f"a {self.name} reference image must be RGB (H, W, 3), got shape {array.shape}")
            size = reference_size(array.shape[1], array.shape[0])
            resized.append(np.asarray(Image.fromarray(array).resize(size, Image.Resampling.LANCZOS)))
        shapes = {array.shape for array in resized}
        if len(shapes) > 1:
            raise ValueError(
                f"the {self.name} references of one batch resize to different sizes {sorted(shapes)}; give references "
                "of one aspect ratio"
            )
        return self.images_to_latents(torch.from_numpy(np.stack(resized)))

    def encode_conditioned(
        self, encoder: PipelinePromptEncoder, prompts: list[str], images: list[Tensor]
    ) -> dict[str, Tensor]:
        """The cond kwargs of prompts each with its reference image uint8 ``(H, W, 3)``, float32 on the CPU: the
        prompt encoded with the image (``encode_prompt(prompt, image)``; text only without a processor, the module
        docstring) and the reference latents (:meth:`reference_latents`).

        Raises:
            ValueError: as :meth:`reference_latents`, or for another number of images than prompts.
        """
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many reference images, got {len(images)}")
        with torch.no_grad():
            latents = self.reference_latents(images)
            if getattr(encoder.pipe, "processor", None) is None:
                if not getattr(encoder, "_warned_text_only", False):
                    logger.warning(
                        "%s has no Qwen2VLProcessor: prompts are encoded without the reference image's vision tokens",
                        self.pipeline_path,
                    )
                    encoder._warned_text_only = True
                cond = self.prompt_cond(encoder, list(prompts))
            else:
                from PIL import Image

                # Edit's vision copy is the VAE's megapixel resize; Edit-Plus's its own 384² one (CONDITION_IMAGE_SIZE)
                plus = type(encoder.pipe).__name__ == "QwenImageEditPlusPipeline"
                area = PLUS_VISION_AREA if plus else REFERENCE_AREA
                pil = []
                for image in images:
                    array = np.asarray(torch.as_tensor(image).numpy(), dtype=np.uint8)
                    size = reference_size(array.shape[1], array.shape[0], area)
                    pil.append(Image.fromarray(array).resize(size, Image.Resampling.LANCZOS))
                states, mask = encoder.pipe.encode_prompt(prompt=list(prompts), image=pil, device=encoder.device)
                cond = self.padded_cond(states, mask)
        return {**{k: v.float().cpu() for k, v in cond.items()}, CONDITION_KEY: latents.float().cpu()}

    # -- the forward ---------------------------------------------------------------------------------------------

    def forward_inputs(
        self, denoiser: nn.Module, latents: Tensor, timestep: Tensor, cond: dict[str, Tensor]
    ) -> dict[str, Any]:
        """Qwen-Image's inputs with the reference's packed tokens after the target's and both shapes in
        ``img_shapes``, as ``QwenImageEditPipeline.__call__`` calls the transformer.

        Raises:
            KeyError: for a cond without ``image_latents`` (a prompt cache written for ``qwen_image``).
        """
        if CONDITION_KEY not in cond:
            raise KeyError(
                f"the {self.name} cond needs the reference latents {CONDITION_KEY!r}: records name a reference image "
                "under --condition-image-key"
            )
        text = {key: value for key, value in cond.items() if key != CONDITION_KEY}
        inputs = super().forward_inputs(denoiser, latents, timestep, text)
        reference = cond[CONDITION_KEY].to(latents.device, latents.dtype)
        batch, _, height, width = latents.shape
        ref_height, ref_width = reference.shape[-2:]
        inputs["hidden_states"] = torch.cat([inputs["hidden_states"], pack_latents(reference)], dim=1)
        shapes = [(1, height // PACK, width // PACK), (1, ref_height // PACK, ref_width // PACK)]
        inputs["img_shapes"] = [shapes] * batch
        return inputs

    def velocity_from_output(self, out: Tensor, latent_shape: tuple[int, ...]) -> Tensor:
        """The target's tokens of the output (the first ``(h/2)·(w/2)``; the reference's follow) as latents."""
        height, width = latent_shape[-2:]
        return unpack_latents(out[:, : (height // PACK) * (width // PACK)], height, width)

    def image_tokens(self, block_output: Any) -> Tensor:
        """The target's image tokens ``(B, (h/2)·(w/2), D)`` of a block's output, for the GAN head: the reference's
        tokens, which follow them, are left out. miles trains at the pipeline's one latent shape
        (:meth:`latent_shape`), so the count is the token grid of that shape."""
        tokens = super().image_tokens(block_output)
        return tokens[:, : self._target_tokens]

    @functools.cached_property
    def _target_tokens(self) -> int:
        _, height, width = self.latent_shape(self.pipeline_path)
        return (height // PACK) * (width // PACK)

    def _guide(self, predict, latents, timestep, cond, neg_cond, guidance_scale, norm_rescale) -> Tensor:
        """True CFG whose unconditional branch takes each sample's reference latents from ``cond`` (the negative
        prompt is encoded once, without an image)."""
        if neg_cond is not None and CONDITION_KEY in cond and CONDITION_KEY not in neg_cond:
            neg_cond = {**neg_cond, CONDITION_KEY: cond[CONDITION_KEY]}
        return super()._guide(predict, latents, timestep, cond, neg_cond, guidance_scale, norm_rescale)

    def tokens_per_sample(self, path) -> tuple[int, int]:
        """``(image tokens, text tokens)``: the target's tokens plus a megapixel square reference's
        (``(1024/16)²`` = 4096; the memory plan's figure for references of other aspect ratios is within a few per
        cent), and :attr:`max_sequence_length` text tokens."""
        image, text = super().tokens_per_sample(path)
        return image + (1024 // 16) ** 2, text

    def meta_cond(self, config: dict, text_tokens: int) -> dict[str, Tensor]:
        """Qwen-Image's meta text cond and a meta reference of the stock megapixel square's latents."""
        cond = super().meta_cond(config, text_tokens)
        channels = int(config["in_channels"]) // (PACK * PACK)
        side = 1024 // 8
        with torch.device("meta"):
            cond[CONDITION_KEY] = torch.empty(1, channels, side, side)
        return cond
