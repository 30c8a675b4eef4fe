"""What a model family can do beyond the ``ModelFamily`` protocol, declared by subclassing a capability protocol.

A family class lists what it implements in its bases, e.g. ``class SD3Family(ModelFamily, TrueCFG, PixelCodec,
TokenFeatures)``; :func:`supports` reads the bases (nominal, not structural: a method that merely exists is not a
declaration). Each protocol's abstract methods must then be implemented.

- **Guidance form** (exactly one): :class:`TrueCFG` (the teacher runs a conditional and an unconditional branch,
  ``u + w·(c − u)``; SD3, digits, Qwen-Image, Wan) or :class:`EmbeddedGuidance` (a guidance-distilled teacher takes
  ``w`` as an input and runs once; FLUX.1-dev). ``--dmd2-teacher-guidance-scale w`` and ``--diffusion-guidance-scale
  w`` mean the same for both: the strength of guidance, 1 = none for true CFG.
- :class:`PixelCodec` (optional): pixels ↔ latents. Unlocks records with images (``--image-key`` data,
  ``--dmd2-gan-real-data`` images, ``python -m miles.rollout.encode_images``) and decoded eval and debug images;
  without it, data comes as latent files (``--latent-key``) and images are drawn from the raw latents.
- :class:`TokenFeatures` (optional): the denoiser's image tokens after a block. Unlocks the DMD2 GAN head
  (``--dmd2-gan-disc-weight``).
- :class:`DifferentiablePixels` (optional): latents → float pixels with autograd. Unlocks the DMD2 reward group
  (``--dmd2-reward-weight``), whose reward gradient flows back through the decode.
- :class:`ImageConditioned` (optional): each record carries a reference image (``--condition-image-key``) that
  conditions the denoiser besides the prompt (Qwen-Image-Edit); the prompt conditioner encodes both.
- :class:`MemoryLayout` (optional): the denoiser's tokens per sample, activations per token and block, and FLOPs per
  sample. Unlocks ``--dry-run``'s memory plan and time estimate (:mod:`miles.driver.memory_plan`,
  :mod:`miles.driver.estimate`), which ask the family and know no family themselves.
"""

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from miles.models.memory import ActivationLayout
from miles.utils.sampling import guided_velocity as true_cfg_velocity

__all__ = [
    "GUIDANCE_FORMS",
    "DifferentiablePixels",
    "EmbeddedGuidance",
    "ImageConditioned",
    "MemoryLayout",
    "PixelCodec",
    "TokenFeatures",
    "TrueCFG",
    "decode_latents",
    "module_on",
    "require",
    "supports",
]

Cond = dict[str, Tensor]
# predict(latents, timestep, cond) -> v: a family's predict_velocity bound to one denoiser
Predict = Callable[[Tensor, Tensor, Cond], Tensor]


class _GuidanceForm(Protocol):
    """What both guidance forms give the samplers: one call, whatever the form (:meth:`guided_velocity`)."""

    def guided_velocity(
        self,
        predict: Predict,
        latents: Tensor,
        timestep: Tensor,
        cond: Cond,
        neg_cond: Cond | None,
        guidance_scale: float,
        *,
        norm_rescale: bool = False,
    ) -> Tensor:
        """The guided velocity, float32 ``(B, *latent_shape)``, at strength ``guidance_scale`` (1 = none).

        Args:
            predict: ``predict(latents, timestep, cond) -> v``, the family's forward bound to one denoiser.
            neg_cond: the negative prompt's cond (true CFG's unconditional branch; embedded guidance ignores it).
            norm_rescale: rescale the guided prediction as the family's stock sampler does (true CFG only).

        Raises:
            ValueError: as the form's :meth:`_guide` says.
        """
        return self._guide(predict, latents, timestep, cond, neg_cond, guidance_scale, norm_rescale)

    @abstractmethod
    def _guide(self, predict, latents, timestep, cond, neg_cond, guidance_scale, norm_rescale) -> Tensor:
        """The form's guided velocity: the arguments of :meth:`guided_velocity`."""


