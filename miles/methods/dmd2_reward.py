"""``--loss-type dmd2`` with a reward (DMDR, arXiv 2511.13649): its flags, their checks and the reward group.

With ``--dmd2-reward-weight w > 0`` the run has a third trainer group, ``reward``, between the critic and the actor:
frozen (:class:`~miles.backends.fsdp_utils.frozen_trainer.FrozenGroupTrainer`: no denoiser, optimizer or
checkpoint), it runs the train-output hook :func:`~miles.backends.fsdp_utils.loss_hub.reward.reward_gradient`, which
ships each pair's ``∂reward/∂x̂0`` to the actor; the actor subtracts ``w·∂reward/∂x̂0`` from its x0 gradient. The
reward itself is ``--dmd2-reward-function-path`` (``fn(images, prompts) -> rewards``; for digits
:func:`miles.eval.digits.reward.digit_log_prob`). With w = 0 (the default) there is no reward group and a run is
exactly what it was without these flags.
"""

import argparse

from miles.backends.fsdp_utils.frozen_trainer import FrozenGroupTrainer
from miles.backends.fsdp_utils.loss_hub import reward as reward_loss
from miles.backends.fsdp_utils.loss_hub.dmd2_types import DMD2Settings, dmd2_settings
from miles.methods.base import PhaseWork, hook_path
from miles.utils.trainer_config import TrainerConfig
from miles.utils.validation import reject

__all__ = [
    "REWARD_GROUP_OVERRIDES",
    "check_reward_family",
    "reward_enabled",
    "reward_trainer_config",
    "reward_work",
    "validate_reward_args",
]

# The reward group's own settings: frozen (no steps, no checkpoint, no teacher), the reward hook as its output.
REWARD_GROUP_OVERRIDES = {
    "custom_trainer_path": hook_path(FrozenGroupTrainer),
    "custom_train_output_function_path": hook_path(reward_loss.reward_gradient),
    "num_steps_per_rollout": 0,
    "teacher_load": None,
    "load": None,
    "save": None,
    "save_hf": None,
    "ema_decay": None,
}


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


def reward_trainer_config() -> TrainerConfig:
    """The frozen ``reward`` group (module docstring)."""
    return TrainerConfig(reward_loss.REWARD_ROLE, dict(REWARD_GROUP_OVERRIDES))


def reward_work(group_args: argparse.Namespace, pairs_per_rank: int) -> list[PhaseWork]:
    """The reward group's work per rank and rollout: no denoiser forward (what :class:`PhaseWork` counts); the
    decode and the reward model's forward and backward of each micro-batch are the hook's."""
    return [PhaseWork("reward hook (no denoiser)", 0, 0, group_args.micro_batch_size)]
