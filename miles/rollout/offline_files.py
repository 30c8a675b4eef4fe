"""What the offline data commands (``miles.rollout.prompt_cache``, ``miles.rollout.encode_images``) share: their
command line (a pipeline, inputs, an output directory; a bad input is one error line and exit code 2), an
output-directory check that fails early with one line, and writes that never leave a truncated file under its final
name (each file is written beside itself and renamed into place)."""

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["OfflineDataError", "command_parser", "ensure_writable_dir", "replace_text", "run_command", "save_tensors"]


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


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as a ``.safetensors`` file (contiguous copies; string ``metadata`` in its header) through a
    temporary sibling and ``os.replace``."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def command_parser(
    prog: str, description: str, inputs: list[tuple[str, str]], out_help: str
) -> argparse.ArgumentParser:
    """An offline command's parser: the positionals ``pipeline`` (any model family), ``inputs`` (``(name, help)``)
    and ``out_dir``; the command adds its options."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("pipeline", help="pipeline directory (any model family)")
    for name, help_text in inputs:
        parser.add_argument(name, help=help_text)
    parser.add_argument("out_dir", help=out_help)
    return parser


def run_command(parser: argparse.ArgumentParser, work: Callable[[], Any]) -> Any | None:
    """Run an offline command's ``work`` with INFO logging; an ``OfflineDataError`` prints one ``<prog>: error:``
    line on stderr and returns None (the caller exits with code 2)."""
    from miles.utils.log import setup_logging

    setup_logging("INFO")
    try:
        return work()
    except OfflineDataError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return None
