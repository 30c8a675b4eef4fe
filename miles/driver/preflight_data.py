"""Preflight of the files a data file's records name: images, stored latents and cached prompt conds.

Run by the driver before Ray starts (:func:`miles.driver.preflight.validate_inputs`), so that a missing PNG or a
latent of the wrong shape fails in seconds on one line that names the record, instead of in a worker at the rollout
that first draws it. Every check reads at most a file's header: a ``stat`` per file, the safetensors JSON header or
the ``.npy`` header for a latent's shape, so a data file of 100,000 records is checked in seconds. The values
themselves are read when a rollout loads them (``miles.rollout.data_source.load_latent_file`` refuses a non-finite
latent there, naming the sample).
"""

import argparse
from pathlib import Path

import numpy as np

from miles.utils.validation import reject

__all__ = ["check_record_files", "stored_latent_shape"]


def stored_latent_shape(path: Path) -> tuple[int, ...]:
    """The shape of the latent a ``.safetensors`` (its tensor ``latent``, or its only tensor) or ``.npy`` file holds,
    read from the file's header.

    Raises:
        ValueError: for another suffix, an unreadable header, or a safetensors file of several unnamed tensors.
    """
    if path.suffix == ".safetensors":
        from miles.driver.preflight_models import safetensors_header

        tensors = {name: info for name, info in safetensors_header(path).items() if name != "__metadata__"}
        info = tensors.get("latent") or (next(iter(tensors.values())) if len(tensors) == 1 else None)
        if info is None:
            raise ValueError(f"it holds {sorted(tensors)}; name the latent tensor 'latent'")
        return tuple(info["shape"])
    if path.suffix == ".npy":
        return tuple(np.load(path, mmap_mode="r").shape)
    raise ValueError("a latent file must be .safetensors or .npy")


def check_record_files(
    args: argparse.Namespace,
    flag: str,
    path: str,
    records: list[dict],
    latent_shape: tuple[int, ...] | None,
) -> None:
    """Every file a record names exists: its cached cond (``--cond-key``) and, with ``latent_shape`` (data the
    trainer trains on: ``--train-only`` data, real samples), its image (``--image-key``, a path) and its stored
    latent (``--latent-key``), whose header must give ``latent_shape``. Relative paths resolve against the data
    file's directory, as the trainer reads them.

    Raises:
        ArgumentValidationError: naming the flag, the data file, the record number, its prompt and the file.
    """
    base = Path(path).parent
    for number, record in enumerate(records, start=1):
        where = f"{flag} {path} record {number} (prompt {record.get(args.input_key)!r})"
        for key, what in ((args.image_key, "image"), (args.latent_key, "latent"), (args.cond_key, "cond")):
            value = record.get(key)
            if not isinstance(value, str) or (what != "cond" and latent_shape is None):
                continue
            file = Path(value) if Path(value).is_absolute() else base / value
            if not file.is_file():
                reject(f"{where}: its {what} file {file} does not exist (relative paths are read from {base})")
            if what != "latent":
                continue
            try:
                shape = stored_latent_shape(file)
            except (OSError, ValueError) as exc:
                reject(f"{where}: latent file {file} is not readable ({exc})")
            if shape != tuple(latent_shape):
                reject(
                    f"{where}: latent file {file} has shape {shape} but the model takes {tuple(latent_shape)}; "
                    "encode the images with this pipeline's VAE at its sample size (python -m "
                    "miles.rollout.encode_images)"
                )
