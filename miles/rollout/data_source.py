"""The rollout's prompt source: a JSONL file read in seeded, per-epoch shuffled order with a resumable cursor.

Each line is a JSON object with the prompt under ``--input-key`` and any other fields (``{"prompt": "a handwritten
digit 7", "label": 7, "image": [[0, ...], ...]}``). SFT records carry a clean image under ``--image-key``: a nested
list of ints 0..255 of shape ``(H, W)`` or ``(H, W, C)``, or a path (absolute, or relative to the JSONL file) to a
``.npy`` or ``.png`` file; ``load_image_latent`` turns it into the family's latent (a family with a pixel codec).
Records may instead name a latent file under ``--latent-key`` (any family; images ``(C, H, W)``, video
``(C, F, H, W)``).
"""

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.models.capabilities import PixelCodec, require
from miles.utils.misc import make_generator
from miles.utils.types import PromptShard, SideRecords

__all__ = [
    "JsonlPromptSource",
    "jsonl_values",
    "load_image",
    "load_image_latent",
    "load_latent_file",
    "load_record_latent",
    "make_prompt_shard",
    "read_jsonl_records",
    "split_prompts",
]

logger = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b"


def jsonl_values(path: str | Path, where: str = "", error: type[Exception] = ValueError) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line of a UTF-8 JSONL file, in order (the prompt source, the
    prompt cache and the image encoder read their files through it).

    Raises:
        error: ``"<where> <path>:<line> is not valid JSON (...)"``, for a line that does not parse; naming the file
            (and line), for a gzip-compressed file or a line that is not UTF-8.
    """
    prefix = f"{where} " if where else ""
    with open(path, "rb") as f:
        if f.read(2) == _GZIP_MAGIC:
            raise error(f"{prefix}{path} is gzip-compressed; decompress it (gunzip) and pass the JSONL file")
        f.seek(0)
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise error(
                    f"{prefix}{path}:{line_no} is not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); "
                    "save the file as UTF-8 JSONL"
                ) from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{prefix}{path}:{line_no} is not valid JSON ({exc.msg})") from exc
            yield line_no, value


def read_jsonl_records(path: str | Path, input_key: str, flag: str) -> list[dict[str, Any]]:
    """Every record of a UTF-8 JSONL file, in file order (blank lines skipped).

    An empty prompt is valid (it is the unconditional prompt, as CFG trains it) but a file where every prompt is
    empty is logged as a warning: the run would learn no conditioning.

    Raises:
        ValueError: naming ``flag``, the file and the line, for a gzip-compressed file, a line that is not UTF-8, not
            a JSON object, lacks ``input_key``, or holds a prompt that is not a string (null, a number).
    """
    records = []
    for line_no, record in jsonl_values(path, flag):
        if not isinstance(record, dict) or input_key not in record:
            raise ValueError(
                f"{flag} {path}:{line_no} has no field {input_key!r}; set --input-key to the prompt's field"
            )
        if not isinstance(record[input_key], str):
            raise ValueError(
                f'{flag} {path}:{line_no}: {input_key!r} must be a string ("" for the unconditional prompt), got '
                f"{json.dumps(record[input_key])}"
            )
        records.append(record)
    if records and not any(record[input_key].strip() for record in records):
        logger.warning(
            "%s %s: all %d prompts are empty; the run learns no text conditioning", flag, path, len(records)
        )
    return records


class JsonlPromptSource:
    """Hands out records in batches, epoch after epoch.

    Epoch e visits every record once, in the order ``randperm(N)`` from ``stable_hash(purpose, seed, e)``
    (file order when ``shuffle`` is False). A batch that crosses an epoch's end continues in the next epoch.

    Args:
        path: the JSONL file (``--prompt-data``).
        input_key: the prompt's field (``--input-key``).
        seed: shuffle seed (``--rollout-seed``).
        shuffle: shuffle each epoch (``--rollout-shuffle``).
        purpose: the shuffle's seed key (a second source, such as real data, shuffles independently).
        flag: the flag that names the file, for error messages.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: for a path that is not a regular file (a device, a fifo), a line that is not a JSON object or
            lacks ``input_key``, or an empty file.
    """

    def __init__(
        self,
        path: str | Path,
        input_key: str = "prompt",
        seed: int = 42,
        shuffle: bool = True,
        purpose: str = "prompt_shuffle",
        flag: str = "--prompt-data",
    ) -> None:
        self.path = Path(path)
        self.purpose = purpose
        self.input_key = input_key
        self.seed = seed
        self.shuffle = shuffle
        if self.path.is_dir():
            raise FileNotFoundError(f"{flag} {self.path} is a directory; pass a JSONL file")
        if self.path.exists() and not self.path.is_file():
            raise ValueError(f"{flag} {self.path} is not a regular file; pass a JSONL file")
        if not self.path.is_file():
            raise FileNotFoundError(f"{flag} {self.path} does not exist")
        self.records = read_jsonl_records(self.path, input_key, flag)
        if not self.records:
            raise ValueError(f"{flag} {self.path} holds no records")
        self.epoch = 0
        self.cursor = 0
        self._order = self._epoch_order(0)
        logger.debug("prompt source %s: %d records, shuffle=%s", self.path, len(self.records), shuffle)

    def __len__(self) -> int:
        return len(self.records)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        return torch.randperm(len(self.records), generator=make_generator(self.purpose, self.seed, epoch)).tolist()

    def next_batch(self, batch_size: int) -> list[dict[str, Any]]:
        """The next ``batch_size`` records (shallow copies), advancing the cursor across epochs as needed."""
        if batch_size < 1:
            raise ValueError(f"--rollout-batch-size must be >= 1, got {batch_size}")
        batch = []
        while len(batch) < batch_size:
            if self.cursor == len(self.records):
                self.epoch += 1
                self.cursor = 0
                self._order = self._epoch_order(self.epoch)
            batch.append(dict(self.records[self._order[self.cursor]]))
            self.cursor += 1
        return batch

    def prompt(self, record: dict[str, Any]) -> str:
        """The record's prompt text."""
        return str(record[self.input_key])

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "cursor"}``: enough to resume, since the order is a function of (seed, epoch)."""
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state["epoch"]``, ``state["cursor"]``.

        Raises:
            ValueError: if the cursor lies beyond this file's record count (the data changed since the checkpoint).
        """
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if not 0 <= cursor <= len(self.records):
            raise ValueError(
                f"data source state has cursor {cursor} but {self.path} holds {len(self.records)} records; resume "
                "with the same data file"
            )
        self.epoch, self.cursor = epoch, cursor
        self._order = self._epoch_order(epoch)


