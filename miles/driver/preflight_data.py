"""Preflight of the data: every JSONL file a command names, its records, and the files they name.

Run by the driver before Ray starts (:func:`miles.driver.preflight.validate_inputs`), so that a missing PNG, a
latent of the wrong shape or a prompt cache written for another model fails in seconds on one line that names the
record, instead of in a worker at the rollout that first draws it, or never (a cache of another family with the same
shapes trains the wrong conditioning with exit code 0). Each data file is read once, each file its records name once,
and only its header: a ``stat``, the safetensors JSON header (its tensors' shapes, and the ``family`` that
``miles.rollout.prompt_cache`` and ``miles.rollout.encode_images`` write into its metadata) or the ``.npy`` header, so
a data file of 100,000 records is checked in seconds. Images written into a JSONL are loaded and encoded (small by
nature). The values of files are read when a rollout loads them.
"""

import functools
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from miles.config import DataSpec
from miles.utils.validation import reject

__all__ = ["DataCheck", "check_negative_cond", "safetensors_header", "stored_latent_shape"]


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (``{name: {"dtype", "shape", "data_offsets"}}``, and ``__metadata__``
    when it has one), checked against the file's size. Read once per process while the file is unchanged (its
    size and modification time): the checks and the space estimate share it; callers must not modify it.

    Raises:
        ValueError: if the file is too short, its header is not JSON, or its tensors run past the end of the file.
    """
    stat = Path(path).stat()
    return _read_header(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _read_header(path: str, size: int, mtime_ns: int) -> dict:
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            raise ValueError(f"header of {length} bytes runs past the end of the {size}-byte file (truncated?)")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ValueError(f"header is not JSON ({exc})") from None
    end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise ValueError(f"tensors need {8 + length + end} bytes but the file holds {size} (truncated?)")
    return header


def _tensors(header: dict) -> dict[str, tuple[int, ...]]:
    return {name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"}


def stored_latent_shape(path: Path, header: dict | None = None) -> tuple[int, ...]:
    """The shape of the latent a ``.safetensors`` (its tensor ``latent``, or its only tensor) or ``.npy`` file holds,
    read from the file's header (``header``: the safetensors header, when already read).

    Raises:
        ValueError: for another suffix, an unreadable header, or a safetensors file of several unnamed tensors.
    """
    if path.suffix == ".safetensors":
        tensors = _tensors(header if header is not None else safetensors_header(path))
        shape = tensors.get("latent") or (next(iter(tensors.values())) if len(tensors) == 1 else None)
        if shape is None:
            raise ValueError(f"it holds {sorted(tensors)}; name the latent tensor 'latent'")
        return shape
    if path.suffix == ".npy":
        return tuple(np.load(path, mmap_mode="r").shape)
    raise ValueError("a latent file must be .safetensors or .npy")


@dataclass
class DataCheck:
    """One pass over a command's data files, for the run's model ``family`` (its ``name``) and student latent
    ``shape`` ``(C, H, W)``; the cond files of every data file must agree with each other and with the run's family.

    Args:
        spec: the run's data spec: its keys (``input_key``, ``image_key``, ``latent_key``, ``cond_key``).
        pipeline: ``--hf-checkpoint``, as the messages name it.
    """

    family: Any
    shape: tuple[int, ...]
    spec: DataSpec
    pipeline: str
    cond_shapes: tuple[str, dict] | None = None  # (the first cond file, its {tensor: shape})
    seen: set = field(default_factory=set)

    def records(self, flag: str, path: str, train: str = "") -> list[dict]:
        """Read data file ``path`` (``flag`` names it) and check its records: each has a prompt; with ``train`` (why
        the records are trained on: ``--train-only`` prompts, real samples) an image or a latent file, images
        written into the JSONL load and fit :attr:`shape`, image and latent files exist (latents of :attr:`shape`);
        cached cond files (every data file's) exist, are whole, and were written for this run's family; an
        image-conditioned family's records without a cached cond name a reference image that loads. Relative
        paths resolve against the data file's directory, as the trainer reads them.

        Raises:
            ArgumentValidationError: naming the flag, the data file, the record number, its prompt and the file.
        """
        from miles.models.capabilities import ImageConditioned, supports
        from miles.rollout.data_source import JsonlPromptSource, load_image, load_image_latent

        spec = self.spec
        # An edit model encodes each record's prompt with its reference image, unless a prompt cache already did.
        edits = supports(self.family, ImageConditioned)
        input_key, image_key, latent_key, cond_key = spec.input_key, spec.image_key, spec.latent_key, spec.cond_key
        try:
            records = JsonlPromptSource(path, input_key=input_key, shuffle=False, flag=flag).records
        except (OSError, ValueError) as exc:
            reject(str(exc))
        base = Path(path).parent
        for number, record in enumerate(records, start=1):
            where = f"{flag} {path} record {number} (prompt {record[input_key]!r})"
            image, latent, cond = record.get(image_key), record.get(latent_key), record.get(cond_key)
            if isinstance(cond, str):
                self.cond_file(where, self._file(where, base, cond, "cond"))
            elif edits:
                key = spec.condition_image_key
                if record.get(key) is None:
                    reject(
                        f"{where} has no reference image under --condition-image-key {key!r}; the "
                        f"{self.family.name} family edits one per record"
                    )
                try:
                    load_image(record[key], base)
                except (OSError, ValueError, TypeError) as exc:
                    reject(f"{where}: its reference image under --condition-image-key {key!r} does not load ({exc})")
            if not train:
                continue
            if image is None and not isinstance(latent, str):
                reject(
                    f"{where} has no image under --image-key {image_key!r} nor a latent file under --latent-key "
                    f"{latent_key!r}; {train}"
                )
            if isinstance(image, str):
                self._file(where, base, image, "image")
            elif image is not None:
                try:
                    load_image_latent(self.family, image, expected_shape=self.shape, where=where)
                except (OSError, ValueError, TypeError) as exc:
                    reject(str(exc))
            if isinstance(latent, str):
                self._latent(where, self._file(where, base, latent, "latent"))
        return records

    def _file(self, where: str, base: Path, value: str, what: str) -> Path:
        file = Path(value) if Path(value).is_absolute() else base / value
        if not file.is_file():
            reject(f"{where}: its {what} file {file} does not exist (relative paths are read from {base})")
        return file

    def _header(self, where: str, file: Path, what: str) -> dict | None:
        """The file's safetensors header, the first time it is named (None after that, or for ``.npy``)."""
        if file in self.seen:
            return None
        self.seen.add(file)
        if file.suffix == ".npy":
            return None
        try:
            return safetensors_header(file)
        except (OSError, ValueError) as exc:
            reject(f"{where}: {what} file {file} is not a readable safetensors file ({exc})")

    def _family(self, where: str, file: Path, header: dict, command: str) -> None:
        written = (header.get("__metadata__") or {}).get("family")
        if written is not None and written != self.family.name:
            reject(
                f"{where}: {file} was written for the {written} family, but --hf-checkpoint {self.pipeline} is "
                f"{self.family.name}; write it again with this pipeline (python -m miles.rollout.{command})"
            )

    def cond_file(self, where: str, file: Path, negative: bool = False) -> None:
        """A cached cond file (named in messages after ``where``) is a whole safetensors file of the run's family
        with the tensors of the first one seen; each file is checked once. A ``negative`` cond holds a subset of
        them with the same shapes: the conditioning a family keeps per record (an edit's reference latents,
        ``image_latents``) is not in the negative prompt's encoding."""
        header = self._header(where, file, "cond")
        if header is None:
            return
        self._family(where, file, header, "prompt_cache")
        shapes = _tensors(header)
        if self.cond_shapes is None:
            if not negative:
                self.cond_shapes = (str(file), shapes)
            return
        first, expected = self.cond_shapes
        fits = all(expected.get(name) == shape for name, shape in shapes.items()) if negative else shapes == expected
        if not fits:
            reject(
                f"{where}: cond file {file} holds {shapes}, but {first} holds {expected}; every cached cond of a "
                "run comes from one prompt cache of its pipeline (python -m miles.rollout.prompt_cache)"
            )

    def _latent(self, where: str, file: Path) -> None:
        header = self._header(where, file, "latent")
        if header is not None:
            self._family(where, file, header, "encode_images")
        try:
            shape = stored_latent_shape(file, header)
        except (OSError, ValueError) as exc:
            reject(f"{where}: latent file {file} is not readable ({exc})")
        if shape != tuple(self.shape):
            reject(
                f"{where}: latent file {file} has shape {shape} but the model takes {tuple(self.shape)}; encode the "
                "images with this pipeline's VAE at its sample size (python -m miles.rollout.encode_images)"
            )


def check_negative_cond(data: DataCheck, path: str) -> None:
    """``--negative-cond`` is a whole safetensors cond file of the run's family, with the tensors of the records'
    cached conds (checked after them).

    Raises:
        ArgumentValidationError: naming ``--negative-cond`` and what is wrong.
    """
    if not Path(path).is_file():
        reject(f"--negative-cond {path} does not exist; pass a .safetensors cond file (miles.rollout.prompt_cache)")
    data.cond_file("--negative-cond", Path(path), negative=True)
