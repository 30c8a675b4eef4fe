"""``--keep-best METRIC:min|max``: the rollout whose evaluation scored best, kept and exported beside the last.

The driver tracks the best value of one evaluation figure (``eval/<METRIC>``, a figure the eval hook or the method
returns: the digits ``fd``, a reward, an accuracy) over the run's evaluations. The direction is part of the flag and
has no default: ``fd:min`` keeps the lowest FD, ``accuracy:max`` the highest accuracy. When an evaluation beats every
earlier one (strictly; NaN never does) the driver

1. exports the student as it was evaluated (the EMA with ``--ema-decay``) to ``<--save-hf>-best`` (with
   ``--save-hf``), written beside itself and renamed into place, with ``keep_best.json`` inside naming the figure,
   its value and the rollout; an earlier best export is replaced only by a better one;
2. keeps that rollout's checkpoint (with ``--save``): saved now if the rollout was not a save rollout, spared by
   ``--save-keep-last`` pruning while it is the best, and named in the run record (``run.json``), so a resume
   continues from the best value seen (and from the export's, when the export is the newer one);
3. logs ``best/<METRIC>`` and ``best/rollout_id`` to ``metrics.jsonl`` and prints one line above the progress bar.

At the end of the run one line names the best rollout, its value, its checkpoint and its export.
"""

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.utils.paths import KEEP_BEST_FILE
from miles.utils.validation import RunError, reject

__all__ = ["KEEP_BEST_FILE", "KeepBest", "best_export_dir", "parse_keep_best", "read_best_export"]

logger = logging.getLogger(__name__)

DIRECTIONS = ("min", "max")


def parse_keep_best(spec: str) -> tuple[str, str]:
    """``("eval/<name>", "min" | "max")`` of a ``--keep-best`` value: ``fd:min``, ``eval/fd:min``,
    ``accuracy:max``.

    Raises:
        ArgumentValidationError: naming the flag, for a value without a metric or without a direction, or a
            direction other than min / max.
    """
    name, sep, direction = str(spec).rpartition(":")
    if not sep:
        reject(
            f"--keep-best {spec} needs a direction: {spec}:min (lower is better: an FD, a loss) or {spec}:max "
            "(higher is better: an accuracy, a reward)"
        )
    name = name.strip().removeprefix("eval/")
    if not name:
        reject(f"--keep-best {spec} names no evaluation figure; pass e.g. fd:min")
    if any(char.isspace() for char in name):
        # No evaluation figure's name holds a space: "f d:min" would never match one.
        reject(f"--keep-best {spec}: {name!r} is not an evaluation figure's name (it holds a space)")
    if direction not in DIRECTIONS:
        reject(f"--keep-best {spec}: the direction must be min or max, got {direction!r}")
    return f"eval/{name}", direction


def best_export_dir(save_hf: str | os.PathLike) -> Path:
    """Where ``--keep-best`` exports: ``<--save-hf>-best``, beside the last export."""
    path = Path(os.path.normpath(save_hf))
    return path.with_name(f"{path.name}-best")


def read_best_export(save_hf: str | os.PathLike | None) -> dict[str, Any] | None:
    """The ``keep_best.json`` of an earlier best export beside ``save_hf``, or None (no export, or unreadable)."""
    if not save_hf:
        return None
    try:
        record = json.loads((best_export_dir(save_hf) / KEEP_BEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@dataclass
class KeepBest:
    """The best value of one evaluation figure seen so far, and its rollout.

    Attributes:
        metric: the logged key, ``"eval/<name>"``.
        mode: ``"min"`` or ``"max"``.
        value: the best finite value so far, or None before the first.
        rollout_id: the rollout it was evaluated after, or None.
    """

    metric: str
    mode: str
    value: float | None = None
    rollout_id: int | None = None

    @classmethod
    def from_args(cls, args) -> "KeepBest | None":
        """The tracker of ``--keep-best`` (None without the flag)."""
        if not args.keep_best:
            return None
        return cls(*parse_keep_best(args.keep_best))

    @property
    def name(self) -> str:
        """The figure's name without ``eval/``: ``"fd"``."""
        return self.metric.removeprefix("eval/")

    def better(self, value: Any) -> bool:
        """Whether ``value`` beats the best so far: finite and strictly lower (min) or higher (max)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value < self.value if self.mode == "min" else value > self.value

    def state(self) -> dict[str, Any]:
        """``{"metric", "mode", "value", "rollout_id"}``: what the run record and the export keep."""
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "rollout_id": self.rollout_id}

    def restore(self, *states: dict[str, Any] | None) -> list[str]:
        """Continue from saved states (the run record's, the best export's): the best of those that track the same
        figure in the same direction. Returns the lines a resume logs about it."""
        lines = []
        for state in states:
            if not isinstance(state, dict) or state.get("rollout_id") is None:
                continue
            if (state.get("metric"), state.get("mode")) != (self.metric, self.mode):
                lines.append(
                    f"--keep-best {self.name}:{self.mode} starts afresh: the saved best tracks "
                    f"{state.get('metric')} ({state.get('mode')})"
                )
                continue
            if self.better(state.get("value")):
                self.value, self.rollout_id = float(state["value"]), int(state["rollout_id"])
        if self.rollout_id is not None:
            lines.append(
                f"--keep-best: the best {self.metric} so far is {self.value:.6g} after rollout {self.rollout_id}"
            )
        return lines

    def update(self, metrics: dict[str, Any], rollout_id: int) -> bool:
        """Take an evaluation's figures; True when its value is the new best.

        Raises:
            RunError: when the evaluation logged no such figure (one line naming the flag and what it logged).
        """
        if self.metric not in metrics:
            logged = ", ".join(sorted(key for key in metrics if key.startswith("eval/"))) or "nothing"
            raise RunError(
                f"--keep-best {self.name}:{self.mode}: the evaluation after rollout {rollout_id} logged no "
                f"{self.metric} (it logged {logged}); name one of those figures"
            )
        value = metrics[self.metric]
        value = float(value.item() if hasattr(value, "item") else value)
        if not self.better(value):
            return False
        self.value, self.rollout_id = value, rollout_id
        return True

    def summary(self, save: str | None, save_hf: str | None) -> str:
        """The run's last line about it: the best rollout, its value, its checkpoint and its export."""
        if self.rollout_id is None:
            return f"--keep-best: no evaluation gave a finite {self.metric}; nothing kept"
        kept = []
        if save:
            kept.append(f"checkpoint {Path(save) / f'rollout_{self.rollout_id}'}")
        if save_hf:
            kept.append(f"export {best_export_dir(save_hf)}")
        return f"best {self.metric} {self.value:.6g} ({self.mode}) after rollout {self.rollout_id}: {', '.join(kept)}"
