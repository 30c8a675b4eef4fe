"""What one ``--loss-type`` declares: the ``Method`` base class, and the spec builders its modules share.

A method owns everything that makes its algorithm: its flags (a settings dataclass that declares them,
:mod:`miles.utils.flags`), the defaults it fills, its validation, its trainer groups (``groups``: one
:class:`~miles.config.GroupSpec` each, with the hook functions themselves, built-in ones referenced by import) and
what an export of its student records. The generic pieces (engine, trainer, driver, export) read the specs a method
builds and never compare ``--loss-type`` themselves.
"""

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.config import CheckpointSpec, EMASpec, GroupHooks, GroupSpec, OptimizerSpec, ScheduleSpec, UserHooks
from miles.models.lora import LoraFlags
from miles.utils.types import SideInput
from miles.utils.validation import reject

__all__ = [
    "METHODS",
    "Method",
    "PhaseWork",
    "ema_spec",
    "optimizer_spec",
    "register_method",
    "replace_hooks",
    "schedule_spec",
    "student_group",
]


def optimizer_spec(args: argparse.Namespace, lr: float) -> OptimizerSpec:
    """A group's AdamW at ``lr`` with the command's betas, epsilon, weight decay, clip and skip limit."""
    return OptimizerSpec(
        lr=lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        max_skipped_steps=args.max_skipped_steps,
    )


def schedule_spec(args: argparse.Namespace, steps_per_rollout: int) -> ScheduleSpec:
    """A group's learning-rate schedule over ``--num-rollout`` rollouts of ``steps_per_rollout`` steps."""
    return ScheduleSpec(
        total_steps=args.num_rollout * steps_per_rollout,
        decay_style=args.lr_decay_style,
        warmup_steps=args.lr_warmup_steps,
        min_lr=args.min_lr,
    )


def ema_spec(args: argparse.Namespace) -> EMASpec | None:
    """The student's EMA (``--ema-decay``), or None."""
    if not args.ema_decay:
        return None
    return EMASpec(
        decay=args.ema_decay,
        min_decay=args.ema_min_decay,
        update_after_step=args.ema_update_after_step,
        for_eval=args.ema_for_eval,
    )


def student_group(args: argparse.Namespace, hooks: GroupHooks) -> GroupSpec:
    """The actor (student) group as the command's generic flags describe it, with ``hooks``."""
    steps = args.num_steps_per_rollout
    return GroupSpec(
        role="actor",
        hooks=hooks,
        init=args.hf_checkpoint,
        teacher=args.teacher_load,
        lora=LoraFlags(args.lora_rank, args.lora_alpha, args.lora_target_modules, args.lora_dropout).settings(),
        optimizer=optimizer_spec(args, args.lr),
        schedule=schedule_spec(args, steps),
        ema=ema_spec(args),
        checkpoint=CheckpointSpec(load=args.load, save=args.save),
        steps_per_rollout=steps,
        micro_batch_size=args.micro_batch_size,
        train_output_before_step=args.train_output_before_step,
        dtype=args.train_dtype,
        seed=args.seed,
        reshard_every_microbatch=args.fsdp_reshard_every_microbatch,
        gradient_checkpointing=args.gradient_checkpointing,
    )


@dataclass(frozen=True)
class PhaseWork:
    """One phase of a rollout as one DP rank runs it (``--dry-run`` prints these).

    Attributes:
        phase: e.g. ``"rollout"``, ``"critic steps"``, ``"scoring"``, ``"actor step"``.
        forwards, backwards: denoiser forwards / backwards per rollout on this rank.
        batch: samples per forward.
    """

    phase: str
    forwards: int
    backwards: int
    batch: int


