"""What a resume continues: the run record kept with each checkpoint, and what the driver checks and says with it.

Every save commits, beside the groups' checkpoints, ``<save>/rollout_<id>/run.json``: the method (``--loss-type``),
the flags a resume may change (the optimizers' and schedules' settings, the run's length, the batch, the step grid,
the teacher's guidance scale, the EMA's decay), what each trainer group's checkpoint holds (its LoRA's rank, alpha
and target modules, whether it keeps an EMA, the modules its builder adds: the DMD2 GAN head), the wandb run id and,
with ``--keep-best``, the best evaluation so far. A resume (``--load``) reads the record of the committed rollout and

- refuses another method's checkpoint before Ray starts (an ``sft_loss`` run would otherwise load a DMD2 student,
  its optimizer and a data cursor of another file, without a word);
- refuses, before Ray starts and on one line naming the flag and both values, a command whose groups the checkpoint
  cannot fill: another LoRA rank, alpha (which would silently rescale the learned update) or target modules, LoRA
  where the checkpoint holds full weights or the reverse, and a ``--prompt-data`` shorter than the saved prompt
  cursor (:func:`check_data_cursor`);
- names what the command adds and the checkpoint lacks, which the trainers start fresh: phase 1 -> phase 2 (a GAN
  head and an EMA on a phase-1 checkpoint; ``GroupTrainer.load``, docs/dmd2.md);
- lists, on one line, the settings this command changes; the trainer applies them after loading
  (``miles.backends.fsdp_utils.optimizer.apply_optimizer_spec``), the others (batch, step grid, guidance) are the
  command's own from the first resumed rollout;
- continues the same wandb run (its id is in the record);
- continues ``--keep-best`` from the best value the record names (:mod:`miles.driver.keep_best`).

Checkpoints written before the record existed resume as before (nothing to compare), except that a command is
refused when a sibling ``<load>_<suffix>`` holds the committed rollout of a group this command does not have (a
DMD2 run's ``<load>_critic`` under an ``sft_loss`` command).
"""

import argparse
import json
import os
from pathlib import Path
from typing import Any

from miles.config import GroupSpec, hook_name
from miles.methods import get_method
from miles.utils.validation import flag, reject

__all__ = [
    "RUN_RECORD",
    "changed_settings",
    "check_data_cursor",
    "check_resume",
    "group_record",
    "read_run_record",
    "resumable_settings",
    "resumed_line",
    "run_record",
    "started_fresh",
    "write_run_record",
]

RUN_RECORD = "run.json"
FORMAT = 1


