"""Which trainer groups a run has, and each group's own copy of the args (seed ``[DMD2 1/10]``).

The trainer class (``FSDPTrainRayActor``) reads plain argument names (``hf_checkpoint``, ``lr``, ``load``, ``save``,
``num_steps_per_rollout``, the hook paths). One Namespace cannot hold the actor's and the critic's values at once,
so each group gets a deep copy of the args with its overrides applied, and the trainer class stays role-agnostic.
"""

import argparse
import copy
import os
from dataclasses import dataclass, field
from typing import Any

from miles.utils.arguments import DMD2_CRITIC_PREPARE, DMD2_CRITIC_SCORING, SFT_LOSS, build_parser, rollout_pairs

__all__ = ["TrainerConfig", "compute_trainer_configs", "compute_trainer_args", "sibling_dir"]


@dataclass(frozen=True)
class TrainerConfig:
    """One trainer group of a run.

    Attributes:
        role: ``"actor"`` (the student; pushes weights to the engine) or ``"critic"`` (DMD2's fake score).
        overrides: argument name → value applied to this group's copy of the args. ``None`` values are applied too
            (the actor's copy drops ``teacher_load`` that way).
    """

    role: str
    overrides: dict[str, Any] = field(default_factory=dict)


def sibling_dir(path: str | None, suffix: str) -> str | None:
    """``/ckpt/run`` → ``/ckpt/run_critic``; ``None`` stays ``None``. A trailing slash is ignored."""
    if path is None:
        return None
    return os.path.normpath(path) + suffix


def _dmd2_critic_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The critic group's overrides (seed ``[DMD2 4/7]``): init, lr, checkpoint dirs, K steps, SFT-shaped hooks."""
    k = args.dmd2_critic_steps_per_rollout
    return {
        "hf_checkpoint": args.critic_load,
        "lr": args.critic_lr,
        "load": sibling_dir(args.load, "_critic"),
        "save": sibling_dir(args.save, "_critic"),
        "save_hf": None,
        "num_steps_per_rollout": k,
        "global_batch_size": rollout_pairs(args) // k,
        "custom_prepare_train_batch_path": DMD2_CRITIC_PREPARE,
        "custom_loss_function_path": SFT_LOSS,
        "custom_train_output_function_path": DMD2_CRITIC_SCORING,
        "train_output_before_step": k - 1 if args.dmd2_critic_scoring == "original" else None,
    }


def compute_trainer_configs(args: argparse.Namespace) -> list[TrainerConfig]:
    """The run's trainer groups in training order.

    Every run has the actor. ``--loss-type dmd2`` puts the critic first, so it catches up with the student that
    produced the rollout and then scores the rollout for the actor's step; the actor's copy drops
    ``teacher_load`` so only the critic group holds the teacher.
    """
    if args.loss_type != "dmd2":
        return [TrainerConfig("actor")]
    return [
        TrainerConfig("critic", _dmd2_critic_overrides(args)),
        TrainerConfig("actor", {"teacher_load": None}),
    ]


def compute_trainer_args(args: argparse.Namespace, trainer: TrainerConfig) -> argparse.Namespace:
    """A deep copy of ``args`` with ``trainer.overrides`` applied; ``args`` itself is left untouched.

    Raises:
        ValueError: if an override names an argument the parser does not know (a typo would otherwise be a new,
            silently ignored attribute).
    """
    known = {action.dest for action in build_parser()._actions}
    unknown = sorted(set(trainer.overrides) - known)
    if unknown:
        raise ValueError(f"trainer {trainer.role!r} overrides unknown arguments {unknown}; use parser dest names")
    trainer_args = copy.deepcopy(args)
    for name, value in trainer.overrides.items():
        setattr(trainer_args, name, value)
    return trainer_args