class Method:
    """One ``--loss-type``. Subclasses override what their algorithm needs; the defaults describe plain SFT-like
    training by one actor group with the user's hooks."""

    name: str = ""
    description: str = ""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this method's own flags (an argument group). They are rejected under the other loss types."""

    def set_defaults(self, args: argparse.Namespace) -> None:
        """Fill what this method needs where the user left it unset (the engine's settings, its own flags)."""

    def validate(self, args: argparse.Namespace) -> None:
        """Reject what this method cannot run (``ArgumentValidationError``, one line naming the flags). Default:
        ``--teacher-load`` needs a hook that reads ``ctx.teacher_models``, one the user set (a method's own prepare
        and loss hooks read no teacher; DMD2, which reads it, overrides this)."""
        user_hooks = (
            args.custom_prepare_train_batch_path,
            args.custom_loss_function_path,
            args.custom_train_output_function_path,
        )
        if args.teacher_load is not None and all(path is None for path in user_hooks):
            reject(
                "--teacher-load has no consumer: use --loss-type dmd2, or set --custom-prepare-train-batch-path, "
                "--custom-loss-function-path or --custom-train-output-function-path to a hook that reads it"
            )

    def check_inputs(self, args: argparse.Namespace) -> None:
        """Reject, before Ray starts, what this method's flags ask of the files they name (the driver's preflight
        calls it after the pipelines and data passed their own checks)."""

    def guided_pipelines(self, args: argparse.Namespace) -> list[tuple[str, float, str, str]]:
        """``(scale flag, scale, pipeline flag, pipeline)`` of each guidance scale this method runs a pipeline at
        (DMD2: its teacher's), which preflight holds against the pipeline's ``max_guidance_scale``; ``[]`` for
        none."""
        return []

    def hook_flags(self, args: argparse.Namespace) -> dict[str, str | None]:
        """This method's own hook flags, ``{dest: dotted path or None}`` (DMD2's reward function): the driver
        imports them once with the generic ``--custom-*-path`` ones and hands them to :meth:`groups`."""
        return {}

    def default_hooks(self, args: argparse.Namespace) -> GroupHooks:
        """The actor's hooks where the user set none (SFT: the flow-matching prepare and loss)."""
        return GroupHooks()

    def converter(self, args: argparse.Namespace) -> Callable | None:
        """The converter (``fn(args, samples) -> train pairs``) where ``--custom-expand-samples-to-train-pairs-path``
        is unset; None: the user must set it."""
        return None

    def step_strategy(self, args: argparse.Namespace) -> Callable | None:
        """The engine's step strategy where ``--diffusion-step-strategy-path`` is unset; None: full trajectories."""
        return None

    def groups(self, args: argparse.Namespace, hooks: UserHooks) -> list[GroupSpec]:
        """The run's trainer groups in training order, as specs; the actor (student) is always one of them.

        Args:
            hooks: the user's hooks, imported once by the driver; a group takes the user's hook where one is set
                and the method's default elsewhere (:meth:`GroupHooks.over`).
        """
        return [student_group(args, hooks.group.over(self.default_hooks(args)))]

    def settings(self, args: argparse.Namespace) -> Any:
        """This method's flags as one typed, frozen object, built once from the parsed args and carried as
        ``args.method_settings`` to every hook; None for a method without flags."""
        return None

    def side_inputs(self, args: argparse.Namespace) -> list[SideInput]:
        """The JSONL files the RolloutManager deals beside the prompts, one record per sample, each reaching the
        sample's train pair as a data sample (``pair.extras[name]``): the DMD2 GAN's real data; ``[]`` for none."""
        return []

    def eval_data(self, args: argparse.Namespace) -> list[SideInput]:
        """JSONL files read only at evaluations (the DMD2 GAN's held-out reals): preflight checks them and the
        memory plan counts their prompts; ``[]`` for none."""
        return []

    def eval_media(self, args: argparse.Namespace, groups: dict, eval_records: list[dict], rollout_id: int) -> dict:
        """Extra images this method draws at each evaluation, ``{wandb key: PNG path}`` (DMD2: its debug grid)."""
        return {}

    def eval_metrics(self, args: argparse.Namespace, groups: dict, rollout_id: int) -> dict[str, float]:
        """Extra figures this method measures at each evaluation, logged as ``eval/<name>`` (DMD2: its
        discriminator's quality on held-out reals)."""
        return {}

    def export_schedule(self, args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any] | None:
        """The ``write_sampling_schedule`` keyword arguments an export records, given the engine's schedule; None
        keeps the source pipeline's scheduler as it is."""
        return engine

    def plan_lines(self, args: argparse.Namespace) -> list[str]:
        """Lines the dry run prints about this method's settings that defaults filled (DMD2: the teacher's
        guidance); ``[]`` for none."""
        return []

    def train_output_work(self, args: argparse.Namespace, group: GroupSpec, pairs_per_rank: int) -> list["PhaseWork"]:
        """The forwards a group's train-output hook runs per rollout on one rank (``--dry-run``)."""
        return []

    def train_forward_batch(self, args: argparse.Namespace, group: GroupSpec) -> int:
        """Samples in one trainer forward of a group's micro-batch (the memory planner's activation batch)."""
        return group.micro_batch_size


# Every registered method by its --loss-type name, in registration order (miles.methods imports them).
METHODS: dict[str, Method] = {}


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: register one instance of a :class:`Method` under its ``name`` (a ``--loss-type`` value).

    Raises:
        ValueError: for a method without a name or a name already taken.
    """
    if not cls.name or cls.name in METHODS:
        raise ValueError(f"method {cls.__qualname__} needs a --loss-type name of its own, got {cls.name!r}")
    METHODS[cls.name] = cls()
    return cls


def replace_hooks(group: GroupSpec, **hooks: Any) -> GroupSpec:
    """``group`` with some of its hooks replaced."""
    return dataclasses.replace(group, hooks=dataclasses.replace(group.hooks, **hooks))
