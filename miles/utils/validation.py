"""The error types of a command that cannot run, and the small checks every validator shares.

Validators only reject: each rejection is one line naming the flags and the fix; the CLI prints it as
``train_diffusion.py: error: <message>`` and exits with code 2, before Ray starts. Failures found at run time that
say everything in their message (a hook's wrong return value, the non-finite guard, a full disk) are a
:class:`RunError`: the driver prints them on one line, naming the group, rank and rollout, without a traceback.
"""

import argparse
import math

__all__ = [
    "ArgumentValidationError",
    "CheckpointWriteError",
    "HookResultError",
    "NonFiniteError",
    "NonFiniteWeightsError",
    "RunError",
    "check_number",
    "context_parallel_size",
    "dp_size",
    "flag",
    "float_list",
    "int_list",
    "is_finite",
    "reject",
    "rollout_pairs",
    "trainer_ranks",
]


class ArgumentValidationError(ValueError):
    """A flag combination that cannot run. The message names the flags and the fix, on one line."""


class RunError(Exception):
    """A run-time failure whose message is complete (what failed, where, the fix): the driver prints it on one line
    and no traceback, since the frames would show only the trainer's own check. Mixed into a builtin type, whose name
    the driver shows (``ValueError: loss hook my.loss returned float; ...``)."""


class HookResultError(RunError, ValueError):
    """A hook returned something the trainer cannot use (a float for a loss, a dict for a ``PreparedBatch``, fewer
    train pairs than it was given)."""


class NonFiniteError(RunError, FloatingPointError):
    """The non-finite guard stopped the run: ``--max-skipped-steps`` optimizer steps in a row had a non-finite
    gradient norm."""


class NonFiniteWeightsError(RunError, RuntimeError):
    """Weights with NaN or inf values, refused at load, at checkpoint time and at export."""


class CheckpointWriteError(RunError, OSError):
    """A checkpoint or an export could not be written (a full disk, an unwritable directory); nothing complete was
    touched."""


def reject(message: str) -> None:
    """Raise ``ArgumentValidationError(message)``."""
    raise ArgumentValidationError(message)


def flag(dest: str) -> str:
    """``"critic_lr"`` → ``"--critic-lr"``."""
    return "--" + dest.replace("_", "-")


def trainer_ranks(args: argparse.Namespace) -> int:
    """Ranks (GPUs) of every trainer group: ``actor_num_nodes × actor_num_gpus_per_node``."""
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def context_parallel_size(args: argparse.Namespace) -> int:
    """``--context-parallel-size``: ranks that split one sample's sequence (Ulysses); 1 without the flag."""
    value = getattr(args, "context_parallel_size", None)  # args of a test or a hook written before the flag
    return 1 if value is None else value


def dp_size(args: argparse.Namespace) -> int:
    """Data-parallel size of every trainer group: its ranks over the context-parallel size
    (``actor_num_nodes × actor_num_gpus_per_node / context_parallel_size``); the ranks of one context-parallel group
    read the same shard of every rollout."""
    return trainer_ranks(args) // max(context_parallel_size(args), 1)


def rollout_pairs(args: argparse.Namespace) -> int:
    """Samples one rollout produces (one train pair each for SFT and DMD2): ``rollout_batch_size ×
    n_samples_per_prompt``."""
    return args.rollout_batch_size * args.n_samples_per_prompt


def is_finite(value) -> bool:
    """True for a finite int or float (False for NaN, ±inf and non-numbers)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def _interval(low, high, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    if low is None:
        return f"{'<' if high_open else '<='} {high}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_number(
    name: str,
    value,
    *,
    low=None,
    high=None,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> None:
    """Reject a flag's value that is not a finite number inside ``[low, high]`` (either end open or absent).

    Args:
        name: the flag as the user typed it (``"--adam-beta1"``).
        hint: appended to the message, e.g. ``"(e.g. 3.0)"``.

    Raises:
        ArgumentValidationError: ``"--adam-beta1 must be in [0, 1), got 1.0"``, or ``"--lr must be a finite number,
            got nan"`` (argparse's ``float`` accepts ``nan`` and ``inf``).
    """
    suffix = f" {hint}" if hint else ""
    if not is_finite(value):
        reject(f"{name} must be a finite number{suffix}, got {value}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        reject(f"{name} must be {_interval(low, high, low_open, high_open)}{suffix}, got {value}")


def _number_list(text: str, kind: type) -> list:
    try:
        return [kind(part) for part in text.replace(",", " ").split()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}s, got {text!r}") from exc


def float_list(text: str) -> list[float]:
    """An argparse type: ``"1, 0.5 0.25"`` → ``[1.0, 0.5, 0.25]`` (commas or spaces).

    Raises:
        argparse.ArgumentTypeError: for a part that is not a number (argparse prints it on one line, exit 2).
    """
    return _number_list(text, float)


def int_list(text: str) -> list[int]:
    """An argparse type: ``"6,12"`` → ``[6, 12]`` (commas or spaces).

    Raises:
        argparse.ArgumentTypeError: for a part that is not an integer (argparse prints it on one line, exit 2).
    """
    return _number_list(text, int)
