"""Failures of Ray workers as the driver reports them: one line naming the group, rank, method and rollout.

``ray.get`` of a failed task raises a ``RayTaskError`` whose text is Ray's wrapper (the worker's title, pid, actor
id and a traceback that starts inside Ray); a dead worker raises an ``ActorDiedError`` of a dozen lines about OOM
killers. :func:`get_all` waits for a list of per-rank refs and turns the first failure into a
:class:`WorkerError`::

    critic rank 1 failed in train (rollout 3): ValueError: loss hook my.loss returned float; expected ...
    critic rank 1 died in train (rollout 3) (exit code 3)

with the worker's own traceback (Ray's frames dropped) in ``details``. It waits for the first failure, not for
every ref: the other ranks of a group may be blocked in a collective with the failed one and would never finish.
"""

import re
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from miles.utils.validation import RunError

__all__ = ["WorkerError", "describe_failure", "get_all"]

# Frames of Ray's own worker machinery, dropped from a worker's traceback.
_RAY_FRAME = re.compile(r'^\s*File ".*[/\\]ray[/\\]_(private|raylet)[/\\]')
_EXIT_CODE = re.compile(r"exit code (-?\d+)")


class WorkerError(RuntimeError):
    """A Ray worker failed. ``str(self)`` is the one-line summary; ``details`` the worker's own traceback (empty for
    a :class:`~miles.utils.validation.RunError`, whose message says everything, and for a dead worker)."""

    def __init__(self, summary: str, details: str = "") -> None:
        super().__init__(summary)
        self.summary = summary
        self.details = details


def _root_cause(exc: RayTaskError) -> BaseException:
    cause: Any = exc
    # A task that itself waited on a failed task: unwrap to the original error.
    while isinstance(cause, RayTaskError) and getattr(cause, "cause", None) is not None:
        cause = cause.cause
    return cause


def _type_name(cause: BaseException) -> str:
    """The error's type as the user knows it: for the trainer's own ``RunError`` kinds, the builtin they extend
    (``ValueError``, ``OSError``, ``FloatingPointError``)."""
    if isinstance(cause, RunError):
        for cls in type(cause).__mro__:
            if cls.__module__ == "builtins":
                return cls.__name__
    return type(cause).__name__


def _user_traceback(exc: RayTaskError) -> str:
    """The worker's traceback without Ray's header line and frames (the user's and miles' frames stay)."""
    # A RayTaskError's text is the worker's formatted traceback, under a header naming the Ray task.
    lines, keep, dropping = str(exc).splitlines(), [], True
    for line in lines:
        if "ray::" in line and "pid=" in line:
            dropping = True  # the header
            continue
        if line.lstrip().startswith('File "'):
            dropping = bool(_RAY_FRAME.match(line))
        elif dropping and set(line.strip()) <= set("^~"):
            continue  # the position markers under a dropped frame's code line
        elif line and not line.startswith(" "):
            dropping = False  # the exception's own line(s)
        if not dropping:
            keep.append(line)
    if keep and not keep[0].startswith("Traceback"):
        keep.insert(0, "Traceback (most recent call last, in the worker):")
    return "\n".join(keep)


def describe_failure(exc: BaseException, who: str, method: str, rollout_id: Any = None) -> WorkerError:
    """The :class:`WorkerError` of a failed ``ray.get``: ``exc`` a ``RayTaskError`` or ``RayActorError``, ``who``
    the worker (``"critic rank 1"``), ``method`` what it ran (``"train"``)."""
    where = f"in {method}" + (f" (rollout {rollout_id})" if rollout_id is not None else "")
    if isinstance(exc, RayTaskError):
        cause = _root_cause(exc)
        message = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        summary = f"{who} failed {where}: {_type_name(cause)}" + (f": {message}" if message else "")
        details = "" if isinstance(cause, RunError) else _user_traceback(exc)
        return WorkerError(summary, details)
    if isinstance(exc, RayActorError):
        text = str(exc)
        if getattr(exc, "_actor_init_failed", False) or "creation task" in text:
            return WorkerError(f"{who} failed to start {where}: {text.strip().splitlines()[-1]}")
        code = _EXIT_CODE.search(text)
        exit_code = (
            f"exit code {code.group(1)}"
            if code
            else "exit code unknown: killed by a signal, e.g. the OOM killer or kill -9, or os._exit"
        )
        return WorkerError(f"{who} died {where} ({exit_code})")
    return WorkerError(f"{who} failed {where}: {type(exc).__name__}: {exc}")


def get_all(refs: list, who: list[str] | str, method: str, rollout_id: Any = None) -> list:
    """``ray.get(refs)`` in order, or a :class:`WorkerError` for the first ref that fails.

    Args:
        refs: one ObjectRef per worker (a group's ranks).
        who: a label per ref (``["critic rank 0", "critic rank 1"]``), or one label for every ref.
        method: the method they run, for the message.
        rollout_id: the rollout, for the message (None: not part of one).

    Raises:
        WorkerError: the first failure, as one line (see the module docstring).
    """
    labels = [who] * len(refs) if isinstance(who, str) else list(who)
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            try:
                ray.get(ref)
            except (RayTaskError, RayActorError) as exc:
                raise describe_failure(exc, labels[index[ref]], method, rollout_id) from None
    return ray.get(list(refs))
