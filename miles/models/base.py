"""What every model family gives the engine and the trainers: the ``ModelFamily`` protocol.

A family wraps one kind of diffusers pipeline directory (``sd3``, ``digits``): it loads the denoiser (or builds it
on the meta device and names its weight files, for the trainers' sharded start-up) and the text encoder, turns
prompts into the denoiser's cond kwargs, runs one forward, names the blocks FSDP shards one by one and says which
config figures a teacher or critic must share with the student. What a family can do beyond that
is declared by subclassing the capability protocols of :mod:`miles.models.capabilities` (its guidance form, a
pixel codec, a feature tap for the DMD2 GAN head, a memory layout for the planner). A family over a stock diffusers
pipeline subclasses :class:`~miles.models.diffusers_family.DiffusersFamily`, which implements all of this once, and
declares only what differs; any family registers itself (:mod:`miles.models.registry`) or is named by its dotted
path. Nothing else in miles knows which denoiser class or cond keys a family uses.

Latents have any rank: one sample is ``(C, H, W)`` for an image family and ``(C, F, H, W)`` for a video family
(F frames); a batch adds a leading B. The engine, the trainers and the hooks only ever use the leading batch dim.

Velocity convention (diffusers SD3, torchtitan Flux): ``x_σ = (1 − σ)·x0 + σ·ε``; the denoiser's output is the
velocity ``v = ε − x0`` at ``timestep = σ · num_train_timesteps`` (σ ∈ [0, 1], timestep ∈ [0, 1000]).
"""

from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from miles.models.pipeline_files import (
    DENOISER,
    SECOND_EXPERT,
    denoiser_weight_index,
    is_component,
    read_json,
    read_model_index,
    read_scheduler_config,
)

__all__ = [
    "DENOISER",
    "ModelFamily",
    "SECOND_EXPERT",
    "denoiser_weight_index",
    "PromptEncoder",
    "TEXT_ENCODER_COMPONENTS",
    "encode_one_prompt",
    "place_text_encoders",
    "read_json",
    "read_scheduler_config",
    "text_encoder_modules",
]

# A diffusers pipeline's text encoders, by component name (SD3 holds three, FLUX.1 two, the others one).
TEXT_ENCODER_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3")


class PromptEncoder(Protocol):
    """A loaded text encoder: what a family's ``load_text_encoder`` returns and its ``encode_prompts`` reads (a stock
    pipeline's text half, :class:`~miles.models.diffusers_family.PipelinePromptEncoder`; digits' MiniLM; any object
    of a family of your own). It encodes deterministically (eval mode, no dropout).

    An encoder whose models sit on a training device lists them as ``text_modules`` (``list[nn.Module]``): they sleep
    with the trainer group that encodes (:func:`text_encoder_modules`). An encoder without it holds nothing to move.
    """

    text_modules: list[nn.Module]


