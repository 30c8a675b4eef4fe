"""``DiffusersFamily``: a model family over a stock diffusers pipeline, with one copy of what every such family does.

It loads the pipeline's parts (the denoiser of ``transformer/``, the text encoders through the stock pipeline's own
``encode_prompt``, the VAE its ``vae/config.json`` names), runs the denoiser's forward with miles' conventions, encodes
and decodes through the VAE, taps the blocks' image tokens for the DMD2 GAN head and describes the denoiser's memory
layout for the planner. A family declares only what differs from its neighbours:

- its pipeline classes and stock settings (``pipeline_classes``, ``stock_guidance``, ``stock_negative_prompt``,
  ``max_sequence_length``, ``compatible_keys``, :meth:`~miles.models.base.ModelFamily.flow_shift`);
- its guidance form (:class:`~miles.models.capabilities.TrueCFG` or ``EmbeddedGuidance``) and its capabilities;
- how ``encode_prompt``'s output becomes the cond kwargs (:meth:`DiffusersFamily.prompt_cond`);
- its forward's inputs: the timestep's scale (``timestep_divisor``), the packing of latents into tokens
  (:meth:`~DiffusersFamily.forward_inputs`, :meth:`~DiffusersFamily.velocity_from_output`) and the position ids;
- its latent normalisation where the VAE config does not say it (:meth:`~DiffusersFamily.normalize_latents`);
- its blocks and their activation layout (``block_attributes``, :meth:`~DiffusersFamily.activation_layout`).

**The VAE, once.** Frozen (``requires_grad_(False)``, eval, float32, on the CPU until a decode moves it to the
latents' device), loaded on first use. Pixels go in as ``x = pixel / 255 · 2 − 1`` and the posterior's mode is
taken. The normalisation is the VAE config's, in the form the stock pipelines write it: ``z = (x − shift) · scale``
and ``x = z / scale + shift``, with ``(shift, scale)`` = ``(shift_factor, scaling_factor)`` (SD3, FLUX.1) or
``(latents_mean, 1 / latents_std)`` per channel (Qwen-Image, Wan). Decoded pixels become uint8 by
``VaeImageProcessor.postprocess``'s rule (diffusers 0.42.1, ``image_processor.py``): ``(x · 0.5 + 0.5).clamp(0, 1)``,
then ``round(· 255)`` (:func:`pixels_to_uint8`).
"""

import math
from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from miles.models.base import ModelFamily, place_text_encoders
from miles.models.capabilities import MemoryLayout, module_on
from miles.models.memory import ActivationLayout, count_forward_flops
from miles.models.pipeline_files import (
    DENOISER,
    SECOND_EXPERT,
    is_component,
    pipeline_class_name,
    read_json,
    read_model_index,
)
from miles.models.precision import forward_device_dtype

__all__ = ["DiffusersFamily", "PipelinePromptEncoder", "pixels_to_uint8", "uint8_to_pixels"]


def uint8_to_pixels(images: Tensor) -> Tensor:
    """uint8 (or float 0..255) pixels, channels last ``(B, ..., C)`` → float32 ``(B, C, ...)`` in [-1, 1]
    (``VaeImageProcessor.normalize`` of ``pixel / 255``)."""
    return (torch.as_tensor(images).float() / 255.0 * 2.0 - 1.0).movedim(-1, 1)


def pixels_to_uint8(pixels: Tensor) -> Tensor:
    """Decoded pixels ``(B, C, ...)`` in [-1, 1] → uint8 ``(B, ..., C)`` on the CPU, channels last.

    ``VaeImageProcessor.postprocess``'s rule (diffusers 0.42.1): ``denormalize`` clamps ``x · 0.5 + 0.5`` to [0, 1],
    then ``numpy_to_pil`` rounds ``· 255`` half to even. Clamping before or after the rounding gives the same uint8
    for every finite value (``tests/fast/models/test_diffusers_family.py`` checks both old orders against it).
    """
    pixels = ((pixels.float() * 0.5 + 0.5).clamp(0.0, 1.0) * 255.0).round()
    return pixels.to(torch.uint8).cpu().movedim(1, -1).contiguous()


