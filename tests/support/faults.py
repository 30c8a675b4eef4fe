"""Hooks that break the trainer on purpose, and a driver that kills itself at a chosen point.

The hooks are loaded by dotted path (``tests.support.faults.loss_returns_float``) inside the Ray workers. Each one
wraps the real SFT hook and changes exactly one thing, so a test sees the trainer's reaction to that thing alone.

``python -m tests.support.faults KILL_AT ROLLOUT -- <train_diffusion args>`` runs ``train_diffusion.main`` and
sends itself SIGKILL at ``KILL_AT`` of rollout ``ROLLOUT``: ``during-save`` (the group's save tasks are running;
the driver dies once the workers have started writing) or ``between-saves`` (the first group has saved, the next
has not started). The workers are real; only the moment of the driver's death is chosen.
"""

import errno
import os
import signal
import sys
import time
from pathlib import Path

import torch

from miles.backends.fsdp_utils.loss_hub import sft
from miles.models.base import DENOISER

# -- hooks whose return values are wrong ------------------------------------------------------------------------


def loss_returns_float(ctx, train_pairs, prepared, *, new_pred, metrics):
    return float(sft.sft_loss_formula(ctx, train_pairs, prepared, new_pred=new_pred, metrics=metrics).detach())


def loss_raises(ctx, train_pairs, prepared, *, new_pred, metrics):
    raise ValueError(f"my loss cannot handle rollout {ctx.rollout_id}")


def prepare_returns_dict(ctx, train_pairs):
    return vars(sft.prepare_sft_batch(ctx, train_pairs))


def train_input_drops_a_pair(ctx, train_pairs):
    return train_pairs[:-1]


def converter_drops_a_pair(args, samples):
    from miles.ray.data_conversion_hub.sft import expand_samples_to_train_pairs

    return expand_samples_to_train_pairs(args, samples)[:-1]


def output_exits(ctx, train_pairs):
    """Train-output hook: the rank's process exits with code 3 (a crash that is not an exception)."""
    sys.exit(3)


def output_fills_save_hf(ctx, train_pairs):
    """Train-output hook: someone puts their own file where ``--save-hf`` will export, while the run trains."""
    target = Path(ctx.args.save_hf)
    target.mkdir(parents=True, exist_ok=True)
    (target / "notes.txt").write_text("my notes, not a pipeline\n")


# -- faults of the run ------------------------------------------------------------------------------------------


def nan_weight_at_rollout_2(ctx, train_pairs):
    """Prepare hook: from rollout 2 on, one weight of the student is NaN (as a bad update would leave it)."""
    if ctx.rollout_id >= 2:
        with torch.no_grad():
            param = next(ctx.models[DENOISER].parameters())
            local = param.to_local() if hasattr(param, "to_local") else param
            local.view(-1)[0] = float("nan")
    return sft.prepare_sft_batch(ctx, train_pairs)


class _FullDisk:
    """A tiny quota on writes under one directory: a write past it fails with ENOSPC, as on a full disk."""

    def __init__(self, root: Path, quota: int) -> None:
        self.root, self.quota, self.used = str(root), quota, 0

    def wrap(self, opener):
        def open_with_quota(file, mode="r", *args, **kwargs):
            handle = opener(file, mode, *args, **kwargs)
            if any(flag in mode for flag in "wax") and os.path.abspath(str(file)).startswith(self.root):
                return _QuotaFile(handle, self)
            return handle

        return open_with_quota


class _QuotaFile:
    def __init__(self, handle, disk: _FullDisk) -> None:
        self._handle, self._disk = handle, disk

    def write(self, data):
        self._disk.used += len(data)
        if self._disk.used > self._disk.quota:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._handle.write(data)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()


def fill_disk_after_rollout_0(ctx, train_pairs):
    """Train-output hook: from rollout 1 on, the ``--save`` directory's disk holds only 4 KiB more (every Python
    file write in this worker process counts against it), so the next checkpoint fails with ENOSPC."""
    import builtins
    import io

    if ctx.rollout_id == 1 and not getattr(builtins, "_miles_full_disk", False):
        disk = _FullDisk(Path(ctx.args.save).resolve(), quota=4096)
        builtins.open = disk.wrap(builtins.open)
        io.open = disk.wrap(io.open)
        builtins._miles_full_disk = True
    return None


# -- a driver that dies at a chosen point -----------------------------------------------------------------------


def _kill_self() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def run_killed(kill_at: str, rollout: int, argv: list[str]) -> None:
    """Run ``train_diffusion.main(argv)``; SIGKILL this process at ``kill_at`` of rollout ``rollout``."""
    from miles.ray.actor_group import RayTrainGroup

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import train_diffusion

    original = RayTrainGroup.async_save
    saves = []

    def async_save(group, rollout_id, data_state=None):
        if rollout_id == rollout:
            saves.append(group.role)
            if kill_at == "between-saves" and len(saves) == 2:
                _kill_self()  # the first group's checkpoint is complete, this one's not started
        refs = original(group, rollout_id, data_state)
        if rollout_id == rollout and kill_at == "during-save" and group.role == "actor":
            # Die once the workers are writing (their temporary directory exists), or right after if they finished.
            tmp = Path(group.spec.checkpoint.save) / f".tmp_rollout_{rollout_id}"
            final = Path(group.spec.checkpoint.save) / f"rollout_{rollout_id}"
            deadline = time.monotonic() + 30
            while not (tmp.exists() or final.exists()) and time.monotonic() < deadline:
                time.sleep(0.001)
            _kill_self()
        return refs

    RayTrainGroup.async_save = async_save
    train_diffusion.main(argv)


if __name__ == "__main__":
    separator = sys.argv.index("--")
    run_killed(sys.argv[1], int(sys.argv[2]), sys.argv[separator + 1 :])
