"""The error type of a command that cannot run, and the small checks every validator shares.

Validators only reject: each rejection is one line naming the flags and the fix; the CLI prints it as
``train_diffusion.py: error: <message>`` and exits with code 2, before Ray starts.
"""

import argparse
import math

__all__ = ["ArgumentValidationError", "dp_size", "flag", "is_finite", "reject", "rollout_pairs"]


class ArgumentValidationError(ValueError):
    """A flag combination that cannot run. The message names the flags and the fix, on one line."""


def reject(message: str) -> None:
    """Raise ``ArgumentValidationError(message)``."""
    raise ArgumentValidationError(message)


def flag(dest: str) -> str:
    """``"critic_lr"`` → ``"--critic-lr"``."""
    return "--" + dest.replace("_", "-")


def dp_size(args: argparse.Namespace) -> int:
    """Data-parallel size of every trainer group: ``actor_num_nodes × actor_num_gpus_per_node``."""
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def rollout_pairs(args: argparse.Namespace) -> int:
    """Samples one rollout produces (one train pair each for SFT and DMD2): ``rollout_batch_size ×
    n_samples_per_prompt``."""
    return args.rollout_batch_size * args.n_samples_per_prompt


def is_finite(value) -> bool:
    """True for a finite int or float (False for NaN, ±inf and non-numbers)."""
    return isinstance(value, (int, float)) and math.isfinite(value)
