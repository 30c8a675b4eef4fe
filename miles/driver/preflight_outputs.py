"""Preflight of the outputs: every directory the run writes takes files, holds room for its checkpoints, and does
not hold another run's checkpoints.

Run by the driver before Ray starts (:func:`miles.driver.preflight.validate_inputs`, :func:`check_outputs`).
Writability is probed by creating and removing one file where each output is (or would be created), so nothing is
left behind. The space estimate per checkpoint of a group is its denoiser's parameters (from the safetensors headers)
× 4 bytes × (weights + AdamW's two moments + the EMA when kept), 5% over for the metadata and extra modules; the
export is the student's denoiser in float32, plus the whole pipeline when it cannot hard-link across filesystems.
"""

import argparse
import logging
import math
import os
import shutil
from pathlib import Path

from miles.config import GroupSpec
from miles.models.base import DENOISER
from miles.utils.paths import nearest_existing, path_relation, probe_writable
from miles.utils.validation import reject

__all__ = ["check_disk_space", "check_outputs", "denoiser_numel", "estimate_needs"]

logger = logging.getLogger(__name__)

MB = 1 << 20


def check_outputs(args: argparse.Namespace, groups: list[GroupSpec], pipelines: list[tuple[str, str]]) -> None:
    """Every directory the run writes (each group's ``--save``, ``--output-dir``, ``--save-hf``, ``--profile-dir``
    when traces are asked for) is a directory (or can be created) and takes new files, and none is or lies inside
    one of the ``pipelines`` the groups load (checkpoints written into the teacher's directory would fill it); no
    ``--save`` holds another run's checkpoints (:func:`_check_save_dirs`); the first save fits on its filesystem
    (:func:`check_disk_space`).

    Raises:
        ArgumentValidationError: naming the flag, the path and why not.
    """
    from miles.driver.validators import group_paths

    outputs = group_paths(args, ("save",), groups)
    if args.output_dir:
        outputs.append(("--output-dir", args.output_dir))
    if args.save_hf:
        outputs.append(("--save-hf", args.save_hf))
    if args.profile_dir and args.profile_rollouts is not None:
        outputs.append(("--profile-dir", args.profile_dir))
    for name, path in outputs:
        for pipeline_flag, pipeline in pipelines:
            relation = path_relation(path, pipeline)
            # --save-hf has its own rules (check_export_target); a directory that contains a pipeline is harmless.
            if relation in ("is", "lies inside") and name != "--save-hf":
                what = "is also" if relation == "is" else relation
                reject(f"{name} {path} {what} {pipeline_flag} {pipeline}, a pipeline the run reads; pick a directory "
                       "outside it")  # fmt: skip
        if os.path.exists(path) and not os.path.isdir(path):
            reject(f"{name} {path} is a file; pass a directory")
        problem = probe_writable(path)
        if problem is not None:
            reject(f"{name} {path} is not writable: {problem}")
    _check_save_dirs(args, groups)
    check_disk_space(args, groups)


def denoiser_numel(pipeline: str) -> int:
    """Parameters of the pipeline's denoiser, from its safetensors headers (0 when it has none)."""
    from miles.driver.preflight_data import safetensors_header

    total = 0
    for path in sorted((Path(pipeline) / DENOISER).glob("*.safetensors")):
        for key, info in safetensors_header(path).items():
            if key != "__metadata__":
                total += math.prod(info["shape"])
    return total


