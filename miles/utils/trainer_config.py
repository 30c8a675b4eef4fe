"""Which trainer groups a run has, and each group's own copy of the args (seed ``[DMD2 1/10]``).

The trainer class (``FSDPTrainRayActor``) reads plain argument names (``hf_checkpoint``, ``lr``, ``load``, ``save``,
``num_steps_per_rollout``, the hook paths). One Namespace cannot hold the actor's and the critic's values at once,
so each group gets a deep copy of the args with its overrides applied, and the trainer class stays role-agnostic.
Each ``--loss-type`` lists its groups in its method module (``miles.methods``, ``compute_trainer_configs``).
"""

import argparse
import copy
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainerConfig", "compute_trainer_args", "sibling_dir", "trains"]


@dataclass(frozen=True)
class TrainerConfig:
    """One trainer group of a run.

    Attributes:
        role: ``"actor"`` (the student; generates the rollouts) or another group's name (``"critic"``, DMD2's fake
            score).
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


def trains(group_args: argparse.Namespace) -> bool:
    """Whether a group trains: a frozen group (the DMD2 reward group) has ``num_steps_per_rollout`` 0 among its
    overrides, and no optimizer, checkpoint or memory plan of trainable state
    (:mod:`miles.backends.fsdp_utils.frozen_trainer`)."""
    return group_args.num_steps_per_rollout > 0


def compute_trainer_args(args: argparse.Namespace, trainer: TrainerConfig) -> argparse.Namespace:
    """A deep copy of ``args`` with ``trainer.overrides`` applied; ``args`` itself is left untouched.

    Raises:
        ValueError: if an override names an argument the parsed args do not have (a typo would otherwise be a new,
            silently ignored attribute).
    """
    unknown = sorted(set(trainer.overrides) - set(vars(args)))
    if unknown:
        raise ValueError(f"trainer {trainer.role!r} overrides unknown arguments {unknown}; use parser dest names")
    trainer_args = copy.deepcopy(args)
    for name, value in trainer.overrides.items():
        setattr(trainer_args, name, value)
    return trainer_args
