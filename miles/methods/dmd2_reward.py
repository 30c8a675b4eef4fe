"""``--loss-type dmd2`` with a reward (DMDR, arXiv 2511.13649): its flags' checks and the reward group.

With ``--dmd2-reward-weight w > 0`` the run has a third trainer group, ``reward``, between the critic and the actor:
frozen (its spec has no model source: no denoiser, optimizer or checkpoint; the actor shell runs it with
:class:`~miles.backends.fsdp_utils.frozen_trainer.FrozenGroupRunner`), it runs the train-output hook
:func:`~miles.backends.fsdp_utils.loss_hub.reward.reward_gradient`, which ships each pair's ``∂reward/∂x̂0`` to the
actor; the actor subtracts ``w·∂reward/∂x̂0`` from its x0 gradient. The reward itself is
``--dmd2-reward-function-path`` (``fn(images, prompts) -> rewards``; for digits
:func:`miles.eval.digits.reward.digit_log_prob`), imported once by the driver and handed to the hook. With w = 0 (the
default) there is no reward group and a run is exactly what it was without these flags.
"""

import argparse
import functools

from miles.backends.fsdp_utils.loss_hub import reward as reward_loss
from miles.backends.fsdp_utils.loss_hub.dmd2_types import DMD2Settings, dmd2_settings
from miles.config import GroupHooks, GroupSpec, UserHooks
from miles.methods.base import PhaseWork
from miles.utils.validation import reject

__all__ = [
    "check_reward_family",
    "reward_enabled",
    "reward_group",
    "reward_work",
    "validate_reward_args",
]


def reward_enabled(args: argparse.Namespace) -> bool:
    """The reward group runs when the reward term has a weight."""
    return dmd2_settings(args).reward_enabled


def validate_reward_args(settings: DMD2Settings) -> None:
    """Reject reward flags that cannot run (the weight's range is its field's check).

    Raises:
        ArgumentValidationError: one line naming the flags.
    """
    if settings.reward_enabled and not settings.reward_function_path:
        reject("--dmd2-reward-weight > 0 needs --dmd2-reward-function-path (fn(images, prompts) -> rewards)")
    if settings.reward_function_path and not settings.reward_enabled:
        reject(
            "--dmd2-reward-function-path is read by the reward group only: set --dmd2-reward-weight > 0, or remove it"
        )


def check_reward_family(args: argparse.Namespace) -> None:
    """The student's family decodes latents to pixels with autograd (the reward's gradient flows through it).

    Raises:
        ArgumentValidationError: naming the family and the flag.
    """
    if not reward_enabled(args):
        return
    from miles.models import get_model_family, supports
    from miles.models.capabilities import DifferentiablePixels

    family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
    if not supports(family, DifferentiablePixels):
        reject(
            f"--dmd2-reward-weight needs a family that decodes latents to pixels with autograd "
            f"(DifferentiablePixels); the {family.name} family of --hf-checkpoint {args.hf_checkpoint} has none"
        )


def reward_group(args: argparse.Namespace, hooks: UserHooks) -> GroupSpec:
    """The frozen ``reward`` group (module docstring): no model source, no steps, no checkpoint, no teacher; the
    reward hook is its train output, with the user's reward function (imported once by the driver) bound to it."""
    reward = hooks.method.get("dmd2_reward_function_path")  # None only when the layout alone is asked for
    return GroupSpec(
        role=reward_loss.REWARD_ROLE,
        hooks=GroupHooks(
            train_input=hooks.group.train_input,
            train_output=functools.partial(reward_loss.reward_gradient, reward=reward),
        ),
        init=None,
        steps_per_rollout=0,
        micro_batch_size=args.micro_batch_size,
        dtype=args.train_dtype,
        seed=args.seed,
    )


def reward_work(group: GroupSpec, pairs_per_rank: int) -> list[PhaseWork]:
    """The reward group's work per rank and rollout: no denoiser forward (what :class:`PhaseWork` counts); the
    decode and the reward model's forward and backward of each micro-batch are the hook's."""
    return [PhaseWork("reward hook (no denoiser)", 0, 0, group.micro_batch_size)]