def _check_save_dirs(args: argparse.Namespace, groups: list[GroupSpec]) -> None:
    """``--save`` into a directory holding checkpoints (``latest``, ``rollout_*``) of another run needs ``--load``
    of that directory (a resume) or ``--overwrite-save``; a run never mixes its checkpoints with another's.

    Raises:
        ArgumentValidationError: naming the directory and its entries.
    """
    from miles.backends.fsdp_utils.checkpoint import LATEST_FILE
    from miles.driver.run_dir import checkpoint_entries

    if not args.save or args.overwrite_save:
        return
    resuming = args.load and os.path.realpath(args.load) == os.path.realpath(args.save)
    if resuming:
        return
    for group in groups:
        role, save = group.role, group.checkpoint.save
        if not save:
            continue  # a frozen group (the DMD2 reward group) saves nothing
        entries = [name for name in checkpoint_entries(save) if not name.startswith(".")]
        if not entries:
            continue
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        where = "--save" if role == "actor" else f"the {role} group's --save"
        has_commit = os.path.isfile(os.path.join(args.save, LATEST_FILE))
        if has_commit:
            fix = f"resume it with --load {args.save}, or add --overwrite-save to remove them"
        elif role == "actor" and not os.path.isfile(os.path.join(save, LATEST_FILE)):
            # Another run's commit may live elsewhere: a directory X_critic holds the critic group of run X.
            fix = (
                "they may be another group's checkpoints of a run whose commit lives in a sibling directory (X_critic "
                "belongs to the run saved in X); add --overwrite-save only if they are no run's"
            )
        else:
            fix = "add --overwrite-save to remove them (none is committed, so there is nothing to resume)"
        reject(f"{where} {save} holds checkpoints of another run ({shown}); {fix}, or pick a new --save")


def estimate_needs(args: argparse.Namespace, groups: list[GroupSpec] | None = None) -> dict[int, dict]:
    """Bytes the run writes per filesystem: ``{st_dev: {"one": one save of every group (and the export), "all": the
    run's peak, "paths": [flags]}}``; ``groups``: the run's (default: :func:`~miles.driver.validators.group_layout`).
    """
    from miles.driver.schedule import should_save
    from miles.driver.validators import group_layout

    needs: dict[int, dict] = {}

    def add(name: str, path: str, one: int, total: int) -> None:
        device = os.stat(nearest_existing(path)).st_dev
        entry = needs.setdefault(device, {"one": 0, "all": 0, "paths": [], "free_at": str(nearest_existing(path))})
        entry["one"] += one
        entry["all"] += total
        entry["paths"].append(f"{name} {path}")

    if args.save:
        start = 0
        if args.load:
            from miles.driver.run_dir import read_latest

            start = read_latest(args.load) + 1
        saves = sum(1 for rollout in range(start, args.num_rollout) if should_save(args, rollout))
        kept = saves
        if args.save_keep_last:
            spared = 0
            if args.save_keep_every:
                spared = sum(1 for r in range(start, args.num_rollout) if (r + 1) % args.save_keep_every == 0)
            kept = min(saves, args.save_keep_last + 1 + spared)
        for group in group_layout(args) if groups is None else groups:
            if not group.checkpoint.save:
                continue
            copies = 3 + (1 if group.ema is not None else 0)
            size = int(denoiser_numel(group.init) * 4 * copies * 1.05)
            where = "--save" if group.role == "actor" else f"the {group.role} group's --save"
            add(where, group.checkpoint.save, size, size * kept)
    if args.save_hf:
        size = denoiser_numel(args.hf_checkpoint) * 4
        same_fs = os.stat(nearest_existing(args.save_hf)).st_dev == os.stat(args.hf_checkpoint).st_dev
        if not same_fs:
            # Nothing can be hard-linked: the export copies the whole pipeline.
            size += sum(f.stat().st_size for f in Path(args.hf_checkpoint).rglob("*") if f.is_file())
        add("--save-hf", args.save_hf, size, size)
    return needs


def check_disk_space(args: argparse.Namespace, groups: list[GroupSpec] | None = None) -> None:
    """Refuse a run whose first save (or export) cannot fit on its filesystem; warn when the run's checkpoints, at
    their peak, may not.

    Raises:
        ArgumentValidationError: naming the paths, the free and the needed space.
    """
    for entry in estimate_needs(args, groups).values():
        free = shutil.disk_usage(entry["free_at"]).free
        paths = ", ".join(entry["paths"])
        if free < entry["one"]:
            reject(
                f"{paths}: {free / MB:.1f} MB free on its filesystem, but one checkpoint needs about "
                f"{entry['one'] / MB:.1f} MB; free space or pick another directory"
            )
        if free < entry["all"]:
            logger.warning(
                "%s: %.1f MB free, but the run's checkpoints need about %.1f MB at their peak; the disk may fill "
                "(--save-keep-last N bounds them)",
                paths,
                free / MB,
                entry["all"] / MB,
            )
