"""Sharded checkpoints of one trainer group (torch.distributed.checkpoint): what a group saves and loads.

A group's state is one dict of ``Stateful`` things (torchtitan's ``CheckpointManager(states=...)``), all in one DCP
save: its trainable modules and optimizer (:class:`ModulesState`, through ``get_state_dict`` / ``set_state_dict``,
so a checkpoint loads into another world size), its EMA when it keeps one, its LR schedule (:class:`SchedulerState`)
and the global RNG states (:class:`RNGState`). The group's ``GroupTrainer`` builds the dict.

Layout, for every group's save directory (the actor's is ``--save``, the critic's the sibling ``<save>_critic``)::

    <dir>/rollout_<id>/dcp/             DCP shards of {"train", "ema", "scheduler", "rng"}
    <dir>/rollout_<id>/data_state.pt    the data cursor (the actor's directory only)
    <dir>/rollout_<id>/metadata.json    {"rollout_id", "role", "world_size", "format_version", ...}; written last
    <save>/latest                       the commit (written by the driver: :mod:`miles.driver.run_dir`)

Each group writes ``.tmp_rollout_<id>`` and renames it to ``rollout_<id>`` when every rank has finished; the driver
commits the rollout once every group has. A checkpoint of another ``FORMAT_VERSION`` is refused with one line.
"""

import copy
import errno
import json
import logging
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from miles.utils.paths import replace_dir
from miles.utils.validation import CheckpointWriteError

__all__ = [
    "DATA_STATE_FILE",
    "FORMAT_VERSION",
    "LATEST_FILE",
    "ModulesState",
    "RNGState",
    "SchedulerState",
    "checkpoint_dir",
    "describe_os_error",
    "load_checkpoint",
    "save_checkpoint",
    "verified_dir",
]

logger = logging.getLogger(__name__)

# 3: the LR schedule and the RNG states joined the DCP state (format 2 kept them in per-rank files).
FORMAT_VERSION = 3
LATEST_FILE = "latest"
METADATA_FILE = "metadata.json"
DATA_STATE_FILE = "data_state.pt"


