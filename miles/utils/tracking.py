"""Metrics logging: always a JSONL file in the run directory, plus Weights & Biases with ``--use-wandb``.

One process logs a run: the driver. The trainer groups hand their per-step metrics (averaged over the DP ranks) and
timers back with each rollout's train result, so one job is one ``metrics.jsonl`` and one wandb run. Each record is
appended as one whole line (one ``write`` on an ``O_APPEND`` descriptor).
"""

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsTracker", "METRICS_FILE", "VIDEO_MEDIA_SUFFIXES", "drop_records_from", "read_metrics"]

logger = logging.getLogger(__name__)

# Media files sent to wandb as wandb.Video rather than wandb.Image (a video family's animations, miles.eval.video)
VIDEO_MEDIA_SUFFIXES = (".gif", ".mp4", ".webm")

METRICS_FILE = "metrics.jsonl"


def _to_number(value: Any) -> Any:
    """Tensors and numpy scalars become python floats; NaN/inf become strings so the line stays valid JSON."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsTracker:
    """One process's metrics writer.

    Args:
        args: reads ``output_dir`` and ``use_wandb``; with wandb, ``wandb_project``, ``wandb_run_name`` and
            ``wandb_mode`` (``"offline"`` unless the user asks for ``"online"``).
        job: who logs, e.g. ``"driver"`` or a trainer role; written into every record and the wandb ``job_type``.
        wandb_run_id: continue this wandb run (a resume: the id its checkpoint kept); None starts a new run.

    Each record is ``{"job": job, "rollout_id": step, "time": unix seconds, **metrics}``. ``wandb_run_id`` is the
    wandb run's id (None without ``--use-wandb``); the driver keeps it with every checkpoint.
    """

    def __init__(self, args, job: str, wandb_run_id: str | None = None) -> None:
        self.job = job
        self.path = Path(args.output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._wandb_run = None
        self.wandb_run_id: str | None = None
        if args.use_wandb:
            self._wandb_run = self._init_wandb(args, job, wandb_run_id)
            self.wandb_run_id = self._wandb_run.id

    @staticmethod
    def _init_wandb(args, job: str, run_id: str | None):
        import wandb

        mode = args.wandb_mode or "offline"
        run = wandb.init(
            # A resume names the run whose id its checkpoint kept ("allow": continue it, or create it offline).
            id=run_id,
            resume="allow" if run_id else None,
            project=args.wandb_project,
            group=Path(args.output_dir).resolve().name,
            job_type=job,
            name=args.wandb_run_name or Path(args.output_dir).resolve().name,
            dir=str(args.output_dir),
            mode=mode,
            config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
            reinit="create_new",
        )
        # Several optimizer windows log per rollout; key every chart on the rollout id rather than wandb's counter.
        run.define_metric("rollout_id")
        run.define_metric("*", step_metric="rollout_id")
        return run

    def log(self, metrics: dict[str, Any], rollout_id: int, images: dict[str, str] | None = None) -> None:
        """Append one record for ``rollout_id``; values may be floats, ints or 0-d tensors.

        ``images`` maps a key to a PNG path, or a ``.gif`` / ``.mp4`` / ``.webm`` animation (a video family's eval,
        :mod:`miles.eval.video`): the record stores the path, wandb receives the picture as media
        (``wandb.Image``; ``wandb.Video`` for an animation).
        """
        record = {"job": self.job, "rollout_id": int(rollout_id), "time": round(time.time(), 3)}
        record.update({key: _to_number(value) for key, value in metrics.items()})
        record.update({key: str(path) for key, path in (images or {}).items()})
        line = json.dumps(record) + "\n"
        # One os.write on an O_APPEND descriptor: concurrent writers append whole lines.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        if self._wandb_run is not None:
            payload = {key: value for key, value in record.items() if key not in ("job", "time")}
            if images:
                import wandb

                payload.update(
                    {
                        key: (wandb.Video if Path(path).suffix.lower() in VIDEO_MEDIA_SUFFIXES else wandb.Image)(
                            str(path)
                        )
                        for key, path in images.items()
                    }
                )
            self._wandb_run.log(payload)
        # Records go to the file and wandb; the console shows the progress bar (--log-level DEBUG shows them too).
        logger.debug("%s rollout %d: %s", self.job, rollout_id, _format(metrics))

    def finish(self) -> None:
        """Close the wandb run, if any (the JSONL file needs no closing)."""
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.finish()
            self._wandb_run = None
            # finish() returns once the service took the last records; teardown waits until it wrote them, so the
            # run's files are complete when the job ends (an offline run read back at once, a sync right after).
            wandb.teardown()


def _format(metrics: dict[str, Any]) -> str:
    parts = []
    for key, value in metrics.items():
        value = _to_number(value)
        parts.append(f"{key}={value:.6g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``<output_dir>/metrics.jsonl`` in file order (``[]`` when the file does not exist)."""
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _free_sibling(path: Path, label: str) -> Path:
    """``metrics.<label>.jsonl`` beside ``path``, or ``metrics.<label>.<n>.jsonl`` with the first free ``n``."""
    candidate = path.with_name(f"{path.stem}.{label}{path.suffix}")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}.{label}.{n}{path.suffix}")
        n += 1
    return candidate


def drop_records_from(output_dir: str | Path, first_rollout: int) -> tuple[int, Path | None]:
    """Move the records of rollouts ``>= first_rollout`` out of ``<output_dir>/metrics.jsonl``: a resume at
    ``first_rollout`` logs them again, and a rollout must not appear twice. Nothing is deleted: the moved lines go
    to ``metrics.before-resume-<first_rollout>.jsonl`` beside it (they may be another run's, when two runs share an
    ``--output-dir``). The file is rewritten atomically (a temporary sibling, then ``os.replace``); a line that is
    not JSON (a crash mid-write) is moved too.

    Returns:
        ``(lines moved, the file they went to)``; ``(0, None)`` when nothing moved or the file does not exist.
    """
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return 0, None
    kept, moved = [], []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            line = line if line.endswith("\n") else line + "\n"
            try:
                keep = int(json.loads(line).get("rollout_id", -1)) < first_rollout
            except (ValueError, TypeError, AttributeError):
                keep = False
            (kept if keep else moved).append(line)
    if not moved:
        return 0, None
    aside = _free_sibling(path, f"before-resume-{first_rollout}")
    aside.write_text("".join(moved))
    tmp = path.with_name(f".{METRICS_FILE}.tmp")
    with open(tmp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(moved), aside


def move_aside_earlier_metrics(output_dir: str | Path) -> Path | None:
    """A run that does not resume starts its own ``metrics.jsonl``: an earlier run's file in the same
    ``--output-dir`` is renamed to ``metrics.earlier.jsonl`` (or ``metrics.earlier.<n>.jsonl``), never appended to
    or deleted. Returns the new name, or None when there was no such file."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file() or path.stat().st_size == 0:
        return None
    aside = _free_sibling(path, "earlier")
    os.rename(path, aside)
    return aside