@runtime_checkable
class ModelFamily(Protocol):
    """One kind of pipeline directory. One instance per pipeline (``pipeline_path``).

    A family class subclasses this protocol explicitly, plus exactly one guidance form
    (:class:`~miles.models.capabilities.TrueCFG` or :class:`~miles.models.capabilities.EmbeddedGuidance`) and
    the optional capabilities it implements; the methods marked abstract below must be implemented (an instance of
    a class that misses one cannot be built). Methods that take a ``path`` may be given another pipeline of the
    same family (the teacher, the critic); instance state (a VAE) belongs to the instance's own pipeline.

    Class attributes:
        name: the registered name (``--diffusion-model-family NAME``), a Python identifier.
        pipeline_classes: the ``model_index.json`` ``_class_name`` values this family reads (e.g.
            ``("StableDiffusion3Pipeline",)``): a pipeline directory finds its family by them.
        stock_scheduler: whether the ``--save-hf`` export replaces the scheduler with the stock diffusers scheduler
            of the student's step rule and grid (:func:`miles.models.sampling_schedule.write_sampling_schedule`),
            so that the family's stock diffusers pipeline samples the student as miles does. False where the
            export keeps its scheduler and records the student's schedule in ``_miles_*`` keys only.
        stock_negative_prompt: the negative prompt the family's stock pipeline runs CFG against when the caller
            gives none, ``--negative-prompt``'s default: ``""`` (``StableDiffusion3Pipeline``, ``WanPipeline``:
            ``negative_prompt or ""``; ``Flux2KleinPipeline``'s hard-coded ``""``); Qwen-Image's model card ``" "``.
    """

    name: ClassVar[str]
    pipeline_classes: ClassVar[tuple[str, ...]]
    stock_scheduler: ClassVar[bool] = False
    stock_negative_prompt: ClassVar[str] = ""
    pipeline_path: Path

    def __init__(self, pipeline_path: str | Path) -> None:
        self.pipeline_path = Path(pipeline_path)

    @abstractmethod
    def load_denoiser(self, path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The pipeline's denoiser (``<path>/transformer``) in eval mode on the CPU, in ``dtype``."""

    def denoiser_class(self, path: str | Path, component: str = DENOISER) -> type[nn.Module]:
        """The diffusers model class of ``<path>/<component>`` (default ``transformer``): the ``_class_name`` its
        ``config.json`` names (what ``save_pretrained`` writes). Override for a denoiser class diffusers does not
        export.

        Raises:
            FileNotFoundError: if ``<path>/transformer/config.json`` is missing.
            ValueError: if diffusers has no class of that name.
        """
        import diffusers

        config = read_json(Path(path) / component / "config.json", f"{component} config")
        name = config.get("_class_name")
        cls = getattr(diffusers, str(name), None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(
                f"{path}/{component}/config.json names _class_name {name!r}, which is not a diffusers model class"
            )
        return cls

    def denoiser_weight_files(self, path: str | Path, component: str = DENOISER) -> list[Path]:
        """The safetensors files that hold the weights of ``<path>/<component>`` (default ``transformer``), as ``save_pretrained`` writes
        them: ``diffusion_pytorch_model.safetensors``, or the shards listed in the ``weight_map`` of
        ``diffusion_pytorch_model.safetensors.index.json`` (a sharded checkpoint), each file once, in order.

        Raises:
            FileNotFoundError: if the folder holds neither (e.g. only ``.bin`` weights), or a listed shard is missing.
            ValueError: if the index file is not valid JSON or has no ``weight_map``.
        """
        from diffusers.utils.constants import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME

        folder = Path(path) / component
        index = folder / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            weight_map = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"safetensors index {index} has no weight_map; is the file truncated?")
            files = [folder / name for name in dict.fromkeys(weight_map.values())]
            missing = [str(file) for file in files if not file.is_file()]
            if missing:
                raise FileNotFoundError(f"{index} lists weight files that are missing: {missing}")
            return files
        single = folder / SAFETENSORS_WEIGHTS_NAME
        if single.is_file():
            return [single]
        raise FileNotFoundError(
            f"no {SAFETENSORS_WEIGHTS_NAME} (or its .index.json) under {folder}: miles loads a denoiser from "
            "safetensors; save it with save_pretrained(..., safe_serialization=True)"
        )

    def build_meta_denoiser(
        self, path: str | Path, dtype: torch.dtype = torch.float32, component: str = DENOISER
    ) -> nn.Module:
        """The denoiser of ``<path>/<component>`` (default ``transformer``; a second expert's ``transformer_2``)
        built from its config without its weights: every parameter on the
        meta device, buffers computed at construction real (on the CPU), in eval mode. It is what
        :meth:`load_denoiser` returns before the weights are read, so loading its files into it gives
        ``load_denoiser(path, dtype)`` exactly:

        - built as diffusers' ``ModelMixin.from_pretrained`` builds (default dtype ``dtype``, ``torch.nn.init``
          skipped, parameters created on the meta device by accelerate's ``init_empty_weights``), so it draws from
          the global RNG exactly as ``from_pretrained`` does and later draws (a LoRA adapter, a GAN head) match;
        - each floating parameter or buffer the weight files hold gets the dtype ``from_pretrained`` gives it:
          float32 inside the class's ``_keep_in_fp32_modules``, ``dtype`` elsewhere.

        :mod:`miles.backends.fsdp_utils.model` shards it before any weight is read, so no process ever holds the
        whole model it does not keep.

        Raises:
            FileNotFoundError, ValueError: as :meth:`denoiser_class` and :meth:`denoiser_weight_files`.
        """
        import accelerate
        from diffusers.models.modeling_utils import no_init_weights

        cls = self.denoiser_class(path, component)
        folder = Path(path) / component
        in_files = set(denoiser_weight_index(self.denoiser_weight_files(path, component)))
        config = cls.load_config(folder)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with no_init_weights(), accelerate.init_empty_weights():
                model = cls.from_config(config)
        finally:
            torch.set_default_dtype(default_dtype)
        keep_fp32 = list(getattr(cls, "_keep_in_fp32_modules", None) or [])
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name not in in_files or not tensor.is_floating_point():
                continue
            # diffusers' load_model_dict_into_meta: a module name among the key's parts keeps the tensor in float32
            target = torch.float32 if any(part in name.split(".") for part in keep_fp32) else dtype
            if tensor.dtype != target:
                module_name, _, local = name.rpartition(".")
                module = model.get_submodule(module_name)
                if local in module._parameters:
                    tensor.data = tensor.data.to(target)
                else:
                    module._buffers[local] = tensor.to(target)
        model.register_to_config(_name_or_path=str(folder))
        return model.eval()

    @abstractmethod
    def load_text_encoder(
        self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> Any:
        """The pipeline's text encoder(s) in eval mode on ``device``, their weights in ``dtype`` (a trainer loads them
        in its compute dtype, ``--train-dtype``): whatever :meth:`encode_prompts` takes."""

    def text_encoder_dirs(self, path: str | Path) -> list[Path]:
        """The folders of the weights :meth:`load_text_encoder` loads (the memory planner counts their safetensors).
        Default: the pipeline's components of :data:`TEXT_ENCODER_COMPONENTS` that ``model_index.json`` lists."""
        index = read_model_index(path)
        return [Path(path) / name for name in TEXT_ENCODER_COMPONENTS if is_component(index.get(name))]

    @abstractmethod
    def encode_prompts(self, encoder: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batched cond kwargs of the denoiser's forward (float32, on the CPU), one row per prompt; the same prompt
        gives the same row whatever the batch."""

    @abstractmethod
    def latent_shape(self, path: str | Path) -> tuple[int, ...]:
        """One sample's latent shape: ``(C, H, W)`` for an image family, ``(C, F, H, W)`` for a video family."""

    @abstractmethod
    def predict_velocity(
        self, denoiser: nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One denoiser forward: ``latents`` ``(B, *latent_shape)`` at ``timestep`` float ``(B,)`` in [0, 1000] →
        the velocity ``v`` as float32 ``(B, *latent_shape)``. The latents and the conditioning are cast to
        :func:`miles.models.precision.forward_device_dtype` (the compute dtype, whether FSDP, autocast or the stored
        weights give it); the timestep stays float32, as diffusers' pipelines pass it."""

    @abstractmethod
    def blocks(self, denoiser: nn.Module) -> list[nn.Module]:
        """The blocks FSDP shards one by one before the root (diffusers' ``_no_split_modules``), in forward order."""

    def unused_parameters(self, denoiser: nn.Module) -> list[str]:
        """Names of the denoiser's parameters its forward never reaches (a last joint block's text-output layers
        whose result the model drops). A trainable denoiser freezes them: they would get no gradient, so the
        optimizer would hold no state for them and a resume could not load one. Default: none."""
        return []

    def flow_shift(self, path: str | Path, num_steps: int | None = None) -> float | None:
        """The flow shift k the family's stock pipeline samples pipeline ``path`` with, at its resolution: a static
        scheduler's ``shift``, or ``e^mu`` where the pipeline computes a dynamic shift ``mu`` from the image token
        count (the exponential time shift with ``mu`` is the static shift ``e^mu``, docs/families.md). miles uses it
        for ``--diffusion-flow-shift`` (``num_steps`` = ``--diffusion-num-steps``, for a pipeline whose ``mu`` also
        depends on the step count) and ``--fsdp-flow-shift`` (``num_steps`` None) when they are not given. Default
        None: no family default (the flags then default to 3.0).

        Raises:
            OSError / ValueError: when a config file the shift comes from is missing or unreadable.
        """
        return None

    def sample_size_rule(self, path: str | Path) -> tuple[tuple[str, int, int], ...] | None:
        """What ``_miles_sample_size`` of pipeline ``path`` may hold (:mod:`miles.models.stock_defaults`): one
        ``(name, multiple, remainder)`` per value, in order (``("height", 16, 0)``: a positive multiple of 16;
        ``("frames", 4, 1)``: ``4k + 1``), which ``prepare`` checks before it writes the key. Default None: the family
        does not read the key (its size is the transformer config's).

        Raises:
            OSError / ValueError: when a config file the rule comes from is missing or unreadable.
        """
        return None

    def max_guidance_scale(self, path: str | Path) -> float | None:
        """The largest guidance scale w (as ``--dmd2-teacher-guidance-scale`` means it) pipeline ``path`` can take;
        1 for a checkpoint that runs no guidance (a step-distilled FLUX.2-klein). Preflight rejects a larger scale
        with exit 2. Default None: no limit."""
        return None

    def stock_guidance_scale(self, path: str | Path) -> float | None:
        """The guidance scale w (as ``--dmd2-teacher-guidance-scale`` means it) the family's stock pipeline samples
        pipeline ``path`` with when the call gives none: the default of ``--dmd2-teacher-guidance-scale`` for a
        teacher at ``path``; 1 for a checkpoint that runs no guidance. Default None: no stock scale (the flag then
        defaults to 1, no guidance).

        Raises:
            OSError / ValueError: when a config file the answer depends on is missing or unreadable.
        """
        return None

    def stock_scheduler_config(self, schedule: dict[str, Any]) -> dict[str, Any] | None:
        """The scheduler config a ``--save-hf`` export writes (families with ``stock_scheduler``) so that the
        family's stock diffusers pipeline samples the student's schedule; None where no stock config can (the
        export then keeps its scheduler, records the schedule in ``_miles_*`` keys and warns).

        Args:
            schedule: ``{"num_steps", "shift", "step_rule", "num_train_timesteps", "timesteps"}``, the keywords of
                :func:`miles.models.stock_schedulers.stock_scheduler_config`.

        Default: that function's config, which ``StableDiffusion3Pipeline`` (it calls ``set_timesteps(S, mu=...)``)
        samples on the student's grid.

        Raises:
            ValueError: on an unknown step rule or a grid miles' sampler rejects.
        """
        from miles.models.stock_schedulers import stock_scheduler_config

        return stock_scheduler_config(**schedule)

    def stock_sampling_kwargs(self, path: str | Path, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call keywords of the family's stock pipeline that sample the exported student at ``path``, from miles'
        generic ones: ``{"num_inference_steps": S}`` or ``{"sigmas": [σ, ...]}``, and ``"guidance_scale": w`` (the
        student's own guidance, 1 for DMD2).

        Default: these names (``StableDiffusion3Pipeline``'s) plus the size the student was trained at, from the
        family's :meth:`~miles.models.capabilities.PixelCodec.image_shape` where it has one: ``height`` and
        ``width`` in pixels, and ``num_frames`` for a video shape ``(F, H, W, C)``. A stock pipeline's own default
        size (1024² for FLUX.2-klein, 81 × 480 × 832 for Wan) is not the size an export was trained at.
        """
        from miles.models.capabilities import PixelCodec, supports

        if not supports(self, PixelCodec):
            return dict(kwargs)
        shape = tuple(self.image_shape(path))
        size = {"height": int(shape[-3]), "width": int(shape[-2])}
        if len(shape) == 4:
            size = {"num_frames": int(shape[0]), **size}
        return {**kwargs, **size}

    def expert_boundary(self, path: str | Path) -> float | None:
        """The timestep (in [0, 1000]) at which pipeline ``path`` hands the denoising from its first expert
        (``transformer``, timesteps at or above it) to its second (``transformer_2``, below it), or None for a
        pipeline of one denoiser. Default: None. A two-expert family (Wan 2.2 A14B) returns its stock pipeline's
        boundary; the frozen teacher then scores each σ with its expert (:class:`miles.models.experts.ExpertSwitch`).

        Raises:
            OSError / ValueError: when a config file the answer depends on is missing or unreadable.
        """
        return None

    def write_one_denoiser_index(self, folder: Path) -> None:
        """Make the exported pipeline at ``folder`` one whose stock pipeline samples with its ``transformer`` alone:
        a one-network student exported from a two-expert pipeline drops the second expert. Default: nothing (one
        denoiser already). Called by the ``--save-hf`` export after it copied the source (whose files may be hard
        links to the source's: replace a file, never write into it)."""

    def compatibility_signature(self, path: str | Path) -> dict[str, Any]:
        """The figures of pipeline ``path`` that a teacher's and a critic's pipeline must share with the student's,
        as ``{label: value}`` (the label names the figure in preflight's error, e.g. ``"latent channels
        (in_channels)"``): they take the student's latents and its prompt encodings. Default: the latent shape.

        Raises:
            OSError / ValueError: when a config file the figures come from is missing or unreadable.
        """
        return {"latent shape": tuple(self.latent_shape(path))}


def place_text_encoders(pipe: Any, device: str | torch.device) -> list[nn.Module]:
    """Move the text encoders a diffusers pipeline object holds (:data:`TEXT_ENCODER_COMPONENTS`) to ``device`` in
    eval mode; returns them in order (a prompt encoder's ``text_modules``)."""
    modules = [getattr(pipe, name, None) for name in TEXT_ENCODER_COMPONENTS]
    return [module.to(device).eval() for module in modules if module is not None]


def text_encoder_modules(encoder: Any) -> list[nn.Module]:
    """The torch modules a loaded prompt encoder holds on its device (its ``text_modules``; none if it lists none)."""
    return list(getattr(encoder, "text_modules", ()))


def encode_one_prompt(family: ModelFamily, encoder: PromptEncoder, prompt: str) -> dict[str, torch.Tensor]:
    """One prompt's cond kwargs without a batch dim (the negative prompt of CFG, usually ``""``), float32 on CPU."""
    # clone: a view would carry (and pickle) the whole batch storage
    return {key: value[0].clone() for key, value in family.encode_prompts(encoder, [prompt]).items()}
