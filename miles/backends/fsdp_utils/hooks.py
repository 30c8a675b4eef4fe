"""A trainer group's hooks: checking that it has them, and what they return.

The hooks themselves are functions a group's spec holds (:class:`miles.config.GroupHooks`, imported once by the
driver). The trainer (:class:`miles.backends.fsdp_utils.trainer.GroupTrainer`) calls the prepare, loss, train-input and
train-output hooks of its group (docs/customization.md); a hook that returns the wrong thing fails here, with the
hook's path in the message, instead of deep inside the backward.
"""

from typing import Any

import torch

from miles.backends.fsdp_utils.loss_hub.types import PreparedBatch
from miles.config import GroupHooks
from miles.utils.types import TrainPair
from miles.utils.validation import HookResultError

__all__ = [
    "check_hooks",
    "check_loss",
    "check_prepared",
    "check_train_input",
    "metric_key",
    "split_windows",
]


def check_hooks(hooks: GroupHooks) -> GroupHooks:
    """A training group's hooks: its prepare and loss hooks are set.

    Raises:
        ValueError: naming the flag, if the prepare or loss hook is unset (``--loss-type`` sets them for sft_loss and
            dmd2).
    """
    for flag, value in (
        ("--custom-prepare-train-batch-path", hooks.prepare),
        ("--custom-loss-function-path", hooks.loss),
    ):
        if value is None:
            raise ValueError(f"{flag} is unset; pass a hook path or a --loss-type that fills it (sft_loss, dmd2)")
    return hooks


def metric_key(role: str, name: str) -> str:
    """``train/<name>`` for the actor, ``train/<role>-<name>`` for any other group (upstream log_train_step); a name
    with its own namespace (``health/diversity_ratio``) is kept as it is."""
    if "/" in name:
        return name
    return f"train/{name}" if role == "actor" else f"train/{role}-{name}"


def split_windows(pairs: list, num_windows: int, micro_batch_size: int) -> list[list[list]]:
    """Split a rank's pairs into ``num_windows`` equal optimizer windows of micro-batches.

    Each window holds ``len(pairs) / num_windows`` pairs in order, cut into micro-batches of ``micro_batch_size``
    (the last one of a window may be smaller).

    Raises:
        ValueError: if there are no pairs or they do not split evenly into the windows.
    """
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    if not pairs:
        raise ValueError("this rank's rollout shard is empty; check --rollout-batch-size against the DP size")
    if len(pairs) % num_windows:
        raise ValueError(
            f"{len(pairs)} train pairs per rank do not split into {num_windows} equal optimizer steps of this "
            "group; make the per-rank pair count a multiple of its steps per rollout"
        )
    size = len(pairs) // num_windows
    windows = [pairs[i * size : (i + 1) * size] for i in range(num_windows)]
    return [[window[j : j + micro_batch_size] for j in range(0, size, micro_batch_size)] for window in windows]


def _describe(value: Any) -> str:
    """What a hook returned, for an error message: ``float``, ``a tensor of shape (4,)``, ``None``."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def check_prepared(prepared: Any, path: str) -> PreparedBatch:
    """The prepare hook's result must be a ``PreparedBatch`` with tensor ``latents`` and ``timestep`` and a dict
    ``cond``.

    Raises:
        HookResultError: naming the hook (``path``), what it returned and what is expected.
    """
    if not isinstance(prepared, PreparedBatch):
        raise HookResultError(
            f"prepare hook {path} returned {_describe(prepared)}; expected a "
            "miles.backends.fsdp_utils.loss_hub.types.PreparedBatch"
        )
    for name, value, kind in (
        ("latents", prepared.latents, torch.Tensor),
        ("timestep", prepared.timestep, torch.Tensor),
        ("cond", prepared.cond, dict),
    ):
        if not isinstance(value, kind):
            raise HookResultError(
                f"prepare hook {path} returned a PreparedBatch whose {name} is {_describe(value)}; expected "
                f"{'a tensor' if kind is torch.Tensor else 'a dict of tensors'}"
            )
    return prepared


def check_loss(loss: Any, path: str) -> torch.Tensor:
    """The loss hook's result must be a 0-d floating-point tensor that requires grad (the sum over the
    micro-batch's pairs).

    Raises:
        HookResultError: e.g. "loss hook my.loss returned float; expected a scalar tensor with grad".
    """
    problem = None
    if not isinstance(loss, torch.Tensor):
        problem = _describe(loss)
    elif loss.dim() != 0:
        problem = f"a tensor of shape {tuple(loss.shape)}"
    elif not loss.is_floating_point():
        problem = f"a {loss.dtype} tensor"
    elif not loss.requires_grad:
        problem = "a tensor without grad (computed under no_grad, detached, or not from new_pred)"
    if problem is not None:
        raise HookResultError(
            f"loss hook {path} returned {problem}; expected a scalar tensor with grad (the sum of the "
            "micro-batch's pair losses)"
        )
    return loss


def check_train_input(pairs: Any, path: str, received: int) -> list[TrainPair]:
    """The train-input hook's result must be a list of ``TrainPair`` as long as the list it was given: a hook that
    drops pairs would silently train on a smaller batch than ``--global-batch-size``.

    Raises:
        HookResultError: naming the hook, what it returned and what is expected.
    """
    if not isinstance(pairs, list) or not all(isinstance(pair, TrainPair) for pair in pairs):
        got = (
            _describe(pairs)
            if not isinstance(pairs, list)
            else "a list holding "
            + ", ".join(sorted({type(pair).__name__ for pair in pairs if not isinstance(pair, TrainPair)}))
        )
        raise HookResultError(
            f"train-input hook {path} returned {got}; expected a list of miles.utils.types.TrainPair"
        )
    if len(pairs) != received:
        raise HookResultError(
            f"train-input hook {path} returned {len(pairs)} train pairs for the {received} it was given; it may "
            "change pairs but not their number (the batch sizes count them)"
        )
    return pairs