def load_image(value: Any, base_dir: str | Path | None = None) -> torch.Tensor:
    """Load one record's image as uint8 ``(H, W)`` or ``(H, W, C)`` pixels in 0..255.

    Args:
        value: a nested list of ints 0..255, or a path to a ``.npy`` / ``.png`` file.
        base_dir: directory that relative paths are resolved against (the JSONL file's).

    Raises:
        ValueError: on values outside 0..255, a non-integer array, or an unsupported file type.
        FileNotFoundError: if the path does not exist.
    """
    if isinstance(value, str):
        path = Path(value)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise FileNotFoundError(f"image file {path} does not exist (relative paths are read from {base_dir})")
        if path.suffix == ".npy":
            array = np.load(path)
        elif path.suffix == ".png":
            from PIL import Image

            array = np.asarray(Image.open(path))
        else:
            raise ValueError(f"image file {path} must be .npy or .png")
    else:
        array = np.asarray(value)
    if array.dtype.kind not in "iub":
        raise ValueError(f"image values must be integers 0..255, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() > 255):
        raise ValueError(f"image values must be in 0..255, got {array.min()}..{array.max()}")
    if array.ndim not in (2, 3):
        raise ValueError(f"an image must be (H, W) or (H, W, C), got shape {array.shape}")
    return torch.from_numpy(array.astype(np.uint8))


def load_image_latent(
    family: Any,
    value: Any,
    base_dir: str | Path | None = None,
    expected_shape: tuple[int, ...] | None = None,
    where: str | None = None,
) -> torch.Tensor:
    """A record's image as the family's clean latent: float32 ``(C, H, W)`` (``family.images_to_latents``, which a
    family declares with :class:`miles.models.capabilities.PixelCodec`).

    Args:
        expected_shape: the denoiser's latent shape (``family.latent_shape``); an image of another size is rejected.
        where: names the record in errors, e.g. ``"--prompt-data data.jsonl record 7 (prompt 'a 7')"``.

    Raises:
        ValueError: on a bad image (see :func:`load_image`), a latent of another shape or a family without a pixel
            codec; the message starts with ``where``.
        FileNotFoundError: if the image path does not exist.
    """
    prefix = f"{where}: " if where else ""
    try:
        require(family, PixelCodec, "an image record (give a latent file under --latent-key instead)")
        latent = family.images_to_latents(load_image(value, base_dir).unsqueeze(0))[0]
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{prefix}{exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{prefix}{exc}") from exc
    if expected_shape is not None and tuple(latent.shape) != tuple(expected_shape):
        raise ValueError(
            f"{prefix}the image gives a latent of shape {tuple(latent.shape)} but the model takes "
            f"{tuple(expected_shape)}; resize the image to the pipeline's sample size"
        )
    return latent


def load_latent_file(path: str | Path, where: str = "") -> torch.Tensor:
    """A stored latent ``(C, H, W)`` (video: ``(C, F, H, W)``) as float32: a ``.safetensors`` file with one tensor
    (or a tensor named ``latent``), or a float ``.npy`` array.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: on another suffix, an unreadable file, several unnamed tensors, a rank other than 3 or 4, or a
            non-finite value.
    """
    prefix = f"{where}: " if where else ""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{prefix}latent file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{prefix}latent file {path} is not a readable safetensors file ({exc})") from exc
        if "latent" in tensors:
            latent = tensors["latent"]
        elif len(tensors) == 1:
            latent = next(iter(tensors.values()))
        else:
            raise ValueError(f"{prefix}latent file {path} holds {sorted(tensors)}; name the latent tensor 'latent'")
    elif path.suffix == ".npy":
        array = np.load(path)
        if array.dtype.kind != "f":
            raise ValueError(f"{prefix}latent file {path} holds {array.dtype} values; a latent is a float array")
        latent = torch.from_numpy(array)
    else:
        raise ValueError(f"{prefix}latent file {path} must be .safetensors or .npy")
    if latent.ndim not in (3, 4):
        raise ValueError(
            f"{prefix}latent file {path} holds shape {tuple(latent.shape)}; a latent is (C, H, W) or, for video, "
            "(C, F, H, W)"
        )
    latent = latent.float()
    bad = int((~torch.isfinite(latent)).sum())
    if bad:
        # Trained on, it would only skip optimizer steps (the non-finite guard) without naming the record.
        raise ValueError(f"{prefix}latent file {path} holds {bad} non-finite values (NaN/inf); re-encode the image")
    return latent


def load_record_latent(
    keys: Any,
    family: Any,
    record: dict[str, Any],
    base_dir: str | Path,
    expected_shape: tuple[int, ...] | None = None,
    where: str | None = None,
) -> torch.Tensor:
    """A data record's clean latent, float32 of the family's latent shape: its ``--latent-key`` file when it has
    one (already in latent space, e.g. VAE latents written by ``python -m miles.rollout.encode_images``), else its
    ``--image-key`` image turned into a latent by the family.

    Args:
        keys: the data keys (a :class:`miles.config.DataSpec`: ``latent_key``, ``image_key``).

    Raises:
        ValueError / FileNotFoundError: naming ``where``, for a record with neither field, a bad file or a latent
            of another shape than ``expected_shape``.
    """
    latent_key, image_key = keys.latent_key, keys.image_key
    prefix = f"{where}: " if where else ""
    if isinstance(record.get(latent_key), str):
        latent = load_latent_file(Path(base_dir) / record[latent_key], where=where or "")
        if expected_shape is not None and tuple(latent.shape) != tuple(expected_shape):
            raise ValueError(
                f"{prefix}latent {record[latent_key]} has shape {tuple(latent.shape)} but the model takes "
                f"{tuple(expected_shape)}; encode the images with this pipeline's VAE at its sample size"
            )
        return latent
    if image_key not in record:
        raise ValueError(
            f"{prefix}record has neither an image under --image-key {image_key!r} nor a latent file under "
            f"--latent-key {latent_key!r}"
        )
    return load_image_latent(family, record[image_key], base_dir, expected_shape=expected_shape, where=where)


def make_prompt_shard(
    rollout_id: int | str,
    records: list[dict[str, Any]],
    *,
    input_key: str,
    n_samples_per_prompt: int = 1,
    first_prompt_index: int = 0,
    base_dir: str | Path = ".",
    side_data: dict[str, SideRecords] | None = None,
) -> PromptShard:
    """The ``PromptShard`` of ``records`` (one per prompt), each repeated for its ``n_samples_per_prompt`` samples;
    prompt ``first_prompt_index + p``'s j-th sample has index ``(first_prompt_index + p)·n + j``. ``side_data`` (one
    record per sample, by side-input name) are a method's side inputs dealt beside them."""
    n = n_samples_per_prompt
    return PromptShard(
        rollout_id=rollout_id,
        sample_indices=[(first_prompt_index + p) * n + j for p in range(len(records)) for j in range(n)],
        prompts=[str(record[input_key]) for record in records for _ in range(n)],
        records=[record for record in records for _ in range(n)],
        base_dir=str(base_dir),
        side_data=dict(side_data or {}),
    )


def split_prompts(num_prompts: int, parts: int) -> list[range]:
    """Contiguous equal ranges of prompt positions, one per part (DP rank).

    Raises:
        ValueError: if ``num_prompts`` is not a multiple of ``parts``; nothing is ever dropped.
    """
    if parts < 1:
        raise ValueError(f"cannot split prompts into {parts} parts")
    if num_prompts % parts:
        raise ValueError(
            f"{num_prompts} prompts do not split evenly over {parts} DP ranks: make --rollout-batch-size a multiple "
            "of the DP size (--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    size = num_prompts // parts
    return [range(part * size, (part + 1) * size) for part in range(parts)]
