"""What the offline data commands (``miles.rollout.prompt_cache``, ``miles.rollout.encode_images``) share: their
command line (a pipeline, inputs, an output directory; a bad input is one error line and exit code 2), an
output-directory check that fails early with one line, and writes that never leave a truncated file under its final
name (each file is written beside itself and renamed into place)."""

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "OfflineDataError",
    "batches",
    "command_parser",
    "ensure_writable_dir",
    "open_family",
    "replace_text",
    "run_command",
    "save_tensors",
    "write_manifest",
    "write_records",
]


class OfflineDataError(ValueError):
    """A problem with an offline command's inputs or output directory; the message names the file and the fix."""


def ensure_writable_dir(directory: str | Path, *subdirs: str) -> Path:
    """Create ``directory`` (and its ``subdirs``) and check that files can be written there.

    Raises:
        OfflineDataError: if it cannot be created or written (a file in its place, no permission, a full disk).
    """
    directory = Path(directory)
    try:
        for sub in subdirs or ("",):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        probe = directory / ".write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OfflineDataError(f"cannot write to output directory {directory} ({exc.strerror or exc})") from exc
    return directory


def replace_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary sibling and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_records(path: str | Path, records: list[dict[str, Any]]) -> None:
    """Write ``records`` as JSONL, one object a line (UTF-8, :func:`replace_text`)."""
    replace_text(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))


def write_manifest(path: str | Path, pipeline: Path, family: Any, **fields: Any) -> dict[str, Any]:
    """Write an offline command's manifest, ``{"pipeline": <resolved path>, "family": <name>, **fields}``, as indented
    JSON (UTF-8, :func:`replace_text`); returns it."""
    manifest = {"pipeline": str(Path(pipeline).resolve()), "family": family.name, **fields}
    replace_text(path, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as a ``.safetensors`` file (contiguous copies; string ``metadata`` in its header) through a
    temporary sibling and ``os.replace``."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def open_family(pipeline: str | Path, family_name: str | None, batch_size: int, needs: type | None = None) -> Any:
    """The model family of an offline command's ``pipeline`` (``--diffusion-model-family`` ``family_name``, else its
    ``model_index.json``), after checking ``--batch-size``; with ``needs``, a capability it must declare.

    Raises:
        OfflineDataError: for a batch size below 1, a missing pipeline directory, an unknown or unusable family.
    """
    from miles.models import get_model_family, require

    if batch_size < 1:
        raise OfflineDataError(f"--batch-size must be >= 1, got {batch_size}")
    if not Path(pipeline).is_dir():
        raise OfflineDataError(f"pipeline directory {pipeline} does not exist")
    try:
        family = get_model_family(pipeline, family_name)
        if needs is not None:
            require(family, needs, "this command")
    except (FileNotFoundError, ValueError) as exc:
        raise OfflineDataError(f"pipeline {pipeline}: {exc}") from exc
    return family


def batches(items: list, batch_size: int, progress: bool | None, unit: str, desc: str) -> Iterator[tuple[int, list]]:
    """``(start, items[start : start + batch_size])`` in order, under a tqdm bar of ``items`` (``progress`` None: shown
    on a terminal when there is more than one batch)."""
    from tqdm import tqdm

    # tqdm's disable=None: shown only on a terminal; a single batch needs no bar
    disable = (None if len(items) > batch_size else True) if progress is None else not progress
    with tqdm(total=len(items), unit=unit, desc=desc, disable=disable) as bar:
        for start in range(0, len(items), batch_size):
            yield start, items[start : start + batch_size]
            bar.update(min(batch_size, len(items) - start))


def command_parser(
    prog: str, description: str, source: tuple[str, str], out_help: str, batch_size: int, batch_help: str
) -> argparse.ArgumentParser:
    """An offline command's parser: the positionals ``pipeline`` (any model family), ``source`` (``(name, help)``, what
    the command reads) and ``out_dir``, ``--batch-size`` (default ``batch_size``; ``batch_help`` says of what, e.g.
    ``"prompts per encoder call"``) and ``--diffusion-model-family``; the command adds its options."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("pipeline", help="pipeline directory (any model family)")
    parser.add_argument(source[0], help=source[1])
    parser.add_argument("out_dir", help=out_help)
    parser.add_argument("--batch-size", type=int, default=batch_size, help=f"{batch_help} (default: {batch_size})")
    parser.add_argument(
        "--diffusion-model-family", default=None, help="family name or dotted path (default: from model_index.json)"
    )
    parser.set_defaults(source=source[0])
    return parser


def run_command(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    work: Callable[..., dict[str, Any]],
    options: tuple[str, ...],
    summary: Callable[[dict[str, Any], Path], str],
) -> int:
    """Run an offline command with INFO logging: ``work(pipeline, source, out_dir, batch_size=, family_name=, **{name:
    ns.<name> for name in options})``, then print ``summary(manifest, out_dir)``. Returns the exit code: 0, or 2 after
    one ``<prog>: error:`` line on stderr for an ``OfflineDataError``."""
    from miles.utils.log import setup_logging

    ns = parser.parse_args(argv)
    setup_logging("INFO")
    try:
        manifest = work(
            ns.pipeline,
            getattr(ns, ns.source),
            ns.out_dir,
            batch_size=ns.batch_size,
            family_name=ns.diffusion_model_family,
            **{name: getattr(ns, name) for name in options},
        )
    except OfflineDataError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(summary(manifest, Path(ns.out_dir)))
    return 0