class PipelinePromptEncoder:
    """The text half of a stock diffusers pipeline: the pipeline object built with a weightless (meta-device)
    transformer and no VAE, so that it holds only its text encoders and tokenizers; the family runs its
    ``encode_prompt`` (:meth:`DiffusersFamily.prompt_cond`).

    Components ``model_index.json`` saved as ``None`` or leaves out (SD3's ``text_encoder_3``, Wan's
    ``transformer_2``) are passed as None, which ``from_pretrained`` requires of them; so is a saved second expert
    (Wan 2.2 A14B's ``transformer_2``), which ``encode_prompt`` does not use.

    Args:
        family: the family whose pipeline class (``pipeline_classes``) opens ``path``.
        path: the pipeline directory.
        device: where the text encoders run.
        dtype: their weights (a trainer loads them in its compute dtype).
    """

    def __init__(
        self, family: "DiffusersFamily", path: str | Path, device: str | torch.device, dtype: torch.dtype
    ) -> None:
        import diffusers
        from accelerate import init_empty_weights

        path = Path(path)
        cls = getattr(diffusers, family.pipeline_class(path))
        index = read_model_index(path)
        components, _ = cls._get_signature_keys(cls)
        absent = {
            name: None for name in components if name not in (DENOISER, "vae") and not is_component(index.get(name))
        }
        if (
            SECOND_EXPERT in components
        ):  # a second expert (Wan 2.2 A14B) is not read either: encode_prompt never runs it
            absent[SECOND_EXPERT] = None
        denoiser_cls = family.denoiser_class(path)
        with init_empty_weights(include_buffers=True):  # encode_prompt reads the transformer's config only
            meta = denoiser_cls.from_config(denoiser_cls.load_config(path / DENOISER))
        self.pipe = cls.from_pretrained(path, transformer=meta, vae=None, torch_dtype=dtype, **absent)
        self.text_modules = place_text_encoders(self.pipe, device)
        self.device = torch.device(device)


