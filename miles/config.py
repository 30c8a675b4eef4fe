"""One typed description of a run: frozen specs that the driver builds once from the parsed command line.

::

    RunSpec ── EngineSpec   the student's sampler: family, steps, shift, guidance, prompt cache, step strategy,
            │               converter, and the data it reads (DataSpec)
            └─ GroupSpec…   one per trainer group, in training order: role, model source (init / teacher), LoRA,
                            optimizer, LR schedule, EMA, checkpoint directories, steps per rollout, micro-batch,
                            dtype, seed, and its GroupHooks (the hook functions themselves)

The driver (:func:`miles.driver.specs.build_run_spec`) parses the command line once, imports every user hook path
once (a bad one is one line naming the flag and the path, before Ray starts) and the family class once, and asks the
method for its groups (``Method.groups``). Everything below the driver reads its spec: the trainer, the model set,
the optimizer, the EMA, the checkpoint, the rollout generator and the engine never read the namespace of flags. The
namespace travels only as :attr:`RunSpec.args`, for the hooks' documented signatures (``ctx.args``, the converter's
and the step strategy's first argument, the module builder's).

The specs pickle to the Ray workers: hooks and the family are functions and classes of importable modules, which
pickle by reference.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.models.lora import LoraSettings

__all__ = [
    "CheckpointSpec",
    "DataSpec",
    "EMASpec",
    "EngineSpec",
    "ExportSpec",
    "GroupHooks",
    "GroupSpec",
    "LoraSettings",
    "OptimizerSpec",
    "ProfileSpec",
    "RunSpec",
    "ScheduleSpec",
    "UserHooks",
    "hook_name",
]


def hook_name(fn: Any) -> str:
    """How messages and the dry run name a hook: ``module.qualname`` of a function or class (a ``partial``'s
    function), the ``repr`` of anything else."""
    fn = getattr(fn, "func", fn)  # functools.partial
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(fn)


@dataclass(frozen=True)
class GroupHooks:
    """A trainer group's hooks, the functions themselves (docs/customization.md has their signatures).

    Attributes:
        prepare: ``fn(ctx, train_pairs) -> PreparedBatch``, per micro-batch.
        loss: ``fn(ctx, train_pairs, prepared, *, new_pred, metrics) -> Tensor`` (the sum over the pairs).
        train_input: ``fn(ctx, train_pairs) -> train_pairs``, before micro-batching; None: none.
        train_output: ``fn(ctx, train_pairs) -> Any``, no grad, after the group's steps; None: none.
        build_modules: ``fn(args, models) -> {name: nn.Module}``, extra trainable modules; None: none.
        trainer: the ``GroupTrainer`` subclass that trains the group (``--custom-trainer-path``); None: miles'.
    """

    prepare: Callable | None = None
    loss: Callable | None = None
    train_input: Callable | None = None
    train_output: Callable | None = None
    build_modules: Callable | None = None
    trainer: type | None = None

    def over(self, defaults: "GroupHooks") -> "GroupHooks":
        """These hooks where set, ``defaults``' elsewhere: a method's defaults never replace a user's hook."""
        mine, theirs = self._hooks(), defaults._hooks()
        return GroupHooks(**{name: theirs[name] if hook is None else hook for name, hook in mine.items()})

    def _hooks(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def names(self) -> dict[str, str]:
        """``{field: hook name}`` of the hooks set (:func:`hook_name`), for the dry run."""
        return {name: hook_name(hook) for name, hook in self._hooks().items() if hook is not None}


@dataclass(frozen=True)
class UserHooks:
    """The hooks the command line names, imported once by the driver (``--custom-*-path`` and the method's own).

    Attributes:
        group: the trainer hooks (``--custom-prepare-train-batch-path`` ...); each group takes them where its method
            sets none of its own.
        converter: ``--custom-expand-samples-to-train-pairs-path``. step_strategy: ``--diffusion-step-strategy-path``.
        eval: ``--eval-function-path``.
        method: the method's own hook flags by dest (``Method.hook_flags``: DMD2's ``dmd2_reward_function_path``).
    """

    group: GroupHooks = field(default_factory=lambda: GroupHooks())
    converter: Callable | None = None
    step_strategy: Callable | None = None
    eval: Callable | None = None
    method: dict[str, Callable] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW and the gradient clip of one group.

    Attributes:
        lr: the learning rate (``--lr``; the critic's ``--critic-lr``).
        betas: ``(--adam-beta1, --adam-beta2)``. eps: ``--adam-eps``. weight_decay: decoupled (``--weight-decay``).
        clip_grad: the global grad-norm bound (``--clip-grad``; 0 measures only).
        max_skipped_steps: non-finite steps in a row before the run stops (``--max-skipped-steps``).
    """

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    max_skipped_steps: int = 3


@dataclass(frozen=True)
class ScheduleSpec:
    """The learning-rate schedule of one group, in optimizer steps.

    Attributes:
        total_steps: the run's optimizer steps of the group (``--num-rollout`` × its steps per rollout), the cosine
            horizon. decay_style: ``"constant"`` or ``"cosine"``. warmup_steps: linear warm-up. min_lr: the cosine
            floor.
    """

    total_steps: int
    decay_style: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0


@dataclass(frozen=True)
class EMASpec:
    """The EMA of a group's trainable parameters (diffusers' ``EMAModel`` warm-up).

    Attributes:
        decay: the target decay in (0, 1). min_decay: the warm-up's floor. update_after_step: copies until this
            optimizer step. for_eval: evaluation and export use the EMA weights (rollouts never do).
    """

    decay: float
    min_decay: float = 0.0
    update_after_step: int = 0
    for_eval: bool = True


@dataclass(frozen=True)
class CheckpointSpec:
    """Where a group resumes from and saves to (None: nowhere; the critic's are ``<dir>_critic`` siblings)."""

    load: str | None = None
    save: str | None = None


@dataclass(frozen=True)
class GroupSpec:
    """One trainer group: what it trains, what it only runs, how it updates, where it saves, and its hooks.

    Attributes:
        role: ``"actor"`` (the student; generates the rollouts and is exported) or another group's name.
        hooks: its :class:`GroupHooks`.
        init: the pipeline directory of its trainable denoiser (the model source); None for a frozen group, which
            trains nothing and holds no denoiser (DMD2's reward group: it runs its train-output hook only).
        teacher: the pipeline directory of its frozen teacher, or None.
        lora: its LoRA adapter, or None for full-weight training.
        optimizer, schedule: its AdamW and learning-rate schedule (None for a frozen group).
        ema: the EMA of its trainable parameters, or None.
        checkpoint: its load and save directories.
        steps_per_rollout: optimizer steps (windows) per rollout; 0 for a frozen group.
        micro_batch_size: train pairs per forward on one rank.
        train_output_before_step: run the train-output hook before this step instead of after the last, or None.
        dtype: the compute dtype's name (``"float32"``, ``"bfloat16"``). seed: seeds the global RNG before the
            models are built. reshard_every_microbatch: ZeRO-3-like resharding (``--fsdp-reshard-every-microbatch``).
        gradient_checkpointing: recompute each block in backward (``--gradient-checkpointing``).
        path_flags: how messages name its paths, ``{"init" | "teacher" | "load" | "save": label}``: the flag that
            set each (the critic's init is ``--critic-load``, or ``--teacher-load`` it defaults to); a path without
            an entry is named by its generic flag for the actor, ``"the <role> group's --<flag>"`` for another group.
    """

    role: str
    hooks: GroupHooks
    init: str | None
    teacher: str | None = None
    lora: LoraSettings | None = None
    optimizer: OptimizerSpec | None = None
    schedule: ScheduleSpec | None = None
    ema: EMASpec | None = None
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    steps_per_rollout: int = 1
    micro_batch_size: int = 1
    train_output_before_step: int | None = None
    dtype: str = "float32"
    seed: int = 1234
    reshard_every_microbatch: bool = False
    gradient_checkpointing: bool = False
    path_flags: dict[str, str] = field(default_factory=dict)

    # The generic flag of each path, as the actor's are set.
    PATH_FLAGS = {"init": "--hf-checkpoint", "teacher": "--teacher-load", "load": "--load", "save": "--save"}

    def paths(self) -> dict[str, str | None]:
        """Its paths by name: ``init``, ``teacher``, ``load``, ``save`` (None: none)."""
        return {"init": self.init, "teacher": self.teacher, "load": self.checkpoint.load, "save": self.checkpoint.save}

    def path_label(self, name: str) -> str:
        """How a message names its path ``name`` (``"--critic-load"``, ``"the critic group's --save"``)."""
        if name in self.path_flags:
            return self.path_flags[name]
        generic = self.PATH_FLAGS[name]
        return generic if self.role == "actor" else f"the {self.role} group's {generic}"

    @property
    def trains(self) -> bool:
        """Whether the group trains: a frozen group (no ``init``) takes no optimizer step and keeps no
        checkpoint."""
        return self.init is not None


@dataclass(frozen=True)
class DataSpec:
    """The prompts a run reads, and the JSONL keys of every data file.

    Attributes:
        prompt_data: the JSONL of prompts (``--prompt-data``). input_key, image_key, latent_key, cond_key: the keys of
            a record's prompt, image, stored latent and cached cond. condition_image_key: the key of an
            image-conditioned family's reference image (``--condition-image-key``). train_only: the records are the samples (SFT
            without the engine). rollout_batch_size: prompts per rollout. n_samples_per_prompt: samples per prompt.
        seed: ``--rollout-seed`` (the shuffles). shuffle: reshuffle every epoch.
    """

    prompt_data: str | None
    input_key: str = "prompt"
    image_key: str = "image"
    latent_key: str = "latent"
    cond_key: str = "cond"
    condition_image_key: str = "condition_image"
    train_only: bool = False
    rollout_batch_size: int = 1
    n_samples_per_prompt: int = 1
    seed: int = 42
    shuffle: bool = True


@dataclass(frozen=True)
class EngineSpec:
    """The student's few-step sampler and what it converts its samples with.

    Attributes:
        family: the model family class (resolved once by the driver); ``family(pipeline)`` is its instance. None
            only in a ``--dry-run`` whose pipeline cannot be read here (no worker starts then).
        pipeline: the student pipeline the engine's schedule and text encoder come from (``--hf-checkpoint``).
        num_steps, flow_shift, timesteps: the sampling schedule (``--diffusion-num-steps``, ``--diffusion-flow-shift``,
            ``--diffusion-timesteps`` in (0, 1000], which overrides both).
        guidance_scale: the student's own CFG scale (1: none). step_rule: ``"dmd2"`` or ``"euler"``.
        converter: ``fn(args, samples) -> train pairs`` (``--custom-expand-samples-to-train-pairs-path``, else the
            method's). step_strategy: ``fn(args, rollout_id, sample_indices, num_steps)``, or None (full
            trajectories).
        encode_negative: every sample carries the negative prompt's cond (a consumer asked for it:
            ``--encode-negative-prompt``, set by the method; the engine also encodes it when the student samples
            with CFG).
        negative_prompt, negative_prompt_origin, negative_cond: the negative prompt, where it came from, and its
            cached cond file (the prompt cache of the negative prompt), if any.
        dtype: the compute dtype's name (the text encoder's; a replica's stored weights).
        micro_batch_size: samples per sampling forward. seed: ``--rollout-seed`` (noise, stop steps).
        data: the data keys and the ``--train-only`` switch.
    """

    family: type | None
    pipeline: str
    converter: Callable
    num_steps: int = 4
    flow_shift: float = 3.0
    timesteps: tuple[float, ...] | None = None
    guidance_scale: float = 1.0
    step_rule: str = "dmd2"
    step_strategy: Callable | None = None
    encode_negative: bool = False
    negative_prompt: str | None = None
    negative_prompt_origin: str | None = None
    negative_cond: str | None = None
    dtype: str = "float32"
    micro_batch_size: int = 1
    seed: int = 42
    data: DataSpec = field(default_factory=lambda: DataSpec(None))

    def make_family(self, pipeline: str | None = None) -> Any:
        """The family instance for ``pipeline`` (default: the student's).

        Raises:
            ValueError: when the family could not be resolved (a dry run's spec).
        """
        if self.family is None:
            raise ValueError(f"no model family was resolved for {self.pipeline} (the spec of a dry run)")
        return self.family(pipeline or self.pipeline)


@dataclass(frozen=True)
class ProfileSpec:
    """``--profile-rollouts START:END`` (END excluded) and the directory the traces go to."""

    rollouts: tuple[int, int]
    directory: str


@dataclass(frozen=True)
class ExportSpec:
    """The end-of-run export: ``--save-hf`` (None: none), ``--overwrite-save-hf``, ``--save-hf-lora``."""

    path: str | None = None
    overwrite: bool = False
    save_lora: bool = False


@dataclass(frozen=True)
class RunSpec:
    """The whole run.

    Attributes:
        args: the parsed command line, handed to the hooks only (their documented signatures take it).
        engine: the student's sampler (:class:`EngineSpec`).
        groups: the trainer groups in training order; the actor is one of them.
        dp_size: every group's data-parallel size (its ranks over ``context_parallel_size``).
        context_parallel_size: ranks that split one sample's sequence (``--context-parallel-size``; Ulysses through
            diffusers, :mod:`miles.backends.fsdp_utils.context_parallel`).
        export: the end-of-run export.
        profile: the profiled rollouts, or None.
        log_level: the workers' Python logging level.
        distributed_timeout_minutes: how long a rank waits for the others in a collective.
        eval_hook: ``--eval-function-path``'s ``fn(args, images, records, rollout_id)``, or None.
    """

    args: Any
    engine: EngineSpec
    groups: tuple[GroupSpec, ...]
    dp_size: int = 1
    context_parallel_size: int = 1
    export: ExportSpec = field(default_factory=ExportSpec)
    profile: ProfileSpec | None = None
    log_level: str = "INFO"
    distributed_timeout_minutes: float = 60.0
    eval_hook: Callable | None = None

    def group(self, role: str) -> GroupSpec:
        """The group of ``role``.

        Raises:
            KeyError: naming the run's roles, for a role it does not have.
        """
        for group in self.groups:
            if group.role == role:
                return group
        raise KeyError(f"this run has no {role!r} group (its groups: {[group.role for group in self.groups]})")

    @property
    def roles(self) -> list[str]:
        return [group.role for group in self.groups]