class TrueCFG(_GuidanceForm):
    """Guidance form: classifier-free guidance with two branches, ``v = v_u + w·(v_c − v_u)`` (Ho & Salimans 2022),
    the unconditional branch on the negative prompt's cond. One batched ``[uncond; cond]`` forward.

    Class attributes:
        stock_cfg_norm_rescale: whether the family's stock sampler rescales the guided prediction to the conditional
            one's norm (``QwenImagePipeline``); such a family implements :meth:`norm_rescaled_cfg`, and
            ``--dmd2-teacher-cfg-norm-rescale`` defaults to it. False: plain CFG only.
    """

    stock_cfg_norm_rescale: ClassVar[bool] = False

    def _guide(self, predict, latents, timestep, cond, neg_cond, guidance_scale, norm_rescale) -> Tensor:
        """:func:`miles.utils.sampling.guided_velocity`, the two branches combined by :meth:`norm_rescaled_cfg` with
        ``norm_rescale`` (the stock sampler's rescale).

        Raises:
            ValueError: if ``guidance_scale != 1`` and ``neg_cond`` is missing or has other keys than ``cond``; with
                ``norm_rescale`` for a family without :attr:`stock_cfg_norm_rescale`.
        """
        if not norm_rescale:
            return true_cfg_velocity(predict, latents, timestep, cond, neg_cond, guidance_scale)
        if not self.stock_cfg_norm_rescale:
            name = getattr(self, "name", type(self).__name__)
            raise ValueError(f"the {name} family's stock sampler has no CFG norm rescale; guide it plainly")
        return true_cfg_velocity(predict, latents, timestep, cond, neg_cond, guidance_scale, self.norm_rescaled_cfg)

    def norm_rescaled_cfg(self, v_cond: Tensor, v_uncond: Tensor, guidance_scale: float) -> Tensor:
        """CFG as the family's stock sampler rescales it, float32 ``(B, *latent_shape)`` (only where
        :attr:`stock_cfg_norm_rescale`)."""
        raise NotImplementedError(f"{type(self).__name__} has no CFG norm rescale")


class EmbeddedGuidance(_GuidanceForm):
    """Guidance form: a guidance-distilled denoiser takes the scale ``w`` as a forward input (FLUX.1-dev's
    ``guidance``) and runs once; the negative prompt is not used."""

    @abstractmethod
    def guidance_cond(self, guidance_scale: float, batch: int) -> Cond:
        """The cond kwargs that carry ``w`` for ``batch`` rows, e.g. ``{"guidance": torch.full((batch,), w)}``."""

    def _guide(self, predict, latents, timestep, cond, neg_cond, guidance_scale, norm_rescale) -> Tensor:
        """One forward with the guidance input merged into ``cond``.

        Raises:
            ValueError: with ``norm_rescale``: one guided forward has no conditional branch to rescale to.
        """
        if norm_rescale:
            raise ValueError("embedded guidance runs one forward: there is no conditional branch to rescale to")
        extra = self.guidance_cond(guidance_scale, len(latents))
        extra = {key: value.to(latents.device) for key, value in extra.items()}
        return predict(latents, timestep, {**cond, **extra}).float()


GUIDANCE_FORMS = (TrueCFG, EmbeddedGuidance)


class PixelCodec(Protocol):
    """Pixels ↔ latents (a VAE, or a pixel-space scaling as the digits family's)."""

    @abstractmethod
    def image_shape(self, path) -> tuple[int, ...]:
        """The pixel shape ``(H, W, C)`` (video: ``(F, H, W, C)``) whose latent is one of ``latent_shape``."""

    @abstractmethod
    def images_to_latents(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (or float 0..255) pixels ``(B, *image_shape)`` → float32 latents ``(B, *latent_shape)``."""

    @abstractmethod
    def latents_to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """float latents ``(B, *latent_shape)`` → uint8 pixels ``(B, H, W, C)`` (video: ``(B, F, H, W, C)``) on the
        CPU, decoded on the latents' device (a VAE moves there for the call, :func:`module_on`)."""


class DifferentiablePixels(Protocol):
    """Latents → pixels as a differentiable map (the decoder without quantisation), for losses on pixels."""

    @abstractmethod
    def latents_to_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """float latents ``(B, *latent_shape)`` → float32 pixels ``(B, C, H, W)`` on the latents' device, 0 = black
        and 1 = white, not clipped (a clip would cut the gradient of out-of-range pixels), with autograd."""


class TokenFeatures(Protocol):
    """The denoiser's image tokens, the features the DMD2 GAN head reads (tianweiy/DMD2 taps the fake score's
    bottleneck; a DiT's middle block is its counterpart)."""

    @abstractmethod
    def image_tokens(self, block_output: Any) -> torch.Tensor:
        """The image tokens ``(B, N, D)`` of one of :meth:`~miles.models.base.ModelFamily.blocks`' outputs (a
        joint-attention block returns text and image tokens; keep the image's), N = the product of the grid."""

    @abstractmethod
    def token_grid(self, denoiser: nn.Module, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """How the N tokens of a ``latent_shape`` latent lie, row-major: ``(h, w)`` for an image, ``(f, h, w)``
        for a video (the latent's sizes divided by the patch size)."""

    @abstractmethod
    def token_width(self, denoiser: nn.Module) -> int:
        """D, the width of a token (the transformer's inner dimension)."""


class MemoryLayout(Protocol):
    """What the memory planner and the time estimate ask of a family's denoiser (``--dry-run``): they build it from
    its ``transformer/config.json`` on the meta device and know nothing else of it.

    :class:`~miles.models.diffusers_family.DiffusersFamily` implements :meth:`tokens_per_sample` and
    :meth:`flops_per_sample` for a stock pipeline; a family describes its blocks in :meth:`activation_layout` with
    :func:`miles.models.memory.joint_layout` or :func:`~miles.models.memory.cross_attention_layout`, or counts its
    own :class:`~miles.models.memory.ActivationLayout`.
    """

    @abstractmethod
    def tokens_per_sample(self, path) -> tuple[int, int]:
        """``(image tokens, text tokens)`` one sample of pipeline ``path`` puts through the blocks (image: the token
        grid of the latent shape; video: all its frames' tokens)."""

    @abstractmethod
    def activation_layout(self, config: dict) -> ActivationLayout:
        """The activation elements per image and text token that each block keeps for its backward and takes as its
        inputs, and what the embedders and the output layer keep, for the denoiser of ``config`` (its full diffusers
        config, :func:`miles.models.memory.full_config`). Elements, not bytes: the planner multiplies by the compute
        dtype's size, the tokens and the batch (:func:`miles.models.memory.activation_estimate`)."""

    @abstractmethod
    def flops_per_sample(self, path) -> tuple[float, int]:
        """``(FLOPs, parameters)`` of one denoiser forward of one sample of pipeline ``path``, counted on the meta
        device (:func:`miles.models.memory.count_forward_flops`); no weight is read."""


class ImageConditioned(Protocol):
    """Optional: the denoiser is conditioned on a reference image of each record besides its prompt (an edit model:
    Qwen-Image-Edit). Records name the image under ``--condition-image-key``; the prompt conditioner
    (:class:`miles.rollout.conditioning.PromptConditioner`) hands the family each prompt with its image, and the
    cond kwargs it returns carry both (a prompt cache is not written for such a family: records are encoded where
    they are used)."""

    @abstractmethod
    def encode_conditioned(self, encoder: Any, prompts: list[str], images: list[Tensor]) -> Cond:
        """The cond kwargs ``{name: (B, ...)}`` (float32, CPU) of B prompts, each with its reference image, uint8
        ``(H, W, C)``."""


def supports(family: Any, capability: type) -> bool:
    """Whether ``family`` (an instance or a class) declares ``capability`` by subclassing it."""
    cls = family if isinstance(family, type) else type(family)
    return capability in cls.__mro__


def require(family: Any, capability: type, needed_by: str) -> None:
    """Raise unless ``family`` declares ``capability``.

    Raises:
        ValueError: ``"<needed_by> needs a family that implements <capability>; the <name> family does not"``.
    """
    if not supports(family, capability):
        name = getattr(family, "name", type(family).__name__)
        raise ValueError(
            f"{needed_by} needs a model family that implements miles.models.capabilities.{capability.__name__}; "
            f"the {name} family does not"
        )


@contextlib.contextmanager
def module_on(module: nn.Module, device: torch.device | str) -> Iterator[nn.Module]:
    """``module`` moved to ``device`` for a block, and back to where it was after it: a frozen VAE decodes eval
    images on the worker's GPU, then leaves it, so that it holds no GPU memory the memory plan does not count. A
    module already on ``device`` (a reward group's VAE, kept there by ``latents_to_pixels``) stays there."""
    param = next(module.parameters(), None)
    home = param.device if param is not None else torch.device(device)
    module.to(device)
    try:
        yield module
    finally:
        module.to(home)


def decode_latents(family: Any, latents: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Latents ``(B, *latent_shape)`` as uint8 pixels on the CPU for eval grids and hooks: the family's
    :meth:`PixelCodec.latents_to_images` when it has one, run on ``device`` (the worker's GPU; default the latents'
    own device: a VAE decode on a CPU core is minutes at 1024 px), else the raw latent read as pixels in [-1, 1]
    (``round((x + 1) · 127.5)`` after clipping) with its first 3 channels (or its one) as colours, so that a family
    without a codec still shows something. Returns ``(B, H, W, C)`` or, for video, ``(B, F, H, W, C)``."""
    if supports(family, PixelCodec):
        return family.latents_to_images(latents if device is None else latents.to(device))
    x = latents.detach().float().cpu()
    x = x[:, :3] if x.shape[1] >= 3 else x[:, :1]
    pixels = torch.floor((x.clamp(-1.0, 1.0) + 1.0) * 127.5 + 0.5).to(torch.uint8)
    return pixels.movedim(1, -1).contiguous()