class DiffusersFamily(ModelFamily, MemoryLayout):
    """A family over a stock diffusers pipeline (see the module docstring for what a subclass declares).

    Class attributes (beyond :class:`~miles.models.base.ModelFamily`'s):
        max_sequence_length: text tokens ``encode_prompt`` pads or cuts a prompt to, the stock call's default: 512
            (``FluxPipeline``, ``QwenImagePipeline``, ``Flux2KleinPipeline``, ``WanPipeline``; SD3's T5 takes 256).
        stock_guidance: the stock call's guidance scale (:meth:`stock_guidance_scale`); None: no stock scale.
        timestep_divisor: the transformer takes miles' timestep (σ · 1000) divided by it: 1000 where it takes σ
            (Qwen-Image, FLUX.1, FLUX.2), 1 where it takes σ · 1000 (SD3, Wan).
        block_attributes: the denoiser's attributes that hold its blocks, in forward order.
        compatible_keys: ``{transformer config key: what it is}`` a teacher and a critic must share with the
            student (they take its latents and its prompt encodings).
        latent_shape_compatible: whether the teacher and the critic must also share the student's latent shape
            (False where the sample size is the student's to choose).
        video: whether pixels are clips ``(F, H, W, C)`` rather than images ``(H, W, C)``.
        single_frame_vae: an image family over a video VAE (Qwen-Image's 3-D VAE): pixels enter it as one frame.
    """

    # the --save-hf export writes the stock scheduler of the student's grid (ModelFamily.stock_scheduler)
    stock_scheduler = True
    max_sequence_length: ClassVar[int] = 512
    stock_guidance: ClassVar[float | None] = None
    timestep_divisor: ClassVar[float] = 1.0
    block_attributes: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    compatible_keys: ClassVar[dict[str, str]] = {}
    latent_shape_compatible: ClassVar[bool] = False
    video: ClassVar[bool] = False
    single_frame_vae: ClassVar[bool] = False

    # -- the pipeline's files and parts ------------------------------------------------------------------------

    def transformer_config(self, path: str | Path) -> dict:
        """``<path>/transformer/config.json``."""
        return read_json(Path(path) / DENOISER / "config.json", "transformer config")

    def pipeline_class(self, path: str | Path) -> str:
        """The diffusers pipeline class that opens ``path``: the one ``model_index.json`` names when this family reads
        it, else the family's first ``pipeline_classes``."""
        name = pipeline_class_name(path)
        return name if name in self.pipeline_classes else self.pipeline_classes[0]

    def load_denoiser(self, path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
        """``<path>/transformer`` as the class its config names (:meth:`denoiser_class`), in eval mode on the CPU.

        Raises:
            FileNotFoundError: if ``<path>/transformer/config.json`` is missing.
        """
        cls = self.denoiser_class(path)
        return cls.from_pretrained(Path(path) / DENOISER, torch_dtype=dtype).eval()

    def load_text_encoder(
        self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> PipelinePromptEncoder:
        return PipelinePromptEncoder(self, path, device, dtype)

    # -- prompts -----------------------------------------------------------------------------------------------

    def encode_prompts(self, encoder: Any, prompts: list[str]) -> dict[str, Tensor]:
        """The cond kwargs of :meth:`prompt_cond`, float32 on the CPU, one row per prompt.

        Raises:
            ValueError: on an empty prompt list.
        """
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        with torch.no_grad():
            cond = self.prompt_cond(encoder, list(prompts))
        return {key: value.detach().to("cpu", torch.float32) for key, value in cond.items()}

    @abstractmethod
    def prompt_cond(self, encoder: Any, prompts: list[str]) -> dict[str, Tensor]:
        """``prompts`` encoded by ``encoder`` (what :meth:`load_text_encoder` returned: a
        :class:`PipelinePromptEncoder`, whose ``pipe.encode_prompt`` runs on ``device``) as the denoiser's cond
        kwargs ``{name: (B, ...)}``, any float dtype and device (:meth:`encode_prompts` makes them float32 on the
        CPU)."""

    def text_tokens(self, path: str | Path) -> int:
        """Text tokens per prompt in the cond: :attr:`max_sequence_length`."""
        return self.max_sequence_length

    # -- stock settings ----------------------------------------------------------------------------------------

    def stock_guidance_scale(self, path: str | Path) -> float | None:
        """:attr:`stock_guidance`, cut to :meth:`max_guidance_scale` where the pipeline has a bound (a guidance- or
        step-distilled checkpoint that takes no guidance: 1)."""
        limit = self.max_guidance_scale(path)
        if self.stock_guidance is None or limit is None:
            return self.stock_guidance
        return min(self.stock_guidance, limit)

    def compatibility_signature(self, path: str | Path) -> dict[str, Any]:
        """The transformer config keys of :attr:`compatible_keys`, labelled ``"<what> (<key>)"``, after the latent
        shape where :attr:`latent_shape_compatible`."""
        config = self.transformer_config(path)
        signature = {f"{what} ({key})": config.get(key) for key, what in self.compatible_keys.items()}
        if self.latent_shape_compatible:
            signature = {**super().compatibility_signature(path), **signature}
        return signature

    # -- the forward -------------------------------------------------------------------------------------------

    def predict_velocity(
        self, denoiser: nn.Module, latents: Tensor, timestep: Tensor, cond: dict[str, Tensor]
    ) -> Tensor:
        """One denoiser forward (plain or FSDP-wrapped) as the stock pipeline runs it: the latents and the cond in
        :func:`~miles.models.precision.forward_device_dtype`, the timestep float32 over :attr:`timestep_divisor`,
        the inputs of :meth:`forward_inputs`; returns the velocity as float32 ``(B, *latent_shape)``."""
        device, dtype = forward_device_dtype(denoiser)  # latents and cond; the timestep stays float32
        timestep = timestep.to(device, torch.float32)
        if self.timestep_divisor != 1:
            timestep = timestep / self.timestep_divisor
        inputs = self.forward_inputs(denoiser, latents.to(device, dtype), timestep, cond)
        out = denoiser(**inputs, return_dict=False)[0]
        return self.velocity_from_output(out.float(), tuple(latents.shape))

    def forward_inputs(
        self, denoiser: nn.Module, latents: Tensor, timestep: Tensor, cond: dict[str, Tensor]
    ) -> dict[str, Any]:
        """The denoiser's forward kwargs from the latents (already in the compute device and dtype) and the
        transformer's timestep. Default (SD3, Wan): the latents as ``hidden_states``, every cond kwarg cast to the
        latents' device and dtype."""
        kwargs = {key: value.to(latents.device, latents.dtype) for key, value in cond.items()}
        return {"hidden_states": latents, "timestep": timestep, **kwargs}

    def velocity_from_output(self, out: Tensor, latent_shape: tuple[int, ...]) -> Tensor:
        """The float32 forward output as latents ``latent_shape`` (``(B, *latent_shape)``): unpacked where the
        family packs its tokens. Default: as it is."""
        return out

    def blocks(self, denoiser: nn.Module) -> list[nn.Module]:
        """The blocks of :attr:`block_attributes` (diffusers' ``_no_split_modules``), in forward order."""
        return [block for name in self.block_attributes for block in getattr(denoiser, name)]

    # -- TokenFeatures (the GAN head's tap), for the families that declare it ----------------------------------

    def image_tokens(self, block_output: Any) -> Tensor:
        """The image tokens ``(B, N, D)`` of a block's output: the second of a joint block's ``(text, image)``; the
        output itself of a block that returns the image (video) tokens only."""
        return block_output[1] if isinstance(block_output, tuple) else block_output

    def latent_patch(self, config: dict) -> tuple[int, ...]:
        """Latent pixels per token along the latent's trailing axes, from the transformer config: its
        ``patch_size``, an int for ``(H, W)`` or a tuple for ``(F, H, W)``."""
        patch = config.get("patch_size", 1)
        return tuple(int(p) for p in patch) if isinstance(patch, (list, tuple)) else (int(patch),) * 2

    def token_grid(self, denoiser: nn.Module, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens' grid, row-major: the latent's trailing sizes over :meth:`latent_patch`."""
        patch = self.latent_patch(dict(denoiser.config))
        return tuple(size // p for size, p in zip(latent_shape[-len(patch) :], patch))

    def token_width(self, denoiser: nn.Module) -> int:
        """``num_attention_heads · attention_head_dim``, the blocks' token width."""
        return int(denoiser.config.num_attention_heads) * int(denoiser.config.attention_head_dim)

    # -- MemoryLayout ------------------------------------------------------------------------------------------

    def tokens_per_sample(self, path: str | Path) -> tuple[int, int]:
        """``(image tokens, text tokens)``: the token grid of :meth:`latent_patch` over the latent shape, and
        :meth:`text_tokens`."""
        latent = self.latent_shape(path)
        patch = self.latent_patch(self.transformer_config(path))
        image = math.prod(size // p for size, p in zip(latent[-len(patch) :], patch))
        return image, self.text_tokens(path)

    @abstractmethod
    def activation_layout(self, config: dict) -> ActivationLayout:
        """The activation elements per token of each block (see :class:`~miles.models.capabilities.MemoryLayout`)."""

    @abstractmethod
    def meta_cond(self, config: dict, text_tokens: int) -> dict[str, Tensor]:
        """The cond kwargs of one sample of ``text_tokens`` tokens, shaped as :meth:`encode_prompts` returns them
        (batch 1), on the meta device where :meth:`predict_velocity` reads no value of them (for the FLOP count)."""

    def flops_per_sample(self, path: str | Path) -> tuple[float, int]:
        """One forward of one sample counted on the meta device (:func:`~miles.models.memory.count_forward_flops`)
        from ``transformer/config.json`` at the latent shape and :meth:`text_tokens`; no weight is read."""
        config = self.transformer_config(path)
        cond = self.meta_cond(config, self.text_tokens(path))
        return count_forward_flops(self, config, self.latent_shape(path), cond)

    # -- the VAE (PixelCodec, DifferentiablePixels), for the families that declare them ------------------------

    _vae: nn.Module | None = None

    @property
    def vae(self) -> nn.Module:
        """The pipeline's VAE, the diffusers class ``vae/config.json`` names (what ``save_pretrained`` writes), float32,
        eval and frozen (a reward's gradient reaches the latents, not the VAE), on the CPU; loaded on first use.

        Raises:
            FileNotFoundError: if ``<pipeline>/vae/config.json`` is missing.
            ValueError: if diffusers has no class of the name it gives.
        """
        if self._vae is None:
            import diffusers

            folder = self.pipeline_path / "vae"
            name = str(read_json(folder / "config.json", "VAE config").get("_class_name"))
            cls = getattr(diffusers, name, None)
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise ValueError(f"{folder}/config.json names _class_name {name!r}, which is not a diffusers model")
            self._vae = cls.from_pretrained(folder, torch_dtype=torch.float32).eval().requires_grad_(False)
        return self._vae

    def latent_scale_shift(self) -> tuple[Tensor | float, Tensor | float]:
        """``(scale, shift)`` of the VAE config, as the stock pipelines read them: ``(scaling_factor, shift_factor)``
        (SD3, FLUX.1), or per channel ``(1 / latents_std, latents_mean)`` as float32 ``(C,)`` (Qwen-Image, Wan)."""
        config = self.vae.config
        if getattr(config, "latents_mean", None) is not None:
            return 1.0 / torch.tensor(config.latents_std), torch.tensor(config.latents_mean)
        return float(config.scaling_factor), float(config.shift_factor or 0.0)

    def normalize_latents(self, raw: Tensor) -> Tensor:
        """The VAE's latents ``(B, C, ...)`` → miles' latents: ``(raw − shift) · scale`` (:meth:`latent_scale_shift`)."""
        scale, shift = (_per_channel(value, raw) for value in self.latent_scale_shift())
        return (raw - shift) * scale

    def denormalize_latents(self, latents: Tensor) -> Tensor:
        """miles' latents → the VAE's: ``latents / scale + shift``, the inverse of :meth:`normalize_latents`."""
        scale, shift = (_per_channel(value, latents) for value in self.latent_scale_shift())
        return latents / scale + shift

    @torch.no_grad()
    def images_to_latents(self, images: Tensor) -> Tensor:
        """uint8 (or float 0..255) pixels ``(B, H, W, C)`` (video: ``(B, F, H, W, C)``) → float32 latents
        ``(B, *latent_shape)``: the VAE posterior's mode, normalised.

        Raises:
            ValueError: for pixels of another rank.
        """
        images = torch.as_tensor(images)
        expected = "(B, F, H, W, C)" if self.video else "(B, H, W, C)"
        if images.ndim != (5 if self.video else 4):
            raise ValueError(f"{self.name} pixels must be {expected}, got shape {tuple(images.shape)}")
        pixels = uint8_to_pixels(images)
        if self.single_frame_vae:
            raw = self.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()[:, :, 0]
        else:
            raw = self.vae.encode(pixels).latent_dist.mode()
        return self.normalize_latents(raw).float()

    def _decode(self, latents: Tensor) -> Tensor:
        """float latents → decoded pixels ``(B, C, ...)`` in about [-1, 1], by the VAE wherever it is."""
        vae_latents = self.denormalize_latents(latents)
        if self.single_frame_vae:
            return self.vae.decode(vae_latents.unsqueeze(2), return_dict=False)[0][:, :, 0]
        return self.vae.decode(vae_latents, return_dict=False)[0]

    @torch.no_grad()
    def latents_to_images(self, latents: Tensor) -> Tensor:
        """float latents ``(B, *latent_shape)`` → uint8 pixels ``(B, H, W, C)`` (video: ``(B, F, H, W, C)``) on the
        CPU, decoded on the latents' device (:func:`~miles.models.capabilities.module_on`) and rounded by
        :func:`pixels_to_uint8`."""
        with module_on(self.vae, latents.device):  # decoded where the latents are (the worker's GPU)
            pixels = self._decode(latents.detach().float())
        return pixels_to_uint8(pixels)

    def latents_to_pixels(self, latents: Tensor) -> Tensor:
        """float latents → float32 pixels ``(B, C, ...)``, ``(decode + 1) / 2``, unclipped, with autograd through the
        frozen float32 VAE decoder, which moves to the latents' device (and stays there)."""
        self.vae.to(latents.device)
        return (self._decode(latents.float()).float() + 1.0) / 2.0


def _per_channel(value: Tensor | float, like: Tensor) -> Tensor | float:
    """A per-channel ``(C,)`` statistic shaped to broadcast over ``like`` ``(B, C, ...)`` on its device; a scalar as
    it is."""
    if not isinstance(value, Tensor):
        return value
    return value.to(like.device).view(1, -1, *([1] * (like.ndim - 2)))
