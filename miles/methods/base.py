"""What one ``--loss-type`` declares: the ``Method`` base class, and helpers its modules share.

A method owns everything that makes its algorithm: its flags (an argument group), the defaults it fills (hook paths,
what the engine must encode), its validation, its trainer groups (``TrainerConfig`` list) and what an export of its
student records. The generic pieces (engine, trainer, driver, export) read the plain settings a method fills and
never compare ``--loss-type`` themselves. Built-in hooks are referenced by import (:func:`hook_path`), so renaming
one breaks at import time, not inside a Ray worker; user hooks stay dotted paths.
"""

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.utils.trainer_config import TrainerConfig
from miles.utils.types import SideInput
from miles.utils.validation import reject

__all__ = ["Method", "PhaseWork", "fill_defaults", "hook_path", "require_teacher_consumer"]


def hook_path(fn: Callable) -> str:
    """The dotted path of an imported hook function, as the ``--custom-*-path`` flags hold it."""
    return f"{fn.__module__}.{fn.__qualname__}"


def fill_defaults(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Set each ``args.<name>`` that is still None to its default; a value the user set is never overwritten."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def require_teacher_consumer(args: argparse.Namespace, default_hooks: dict[str, str]) -> None:
    """``--teacher-load`` needs a hook that reads ``ctx.teacher_models``: one the user set, not a method default.

    Args:
        default_hooks: ``{dest: path}`` the method filled (its prepare and loss hooks do not read a teacher).
    """
    if args.teacher_load is None:
        return
    user_hooks = [
        getattr(args, dest) not in (None, default_hooks.get(dest))
        for dest in (
            "custom_prepare_train_batch_path",
            "custom_loss_function_path",
            "custom_train_output_function_path",
        )
    ]
    if not any(user_hooks):
        reject(
            "--teacher-load has no consumer: use --loss-type dmd2, or set --custom-prepare-train-batch-path, "
            "--custom-loss-function-path or --custom-train-output-function-path to a hook that reads it"
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
    training by one actor group."""

    name: str = ""
    description: str = ""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this method's own flags (an argument group). They are rejected under the other loss types."""

    def set_defaults(self, args: argparse.Namespace) -> None:
        """Fill what this method needs where the user left it unset (hook paths, the engine's settings)."""

    def validate(self, args: argparse.Namespace) -> None:
        """Reject what this method cannot run (``ArgumentValidationError``, one line naming the flags)."""

    def check_inputs(self, args: argparse.Namespace) -> None:
        """Reject, before Ray starts, what this method's flags ask of the files they name (the driver's preflight
        calls it after the pipelines and data passed their own checks)."""

    def trainer_configs(self, args: argparse.Namespace) -> list[TrainerConfig]:
        """The run's trainer groups in training order; the actor (student) is always one of them."""
        return [TrainerConfig("actor")]

    def settings(self, args: argparse.Namespace) -> Any:
        """This method's flags as one typed, frozen object, built once from the parsed args and carried as
        ``args.method_settings`` to every group (its hooks read it there); None for a method without flags."""
        return None

    def side_inputs(self, args: argparse.Namespace) -> list[SideInput]:
        """The JSONL files the RolloutManager deals beside the prompts, one record per sample, each reaching the
        sample's train pair as a data sample (``pair.extras[name]``): the DMD2 GAN's real data; ``[]`` for none."""
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

    def train_output_work(self, group_args: argparse.Namespace, pairs_per_rank: int) -> list[PhaseWork]:
        """The forwards a group's train-output hook runs per rollout on one rank (``--dry-run``)."""
        return []

    def train_forward_batch(self, group_args: argparse.Namespace) -> int:
        """Samples in one trainer forward of a group's micro-batch (the memory planner's activation batch)."""
        return group_args.micro_batch_size
