"""What the driver prints: one progress bar per run with the rollout's key figures, and a few event lines.

Per-step records go to ``metrics.jsonl`` (and wandb), not to the console; ``--log-level DEBUG`` brings the workers'
own log lines back.
"""

import logging
import math
from typing import Any

from tqdm import tqdm

__all__ = ["RolloutProgress", "log_groups_ready"]

logger = logging.getLogger("train_diffusion")

# The bar's postfix: (metric key, short name), shown when the rollout logged it.
POSTFIX = (
    ("train/loss", "loss"),
    ("train/critic-loss", "critic"),
    ("train/dmd2_grad_abs_mean", "|g|"),
    ("perf/step_time", "s/rollout"),
)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def log_groups_ready(groups: dict, engines: Any, seconds: float) -> None:
    """One line per trainer group (ranks, device, torch threads per rank, parameters) and for the engine replicas,
    once all started. The threads are the CPUs of a rank's bundle (``--num-cpus-per-rank``, default a node's CPUs
    over its ranks): ranks × threads above the machine's cores makes the ranks' thread pools compete
    (docs/performance.md, "Threads per rank")."""
    for role, group in groups.items():
        info = group.describe()
        logger.info(
            "%s group: %d ranks on %s, %d torch thread%s per rank, %.2fM trainable + %.2fM frozen parameters%s",
            role,
            group.world_size,
            info["device"],
            info["threads"],
            "" if info["threads"] == 1 else "s",
            info["trainable_parameters"] / 1e6,
            info["frozen_parameters"] / 1e6,
            ", FSDP-sharded" if info["sharded"] else "",
        )
    if engines is not None:
        threads = engines.num_threads
        logger.info(
            "rollout: %d dedicated engine replicas, %s torch thread%s each",
            len(engines.engines),
            threads or "default",
            "" if threads == 1 else "s",
        )
    logger.info("ready in %.0fs", seconds)


class RolloutProgress:
    """A tqdm bar over the run's rollouts whose postfix shows the last rollout's key figures; ``note`` prints an
    event line above it (a save, an evaluation) without breaking the bar."""

    def __init__(self, args, start_rollout_id: int) -> None:
        self.bar = tqdm(
            total=args.num_rollout,
            initial=start_rollout_id,
            desc="rollout",
            dynamic_ncols=True,
            mininterval=1.0,
        )

    @staticmethod
    def format(metrics: dict[str, Any]) -> str:
        return " ".join(f"{key.split('/', 1)[-1]}={_fmt(value)}" for key, value in metrics.items())

    def update(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        shown = {name: _fmt(metrics[key]) for key, name in POSTFIX if key in metrics}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)

    def note(self, line: str) -> None:
        self.bar.write(line)

    def close(self) -> None:
        self.bar.close()