def resumable_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags a resume may change, by dest: the optimizers' and schedules' settings (the trainer applies the new
    values after loading the checkpoint), the run's length, the batch, the student's step grid, the trainer's flow
    shift, the critic's steps, the teacher's guidance scale and the EMA's decay and dropout of the LoRA (the command's
    own from the first resumed rollout). JSON values: a tuple becomes a list."""
    return {
        "lr": args.lr,
        "critic_lr": args.critic_lr,
        "min_lr": args.min_lr,
        "lr_warmup_steps": args.lr_warmup_steps,
        "lr_decay_style": args.lr_decay_style,
        "adam_beta1": args.adam_beta1,
        "adam_beta2": args.adam_beta2,
        "adam_eps": args.adam_eps,
        "weight_decay": args.weight_decay,
        "clip_grad": args.clip_grad,
        "num_rollout": args.num_rollout,
        "rollout_batch_size": args.rollout_batch_size,
        "n_samples_per_prompt": args.n_samples_per_prompt,
        "micro_batch_size": args.micro_batch_size,
        "num_steps_per_rollout": args.num_steps_per_rollout,
        "diffusion_num_steps": args.diffusion_num_steps,
        "diffusion_timesteps": list(args.diffusion_timesteps) if args.diffusion_timesteps else None,
        "diffusion_flow_shift": args.diffusion_flow_shift,
        "fsdp_flow_shift": args.fsdp_flow_shift,
        "dmd2_critic_steps_per_rollout": args.dmd2_critic_steps_per_rollout,
        "dmd2_teacher_guidance_scale": args.dmd2_teacher_guidance_scale,
        "ema_decay": args.ema_decay,
        "lora_dropout": args.lora_dropout,
    }


def group_record(spec: GroupSpec) -> dict[str, Any]:
    """What a trainer group's checkpoint holds, as the run record keeps it: ``{"lora": {"rank", "alpha",
    "target_modules"} or None (full weights), "ema": bool, "modules": [the module builder's name] or []}``."""
    lora = None
    if spec.lora is not None:
        lora = {"rank": spec.lora.rank, "alpha": spec.lora.alpha, "target_modules": list(spec.lora.target_modules)}
    modules = [hook_name(spec.hooks.build_modules)] if spec.hooks.build_modules is not None else []
    return {"lora": lora, "ema": spec.ema is not None, "modules": modules}


def _groups(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """:func:`group_record` of every trainer group that loads a model (a frozen group checkpoints nothing), by role."""
    from miles.driver.validators import group_layout

    return {spec.role: group_record(spec) for spec in group_layout(args) if spec.init}


def run_record(
    args: argparse.Namespace, rollout_id: int, wandb_run_id: str | None, best: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The record a save of ``rollout_id`` commits: ``{"format", "rollout_id", "method", "settings": {dest: value},
    "groups": {role: group_record}, "wandb_run_id"}`` (``method``: the ``--loss-type``), and with ``--keep-best``
    ``"keep_best"``: the best evaluation so far (:meth:`miles.driver.keep_best.KeepBest.state`)."""
    settings = resumable_settings(args)
    record = {
        "format": FORMAT,
        "rollout_id": rollout_id,
        "method": get_method(args).name,
        "settings": settings,
        "groups": _groups(args),
        "wandb_run_id": wandb_run_id,
    }
    if best is not None:
        record["keep_best"] = best
    return record


def _record_path(directory: str | os.PathLike, rollout_id: int) -> Path:
    return Path(directory) / f"rollout_{rollout_id}" / RUN_RECORD


def write_run_record(save_dir: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Write ``record`` into the actor's checkpoint of its rollout (temporary file, fsync, rename), before the
    driver commits that rollout."""
    path = _record_path(save_dir, record["rollout_id"])
    tmp = path.with_name(f".{RUN_RECORD}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(record, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_run_record(load_dir: str | os.PathLike, rollout_id: int) -> dict[str, Any] | None:
    """The run record of checkpoint ``rollout_id`` in ``load_dir``, or None for a checkpoint written without one.

    Raises:
        ValueError: naming the file, when it is not a JSON object.
    """
    path = _record_path(load_dir, rollout_id)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} holds {type(record).__name__}, not the run record's JSON object")
    return record


def check_resume(args: argparse.Namespace, rollout_id: int) -> dict[str, Any] | None:
    """Refuse a ``--load`` of another method's checkpoint, or one whose groups this command cannot load
    (:func:`check_groups`); return its run record (None when it has none).

    Raises:
        ArgumentValidationError: naming ``--load``, both methods (or the flag and both values) and the fix.
        ValueError: naming the file, for a run record that is not a JSON object.
    """
    method = get_method(args).name
    record = read_run_record(args.load, rollout_id)  # a damaged record: a ValueError, the preflight offers another
    if record is not None:
        saved = record.get("method")
        if saved != method:
            reject(
                f"--load {args.load} holds a --loss-type {saved} checkpoint (rollout {rollout_id}) but this command "
                f"is --loss-type {method}; resume it with --loss-type {saved}, or start the {method} run from an "
                "exported pipeline (--hf-checkpoint) with a new --save"
            )
        check_groups(args, record, rollout_id)
        return record
    from miles.driver.validators import group_layout

    roles = {group.role for group in group_layout(args)}
    for sibling, role in _sibling_groups(args.load, rollout_id):
        if role not in roles:
            reject(
                f"--load {args.load} has a {role} group's checkpoint beside it ({sibling}) that --loss-type {method} "
                "does not load; resume it with the --loss-type that saved it, or start from an exported pipeline "
                "(--hf-checkpoint)"
            )
    return None


# The flags that set a group's LoRA, by role (the critic's are the --critic-lora-* twins).
_LORA_PREFIX = {"actor": "--", "critic": "--critic-"}


def _lora_text(lora: dict[str, Any] | None, key: str) -> str:
    if lora is None:
        return "0 (full weights)" if key == "rank" else "unset (full weights)"
    value = lora[key]
    return ",".join(value) if key == "target_modules" else f"{value:g}"


def check_groups(args: argparse.Namespace, record: dict[str, Any], rollout_id: int) -> None:
    """Refuse a resume whose trainer groups the checkpoint ``record`` describes cannot fill: a LoRA of another rank,
    alpha or target modules, LoRA ↔ full weights. An EMA or a built module (the GAN head) it lacks starts fresh
    (:func:`started_fresh`). A record without ``"groups"`` (written before they were kept) is not checked.

    Raises:
        ArgumentValidationError: one line naming the flag, the checkpoint's value and this command's.
    """
    saved_groups = record.get("groups")
    if not isinstance(saved_groups, dict):
        return
    where = f"--load {args.load} (rollout {rollout_id})"
    # The actor first: the critic's LoRA flags default to the student's, so the flag the user changed is named.
    for role, now in sorted(_groups(args).items(), key=lambda item: item[0] != "actor"):
        saved = saved_groups.get(role)
        if not isinstance(saved, dict):
            continue
        prefix = _LORA_PREFIX.get(role, "--")
        old_lora, new_lora = saved.get("lora"), now["lora"]
        for key in ("rank", "alpha", "target_modules"):
            old, new = _lora_text(old_lora, key), _lora_text(new_lora, key)
            if old != new:
                name = f"{prefix}lora-{key.replace('_', '-')}"
                if (old_lora is None) != (new_lora is None):
                    held, kind = ("full weights", "a LoRA adapter") if new_lora else ("a LoRA adapter", "full weights")
                    reject(
                        f"{name} {new}: {where} holds the {role} group as {held} ({name} {old}), this command trains "
                        f"{kind}; resume with {name} {old}, or start a new run from the exported student "
                        "(--hf-checkpoint) with a new --save"
                    )
                reject(
                    f"{name} {new}: {where} holds the {role} group's adapter trained with {name} {old}; a new "
                    f"{key.replace('_', ' ')} would not fit it (or, for alpha, rescale what it learned): resume with "
                    f"{name} {old}"
                )


def check_data_cursor(args: argparse.Namespace, rollout_id: int, data_state: Any) -> None:
    """Refuse a ``--prompt-data`` with fewer records than the checkpoint's prompt cursor has read in its epoch
    (``data_state``: the rollout manager's saved state, or None), which the rollout manager would refuse after Ray
    started. A file as long or longer resumes (the cursor then indexes another order: the same file is the exact
    resume).

    Raises:
        ArgumentValidationError: naming ``--prompt-data``, its record count, ``--load`` and the cursor.
    """
    try:
        cursor = int(data_state["data_source"]["cursor"])
        with open(args.prompt_data, "rb") as f:
            records = sum(1 for line in f if line.strip())
    except (TypeError, KeyError, ValueError, OSError):
        return  # no cursor saved, or no file to count: the data preflight names a missing file
    if records < cursor:
        reject(
            f"--prompt-data {args.prompt_data} holds {records} records, but --load {args.load} (rollout {rollout_id}) "
            f"had read {cursor} of its prompt file's epoch; resume with the same --prompt-data, or start a new run"
        )


def started_fresh(args: argparse.Namespace, record: dict[str, Any] | None) -> list[str]:
    """What this command adds that the checkpoint ``record`` describes lacks, which the trainers start fresh (phase
    1 -> phase 2, docs/dmd2.md): e.g. ``["the critic group's GAN head (--dmd2-gan-disc-weight)", "the actor group's
    EMA (--ema-decay)"]``; [] for a record without ``"groups"``."""
    saved_groups = (record or {}).get("groups")
    if not isinstance(saved_groups, dict):
        return []
    started = []
    for role, now in sorted(_groups(args).items(), key=lambda item: item[0] != "actor"):
        saved = saved_groups.get(role)
        if not isinstance(saved, dict):
            continue
        for name in now["modules"]:
            if name not in (saved.get("modules") or []):
                gan = name.endswith(".build_discriminator")
                what = "GAN head (--dmd2-gan-disc-weight)" if gan else f"modules of {name}"
                started.append(f"the {role} group's {what}")
        if now["ema"] and not saved.get("ema"):
            started.append(f"the {role} group's EMA (--ema-decay)")
    return started


def _sibling_groups(load: str, rollout_id: int) -> list[tuple[Path, str]]:
    """``(checkpoint, role)`` of the other groups' checkpoints of ``rollout_id`` beside ``load`` (``<load>_<x>``)."""
    base = Path(os.path.normpath(load))
    found = []
    for sibling in sorted(base.parent.glob(f"{base.name}_*")):
        metadata = sibling / f"rollout_{rollout_id}" / "metadata.json"
        try:
            role = json.loads(metadata.read_text()).get("role")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(role, str):
            found.append((metadata.parent, role))
    return found


def changed_settings(args: argparse.Namespace, record: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """``(flag, the checkpoint's value, this command's)`` of every resumable setting this command changes."""
    if not record:
        return []
    saved = record.get("settings") or {}
    now = resumable_settings(args)
    return [(flag(dest), saved[dest], value) for dest, value in now.items() if dest in saved and saved[dest] != value]


def resumed_line(args: argparse.Namespace, start: int, roles: list[str], record: dict[str, Any] | None) -> list[str]:
    """The driver's lines about a resume: where it continues and which groups it loaded, then (when any) the
    settings it changes, e.g. ``resumed at rollout 10 (actor + critic) from --load ckpt`` and ``resume changes
    --lr 0.0001 -> 0.0002, --weight-decay 0.0 -> 0.01; the new values apply from rollout 10``."""
    lines = [f"resumed at rollout {start} ({' + '.join(roles)}) from --load {args.load}"]
    started = started_fresh(args, record)
    if started:
        lines.append(
            f"resume starts fresh what the checkpoint lacks (phase 1 -> phase 2): {', '.join(started)}; a side input "
            "new to the run (the GAN head's real data) reads from its first record"
        )
    changes = changed_settings(args, record)
    if changes:
        listed = ", ".join(f"{name} {old} -> {new}" for name, old, new in changes)
        lines.append(f"resume changes {listed}; the new values apply from rollout {start}")
    return lines
