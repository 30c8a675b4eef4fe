"""What every model family gives the engine and the trainers: the ``ModelFamily`` protocol.

A family wraps one kind of diffusers pipeline directory (``sd3``, ``digits``): it loads the denoiser and the text
encoder, turns prompts into the denoiser's cond kwargs, runs one forward, names the blocks FSDP shards one by one
and says which config figures a teacher or critic must share with the student. What a family can do beyond that
is declared by subclassing the capability protocols of :mod:`miles.models.capabilities` (its guidance form, a
pixel codec, a feature tap for the DMD2 GAN head). A new family (FLUX, Wan, ...) subclasses these protocols and
registers itself (:mod:`miles.models.registry`); nothing else in miles knows which denoiser class or cond keys a
family uses.

Latents have any rank: one sample is ``(C, H, W)`` for an image family and ``(C, F, H, W)`` for a video family
(F frames); a batch adds a leading B. The engine, the trainers and the hooks only ever use the leading batch dim.

Velocity convention (diffusers SD3, torchtitan Flux): ``x_σ = (1 − σ)·x0 + σ·ε``; the denoiser's output is the
velocity ``v = ε − x0`` at ``timestep = σ · num_train_timesteps`` (σ ∈ [0, 1], timestep ∈ [0, 1000]).
"""

import json
from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "DENOISER",
    "ModelFamily",
    "PromptEncoder",
    "encode_one_prompt",
    "read_json",
    "read_scheduler_config",
]

# The denoiser's component name: its folder in a diffusers pipeline directory, its key among a trainer group's
# trainable modules (TrainContext.models, PreparedBatch.component, checkpoints) and among the frozen teacher's.
DENOISER = "transformer"


class PromptEncoder(Protocol):
    """A loaded text encoder. ``encode`` is deterministic (eval mode, no dropout)."""

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(hidden, pooled)``: float32 ``(B, L, D)`` token states and float32 ``(B, P)`` pooled states."""
        ...


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
    """

    name: ClassVar[str]
    pipeline_classes: ClassVar[tuple[str, ...]]
    stock_scheduler: ClassVar[bool] = False
    pipeline_path: Path

    def __init__(self, pipeline_path: str | Path) -> None:
        self.pipeline_path = Path(pipeline_path)

    @abstractmethod
    def load_denoiser(self, path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The pipeline's denoiser (``<path>/transformer``) in eval mode on the CPU, in ``dtype``."""

    @abstractmethod
    def load_text_encoder(self, path: str | Path, device: str | torch.device = "cpu") -> Any:
        """The pipeline's text encoder(s) in eval mode: whatever :meth:`encode_prompts` takes."""

    @abstractmethod
    def encode_prompts(self, encoder: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batched cond kwargs of the denoiser's forward (float32, on the CPU), one row per prompt; the same prompt
        gives the same row whatever the batch."""

    @abstractmethod
    def latent_shape(self, path: str | Path) -> tuple[int, ...]:
        """One sample's latent shape: ``(C, H, W)`` for an image family, ``(C, F, H, W)`` for a video family."""

    def text_tokens(self, path: str | Path) -> int:
        """Text tokens per prompt in the denoiser's cond (the memory planner's sequence length).

        Raises:
            NotImplementedError: for a family that does not say; ``--dry-run`` then skips its memory plan with one
                warning.
        """
        raise NotImplementedError(f"the {self.name} family does not say how many text tokens a prompt takes")

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

    def max_guidance_scale(self, path: str | Path) -> float | None:
        """The largest guidance scale w (as ``--dmd2-teacher-guidance-scale`` means it) pipeline ``path`` can take;
        1 for a checkpoint that runs no guidance (a step-distilled FLUX.2-klein). Preflight rejects a larger scale
        with exit 2. Default None: no limit."""
        return None

    def stock_scheduler_config(self, schedule: dict[str, Any]) -> dict[str, Any] | None:
        """The scheduler config a ``--save-hf`` export writes (families with ``stock_scheduler``) so that the
        family's stock diffusers pipeline samples the student's schedule; None where no stock config can (the
        export then keeps its scheduler, records the schedule in ``_miles_*`` keys and warns).

        Args:
            schedule: ``{"num_steps", "shift", "step_rule", "num_train_timesteps", "timesteps"}``, the keywords of
                :func:`miles.models.sampling_schedule.stock_scheduler_config`.

        Default: that function's config, which ``StableDiffusion3Pipeline`` (it calls ``set_timesteps(S, mu=...)``)
        samples on the student's grid.

        Raises:
            ValueError: on an unknown step rule or a grid miles' sampler rejects.
        """
        from miles.models.sampling_schedule import stock_scheduler_config

        return stock_scheduler_config(**schedule)

    def stock_sampling_kwargs(self, path: str | Path, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call keywords of the family's stock pipeline that sample the exported student at ``path``, from miles'
        generic ones: ``{"num_inference_steps": S}`` or ``{"sigmas": [σ, ...]}``, and ``"guidance_scale": w`` (the
        student's own guidance, 1 for DMD2). Default: unchanged (``StableDiffusion3Pipeline`` takes these names)."""
        return dict(kwargs)

    def compatibility_signature(self, path: str | Path) -> dict[str, Any]:
        """The figures of pipeline ``path`` that a teacher's and a critic's pipeline must share with the student's,
        as ``{label: value}`` (the label names the figure in preflight's error, e.g. ``"latent channels
        (in_channels)"``): they take the student's latents and its prompt encodings. Default: the latent shape.

        Raises:
            OSError / ValueError: when a config file the figures come from is missing or unreadable.
        """
        return {"latent shape": tuple(self.latent_shape(path))}


def encode_one_prompt(family: ModelFamily, encoder: PromptEncoder, prompt: str) -> dict[str, torch.Tensor]:
    """One prompt's cond kwargs without a batch dim (the negative prompt of CFG, usually ``""``), float32 on CPU."""
    # clone: a view would carry (and pickle) the whole batch storage
    return {key: value[0].clone() for key, value in family.encode_prompts(encoder, [prompt]).items()}


def read_json(path: str | Path, what: str) -> dict:
    """Read a JSON file of a pipeline directory; the error names the file and what it should hold.

    Raises:
        FileNotFoundError: if the file is missing.
        ValueError: if it is not valid JSON.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path} (is the pipeline directory complete?)")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} {path} is not valid JSON ({exc}); is the file truncated?") from exc


def read_scheduler_config(path: str | Path) -> dict:
    """``{"shift": float, "num_train_timesteps": int}`` of ``<path>/scheduler/scheduler_config.json``; any
    flow-matching scheduler config of diffusers holds both."""
    config = read_json(Path(path) / "scheduler" / "scheduler_config.json", "scheduler config")
    return {
        "shift": float(config.get("shift", 1.0)),
        "num_train_timesteps": int(config.get("num_train_timesteps", 1000)),
    }