class ModulesState(Stateful):
    """A group's trainable modules (one ``nn.ModuleDict``) and their optimizer.

    Args:
        keep: which model state entries a checkpoint holds (``"<component>.<name>"`` → bool; the converters' filter,
            :func:`miles.backends.fsdp_utils.converters.keeps_in_checkpoint`); None keeps every entry.
    """

    def __init__(
        self, modules: nn.ModuleDict, optimizer: torch.optim.Optimizer, keep=None, fresh: frozenset[str] = frozenset()
    ) -> None:
        self.modules, self.optimizer, self.keep, self.fresh = modules, optimizer, keep, fresh
        self._built: tuple[dict, dict, list] | None = None

    def state_dict(self) -> dict[str, Any]:
        # get_state_dict gives the optimizer its state entries (a zero-lr step) so a load knows what to read into.
        model_state, optim_state = get_state_dict(self.modules, self.optimizer)
        if self.keep is not None:
            model_state = {key: value for key, value in model_state.items() if self.keep(key)}
        if self.fresh:
            # A load of a checkpoint without these modules (phase 1 -> phase 2's GAN head) reads everything else and
            # keeps their weights and optimizer state as built; the param groups stay this optimizer's (they list
            # the modules' parameters; apply_optimizer_spec sets their settings after the load).
            def built(key: str) -> bool:
                return key.split(".", 1)[0] in self.fresh

            self._built = (
                {key: value for key, value in model_state.items() if built(key)},
                {key: value for key, value in optim_state["state"].items() if built(key)},
                optim_state["param_groups"],
            )
            model_state = {key: value for key, value in model_state.items() if not built(key)}
            optim_state = {
                "state": {key: value for key, value in optim_state["state"].items() if not built(key)},
                "param_groups": copy.deepcopy(optim_state["param_groups"]),
            }
        return {"model": model_state, "optimizer": optim_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._built is not None:
            model_built, optim_built, groups = self._built
            state = {
                "model": {**state["model"], **model_built},
                "optimizer": {"state": {**state["optimizer"]["state"], **optim_built}, "param_groups": groups},
            }
        # Entries a converter leaves out (a frozen base) stay as loaded from --hf-checkpoint.
        options = StateDictOptions(strict=self.keep is None)
        set_state_dict(
            self.modules,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )


class SchedulerState(Stateful):
    """An LR scheduler's state (a ``LambdaLR``'s is its step count and last rates: the same on every rank)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


class RNGState(Stateful):
    """The process's global RNG states (torch, Python, CUDA). Every rank seeds them alike and miles' own draws use
    keyed generators (``make_generator``), so the ranks' states agree and DCP keeps one copy."""

    def state_dict(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(save_dir: str | Path, rollout_id: int) -> Path:
    """``<save_dir>/rollout_<rollout_id>``."""
    return Path(save_dir) / f"rollout_{rollout_id}"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def verified_dir(save_dir: str | Path, rollout_id: int) -> Path:
    """The checkpoint directory of ``rollout_id``, after checking that it is complete and of this ``FORMAT_VERSION``.

    Raises:
        RuntimeError: naming the directory, if it is missing, incomplete or of another format.
    """
    path = checkpoint_dir(save_dir, rollout_id)
    if not path.is_dir():
        raise RuntimeError(f"checkpoint {path} is missing")
    try:
        metadata = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"checkpoint {path} is incomplete or corrupt: cannot read {METADATA_FILE} ({exc})") from exc
    if metadata.get("rollout_id") != rollout_id:
        raise RuntimeError(
            f"checkpoint {path}: {METADATA_FILE} says rollout {metadata.get('rollout_id')}, not {rollout_id}"
        )
    if not (path / "dcp" / ".metadata").is_file():
        raise RuntimeError(f"checkpoint {path} is incomplete or corrupt: dcp/.metadata is missing")
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        raise RuntimeError(
            f"checkpoint {path} has format {version}, and this miles reads format {FORMAT_VERSION} only (the LR "
            "schedule and RNG states moved into the DCP state); resume it with the miles that wrote it, or start afresh"
        )
    return path


def save_checkpoint(
    save_dir: str | Path,
    rollout_id: int,
    states: dict[str, Stateful],
    *,
    role: str,
    data_state: Any = None,
) -> Path:
    """Collective: write this group's checkpoint of ``rollout_id`` (every rank, the same ``save_dir``).

    Writes ``.tmp_rollout_<id>`` and renames it to ``rollout_<id>`` once every rank has finished; ``latest`` is the
    driver's to advance (:func:`miles.driver.run_dir.commit`), after every group has saved.

    Args:
        save_dir: the group's save directory.
        rollout_id: the rollout just finished; a resumed run continues at ``rollout_id + 1``.
        states: the group's ``Stateful`` things by name (``GroupTrainer.states``), saved in one DCP checkpoint.
        role: the group's role, recorded in the metadata.
        data_state: the data cursor, written by rank 0 (the actor group's).

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointWriteError: when the disk is full or the directory unwritable; the temporary directory is removed,
            and no complete checkpoint is touched.
    """
    save_dir = Path(save_dir)
    rank = _rank()
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    tmp = save_dir / f".tmp_rollout_{rollout_id}"
    final = checkpoint_dir(save_dir, rollout_id)
    error: BaseException | None = None
    if rank == 0:
        # A leftover temporary directory is an earlier attempt that crashed before its rename.
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = exc
    if not _any_rank(error is not None):
        try:
            _in_one_or_all_processes(dcp.save, states, tmp / "dcp")
            if rank == 0:
                if data_state is not None:
                    _write(tmp / DATA_STATE_FILE, data_state)
                metadata = {
                    "rollout_id": rollout_id,
                    "role": role,
                    "world_size": world_size,
                    "format_version": FORMAT_VERSION,
                    "saved_at": time.time(),
                }
                with open(tmp / METADATA_FILE, "w") as f:
                    f.write(json.dumps(metadata, indent=2) + "\n")
        # DCP wraps every rank's error in a CheckpointException, a BaseException.
        except (Exception, CheckpointException) as exc:
            error = exc
    # Every rank learns whether any rank failed, so none waits in a barrier for a rank that gave up.
    if _any_rank(error is not None):
        # Before the temporary directory goes: removing it frees the space whose lack may be the cause.
        cause = _cause(error, save_dir) if isinstance(error, (OSError, CheckpointException)) else None
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            raise CheckpointWriteError(
                f"could not save the {role} checkpoint of rollout {rollout_id} to {save_dir}: another rank failed "
                "(its error names the cause); no complete checkpoint was touched"
            )
        if not isinstance(error, (OSError, CheckpointException)):
            raise error
        raise CheckpointWriteError(
            f"could not save the {role} checkpoint of rollout {rollout_id} to {save_dir}: "
            f"{cause}; no complete checkpoint was touched"
        ) from error
    if rank == 0:
        # An existing rollout_<id> was saved before and never committed (a crash after the rename): the complete
        # new copy replaces it.
        replace_dir(tmp, final, save_dir / f".stale_rollout_{rollout_id}")
        logger.debug("saved %s checkpoint of rollout %d to %s", role, rollout_id, final)
    _barrier()
    return final


def _in_one_or_all_processes(fn, states: dict[str, Stateful], path: Path) -> None:
    """``dcp.save`` / ``dcp.load`` over the process group, or in this process alone without one (a group of one,
    a test): that is the intent, so DCP's warning about it is left out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        fn(states, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def _write(path: Path, obj: Any) -> None:
    # A Python file object, so that a full disk raises ENOSPC here (torch's own writer reports a full disk as
    # "unexpected pos N vs M").
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank of the process group (``flag`` itself without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _cause(exc: BaseException, save_dir: str | Path | None = None) -> str:
    """The root cause of an error (DCP wraps each rank's error in a CheckpointException), on one line; a full disk
    is spelled out as "No space left on device", also when a writer reports it in its own words."""
    while True:
        if isinstance(exc, CheckpointException) and exc.failures:
            exc = next(iter(exc.failures.values()))[0]  # (exception, traceback) of the first failed rank
        elif exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            break
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return "No space left on device" + (f" (writing {exc.filename})" if exc.filename else "")
    if save_dir is not None and _disk_full(save_dir):
        return f"No space left on device ({text})"
    return text


def describe_os_error(exc: BaseException, directory: str | Path | None = None) -> str:
    """One line for a failed write into ``directory``: the root cause, a full disk spelled "No space left on
    device"."""
    return _cause(exc, directory)


def _disk_full(path: str | Path) -> bool:
    try:
        return shutil.disk_usage(path).free < 1 << 20
    except OSError:
        return False


def saved_entries(load_dir: str | Path, rollout_id: int) -> set[str]:
    """The flattened state names a group's checkpoint of ``rollout_id`` holds (``train.model.<module>.<param>``,
    ``ema.shadow...``), from its DCP metadata.

    Raises:
        RuntimeError: if the checkpoint is incomplete or its metadata unreadable.
    """
    from torch.distributed.checkpoint import FileSystemReader

    path = verified_dir(load_dir, rollout_id)
    try:
        return set(FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata)
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is a damaged checkpoint
        raise RuntimeError(f"checkpoint {path} is corrupt: {type(exc).__name__}: {exc}") from exc


def load_checkpoint(load_dir: str | Path, rollout_id: int, states: dict[str, Stateful]) -> None:
    """Collective: load this group's checkpoint of ``rollout_id`` into its ``states`` (the same names it saved).

    Raises:
        RuntimeError: if the checkpoint is incomplete, corrupt, of another format, or does not fit the modules.
    """
    path = verified_dir(load_dir, rollout_id)
    try:
        _in_one_or_all_processes(dcp.load, states, path / "dcp")
    # DCP wraps every rank's error in a CheckpointException, a BaseException.
    except (Exception, CheckpointException) as exc:
        raise RuntimeError(f"checkpoint {path} is corrupt or does not fit this model: {_cause(exc)}") from exc
    logger.debug("loaded checkpoint of rollout %d from %s", rollout_id, path)
