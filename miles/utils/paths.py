"""Filesystem checks shared by the preflight and the writers: how two paths relate, whether a directory takes new
files, and what an export may replace.

The rule they serve: no command deletes or overwrites a file it did not create for this run. An export
(``--save-hf``) replaces only a pipeline directory, only with ``--overwrite-save-hf``, and only when every entry in
it is one the export writes again; it never sits in, over or under a directory the run reads or writes.
"""

import os
import shutil
from pathlib import Path

from miles.utils.validation import reject

__all__ = [
    "link_or_copy",
    "KEEP_BEST_FILE",
    "LORA_EXPORT_DIR",
    "check_export_target",
    "nearest_existing",
    "path_relation",
    "probe_writable",
    "replace_dir",
]

# What marks a diffusers pipeline directory.
MODEL_INDEX = "model_index.json"
# What a --keep-best export records about itself (miles.driver.keep_best), written with the pipeline.
KEEP_BEST_FILE = "keep_best.json"
# The adapter's subdirectory of a --save-hf-lora export (miles.backends.fsdp_utils.export), and the file diffusers'
# ``save_lora_weights`` writes into it.
LORA_EXPORT_DIR = "lora"
LORA_EXPORT_WEIGHTS = "pytorch_lora_weights.safetensors"


def path_relation(path: str | os.PathLike, other: str | os.PathLike) -> str | None:
    """How ``path`` relates to ``other`` after resolving links: ``"is"``, ``"contains"`` (``other`` lies under
    ``path``), ``"lies inside"`` (``path`` lies under ``other``), or None when neither holds."""
    a, b = os.path.realpath(path), os.path.realpath(other)
    if a == b:
        return "is"
    if b.startswith(a.rstrip(os.sep) + os.sep):
        return "contains"
    if a.startswith(b.rstrip(os.sep) + os.sep):
        return "lies inside"
    return None


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` itself when it exists, else its nearest existing ancestor (where ``mkdir -p`` would start)."""
    current = Path(os.path.abspath(path))
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def replace_dir(tmp: Path, final: Path, stale: Path) -> None:
    """Move the complete directory ``tmp`` to ``final`` in renames only: an existing ``final`` is renamed to ``stale``
    first and removed after, so a crash at any point leaves a complete directory at ``final`` or at ``stale`` (the
    writers' names for both are their own, so a later run knows them as leftovers)."""
    if not final.exists():
        os.rename(tmp, final)
        return
    shutil.rmtree(stale, ignore_errors=True)
    os.rename(final, stale)
    os.rename(tmp, final)
    shutil.rmtree(stale, ignore_errors=True)


def probe_writable(path: str | os.PathLike) -> str | None:
    """Whether files can be created where ``path`` is (or would be created): creates and removes one probe file in
    ``path`` or its nearest existing ancestor, so nothing is left behind. Returns None when writable, else why not.
    """
    target = nearest_existing(path)
    if not target.is_dir():
        return f"{target} is a file, not a directory"
    probe = target / f".miles_write_probe_{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        return f"cannot create files in {target} ({exc.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None


def _relative_files(root: str | os.PathLike, skip_hidden: bool = False) -> set[str]:
    """Every file and directory under ``root`` as a path relative to it (hidden top-level entries left out when
    ``skip_hidden``)."""
    root = Path(root)
    return {
        str(path.relative_to(root))
        for path in root.rglob("*")
        if not (skip_hidden and path.relative_to(root).parts[0].startswith("."))
    }


def _exported_files(out: Path) -> set[str]:
    """What an earlier export wrote that its source may lack: the transformer's weights and config as
    ``save_pretrained`` names them, the scheduler config, ``--keep-best``'s record and ``--save-hf-lora``'s adapter
    (``lora/pytorch_lora_weights.safetensors``); a user's other files are none of these."""
    # "transformer" is miles.models.base.DENOISER, the denoiser's folder; utils sits below the models layer.
    names = {"transformer", "scheduler", "transformer/config.json", "scheduler/scheduler_config.json", KEEP_BEST_FILE}
    names |= {LORA_EXPORT_DIR, f"{LORA_EXPORT_DIR}/{LORA_EXPORT_WEIGHTS}"}
    transformer = out / "transformer"
    if transformer.is_dir():
        names |= {
            f"transformer/{entry.name}"
            for entry in transformer.iterdir()
            if entry.is_file()
            and entry.name.startswith("diffusion_pytorch_model")
            and entry.suffix in (".safetensors", ".json")
        }
    return names


def check_export_target(
    out_dir: str | os.PathLike,
    source: str | os.PathLike,
    overwrite: bool,
    run_paths: list[tuple[str, str]],
    name: str = "--save-hf",
) -> None:
    """Refuse an export directory that would delete or overwrite what this run did not create.

    Args:
        out_dir: ``--save-hf``.
        source: the pipeline the export copies (``--hf-checkpoint``).
        overwrite: ``--overwrite-save-hf``.
        run_paths: ``(flag, path)`` of every directory the run reads or writes
            (:func:`miles.driver.arguments.run_paths`).
        name: what the messages call the export (``--keep-best``'s is ``<save-hf>-best``).

    Raises:
        ArgumentValidationError: if ``out_dir`` is, contains or lies inside one of ``run_paths``; if it is a file,
            a non-empty directory that is not a pipeline, a pipeline without ``overwrite``, or a pipeline holding
            entries the export would not write again (the user's own files).
    """
    for other, path in run_paths:
        relation = path_relation(out_dir, path)
        if relation is not None:
            what = "is also" if relation == "is" else relation
            reject(f"{name} {out_dir} {what} {other} {path}; export to a directory of its own")
    out = Path(out_dir)
    if out.is_file() or out.is_symlink() and not out.is_dir():
        reject(f"{name} {out_dir} is a file; export to a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / MODEL_INDEX).is_file():
        reject(f"{name} {out_dir} exists and is not a pipeline directory; export somewhere else")
    if not overwrite:
        reject(f"{name} {out_dir} holds a pipeline already; add --overwrite-save-hf to replace it")
    if Path(source).is_dir():
        extra = sorted(_relative_files(out) - _relative_files(source, skip_hidden=True) - _exported_files(out))
        if extra:
            shown = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
            reject(
                f"{name} {out_dir} holds {shown}, not part of the pipeline the export writes; move it away or "
                "export elsewhere (--overwrite-save-hf replaces a pipeline, never other files)"
            )


def sibling_dir(path: str | None, suffix: str) -> str | None:
    """``/ckpt/run`` → ``/ckpt/run_critic``; ``None`` stays ``None``. A trailing slash is ignored."""
    if path is None:
        return None
    return os.path.normpath(path) + suffix


def link_or_copy(src: str, dst: str) -> str:
    """``shutil.copytree``'s ``copy_function`` for a pipeline copy that leaves most files unchanged: a hard link
    (the GBs of text encoders and VAE cost no space), or a copy where the file system refuses one. Returns ``dst``."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst
