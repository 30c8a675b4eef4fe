"""Encode a prompt file once, offline, so that training needs no text encoder: ``python -m miles.rollout.prompt_cache``.

SD3.5's T5-XXL alone is 4.7B parameters; with a prompt cache the training ranks read each prompt's cond from disk
(:mod:`miles.rollout.conditioning`) and never load a text encoder. Any model family works (``sd3``, ``digits``)::

    python -m miles.rollout.prompt_cache PIPELINE PROMPTS.jsonl OUT_DIR [--input-key prompt] [--negative-prompt ""]
        [--device cpu] [--dtype float32|bfloat16] [--batch-size 16] [--cond-key cond]

writes::

    OUT_DIR/cond/<hash>.safetensors   the cond kwargs of one distinct prompt, no batch dim (sd3:
                                      encoder_hidden_states (77 + 256, 4096), pooled_projections (2048,))
    OUT_DIR/negative.safetensors      the same for --negative-prompt
    OUT_DIR/prompts.jsonl             every input record, in order, plus "cond": "cond/<hash>.safetensors"
    OUT_DIR/prompt_cache.json         pipeline, family, shapes, dtype, negative prompt, counts

``<hash>`` is :func:`prompt_hash` of the prompt text (SHA-256, first 32 hex digits), so a prompt that occurs many
times is encoded and stored once. Train with ``--prompt-data OUT_DIR/prompts.jsonl --negative-cond
OUT_DIR/negative.safetensors``.

Exactness: a float32 cache holds the family's ``encode_prompts`` output bit for bit. Prompts are encoded in batches
of ``--batch-size`` distinct prompts in first-occurrence order; some encoders (SD3's CLIP projections) differ in the
last bits between batch compositions, so a run without the cache reproduces a cached run bit for bit only where its
micro-batches hold the same prompts (``--batch-size 1`` makes every cond independent of its batch).
"""

import hashlib
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from miles.models.capabilities import ImageConditioned, supports
from miles.rollout import offline_files
from miles.rollout.data_source import jsonl_values
from miles.rollout.offline_files import OfflineDataError

__all__ = ["main", "prompt_hash", "read_prompt_records", "write_prompt_cache"]

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MANIFEST = "prompt_cache.json"


def prompt_hash(prompt: str) -> str:
    """The cache file stem of a prompt: the first 32 hex digits of SHA-256 of its UTF-8 text (stable everywhere)."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:32]


def read_prompt_records(path: str | Path, input_key: str = "prompt") -> list[dict[str, Any]]:
    """The JSON objects of a JSONL prompt file, in order (blank lines skipped).

    Raises:
        OfflineDataError: for a missing file, a line that is not a JSON object (``file:line``), a record without
            ``input_key`` or a non-string prompt, or a file without records.
    """
    path = Path(path)
    if not path.is_file():
        raise OfflineDataError(f"prompt file {path} does not exist")
    records = []
    for line_no, record in jsonl_values(path, error=OfflineDataError):
        if not isinstance(record, dict):
            raise OfflineDataError(f"{path}:{line_no} is a JSON {type(record).__name__}, not an object")
        if not isinstance(record.get(input_key), str):
            raise OfflineDataError(
                f"{path}:{line_no} has no string field {input_key!r}; set --input-key to the prompt's field"
            )
        records.append(record)
    if not records:
        raise OfflineDataError(f"prompt file {path} holds no records")
    return records


def write_prompt_cache(
    pipeline: str | Path,
    prompts_path: str | Path,
    out_dir: str | Path,
    *,
    input_key: str = "prompt",
    cond_key: str = "cond",
    negative_prompt: str | None = None,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    batch_size: int = 16,
    progress: bool | None = None,
    family_name: str | None = None,
    condition_image_key: str = "condition_image",
) -> dict[str, Any]:
    """Encode every distinct prompt of ``prompts_path`` once with the pipeline's text encoder; write the cache.

    An image-conditioned family (``qwen_image_edit``) encodes every distinct (prompt, reference image) pair, one
    record at a time (references of different aspect ratios cannot share a batch), with
    ``family.encode_conditioned``; its cond files carry the reference latents too, named by :func:`prompt_hash` of
    the prompt and the image's pixels.

    Args:
        pipeline: a pipeline directory of any model family (its ``model_index.json`` picks the family).
        prompts_path: JSONL, one object per line with the prompt under ``input_key``.
        out_dir: the cache directory (created; existing cache files are replaced).
        cond_key: the field of ``prompts.jsonl`` that names each record's cond file (the trainer's ``--cond-key``).
        negative_prompt: encoded to ``negative.safetensors`` (the trainer's ``--negative-cond``); None: the family's
            ``stock_negative_prompt`` (``""``; Qwen-Image ``" "``), as the trainer's ``--negative-prompt`` defaults.
        device: where the text encoder runs.
        dtype: ``"float32"`` or ``"bfloat16"``, the stored dtype (the encoder runs as the family loads it; the
            trainer reads the files back as float32).
        batch_size: distinct prompts per encoder call.
        progress: show a tqdm bar (None: when there is more than one batch and stderr is a terminal).
        family_name: a registered family name or a dotted path to a family class (the trainer's
            ``--diffusion-model-family``); None reads ``model_index.json``.
        condition_image_key: an image-conditioned family's record key of the reference image (the trainer's
            ``--condition-image-key``; paths relative to ``prompts_path``).

    Returns:
        the manifest written to ``prompt_cache.json``: ``{"pipeline", "family", "prompts", "cond_key",
        "input_key", "dtype", "shapes" ({name: [dims]} of one prompt), "negative_prompt", "count" (distinct
        prompts), "records"}``.

    Raises:
        OfflineDataError: for a missing or unsupported pipeline, a bad prompt file, an unwritable ``out_dir``, an
            unknown dtype or a batch size below 1; for an image-conditioned family, a record without a readable
            reference image.
    """
    from miles.models.base import encode_one_prompt

    if dtype not in DTYPES:
        raise OfflineDataError(f"--dtype {dtype!r} is unknown; choose one of {list(DTYPES)}")
    family = offline_files.open_family(pipeline, family_name, batch_size)
    pipeline, out_dir = Path(pipeline), Path(out_dir)
    if negative_prompt is None:
        negative_prompt = family.stock_negative_prompt
    records = read_prompt_records(prompts_path, input_key)
    offline_files.ensure_writable_dir(out_dir, "cond")

    encoder = family.load_text_encoder(pipeline, device=device)
    store = DTYPES[dtype]
    shapes: dict[str, list[int]] = {}
    if supports(family, ImageConditioned):
        keys, names = _encode_conditioned(
            family, encoder, records, Path(prompts_path).parent, input_key, condition_image_key, out_dir, store, shapes
        )
        distinct = list(names)
    else:
        distinct = list(dict.fromkeys(record[input_key] for record in records))
        keys = [record[input_key] for record in records]
        names = {prompt: f"cond/{prompt_hash(prompt)}.safetensors" for prompt in distinct}
    for _, batch in offline_files.batches(
        [] if supports(family, ImageConditioned) else distinct, batch_size, progress, "prompt", "encoding prompts"
    ):
        cond = family.encode_prompts(encoder, batch)
        for row, prompt in enumerate(batch):
            one = {key: value[row].to(store) for key, value in cond.items()}
            shapes = shapes or {key: list(value.shape) for key, value in one.items()}
            offline_files.save_tensors(out_dir / names[prompt], one, {"prompt": prompt, "family": family.name})
    # encoded as the engine encodes it without a cache (miles.rollout.conditioning)
    negative = encode_one_prompt(family, encoder, negative_prompt)
    offline_files.save_tensors(
        out_dir / "negative.safetensors",
        {key: value.to(store) for key, value in negative.items()},
        {"prompt": negative_prompt, "family": family.name},
    )
    # prompts.jsonl last: a crash before it leaves no record that names a missing file.
    offline_files.write_records(
        out_dir / "prompts.jsonl", [{**record, cond_key: names[key]} for record, key in zip(records, keys)]
    )
    logger.info("cached %d distinct prompts of %d records in %s", len(distinct), len(records), out_dir)
    return offline_files.write_manifest(
        out_dir / MANIFEST,
        pipeline,
        family,
        prompts=str(Path(prompts_path).resolve()),
        input_key=input_key,
        cond_key=cond_key,
        dtype=dtype,
        shapes=shapes,
        negative_prompt=negative_prompt,
        count=len(distinct),
        records=len(records),
    )


def _encode_conditioned(family, encoder, records, base_dir, input_key, image_key, out_dir, store, shapes):
    """Encode each distinct (prompt, reference image) pair of an image-conditioned family's records once; returns
    each record's key and ``{key: cond file name}``."""
    from miles.rollout.data_source import load_image

    keys, names = [], {}
    for line, record in enumerate(records, start=1):
        if image_key not in record:
            raise OfflineDataError(
                f"record {line} has no reference image under --condition-image-key {image_key!r}; the "
                f"{family.name} family edits one"
            )
        try:
            image = load_image(record[image_key], base_dir)
        except (ValueError, FileNotFoundError) as exc:
            raise OfflineDataError(f"record {line}: {exc}") from exc
        digest = hashlib.sha256(str(tuple(image.shape)).encode() + image.numpy().tobytes()).hexdigest()
        key = prompt_hash(record[input_key] + "\n" + digest)
        keys.append(key)
        if key in names:
            continue
        names[key] = f"cond/{key}.safetensors"
        cond = family.encode_conditioned(encoder, [record[input_key]], [image])
        one = {name: value[0].to(store) for name, value in cond.items()}
        shapes.update(shapes or {name: list(value.shape) for name, value in one.items()})
        offline_files.save_tensors(out_dir / names[key], one, {"prompt": record[input_key], "family": family.name})
    return keys, names


def main(argv: list[str] | None = None) -> int:
    """``python -m miles.rollout.prompt_cache PIPELINE PROMPTS CACHE_DIR [--negative-prompt P ...]``; returns the exit
    code (0, or 2 after one error line on stderr)."""
    parser = offline_files.command_parser(
        "python -m miles.rollout.prompt_cache",
        "Encode every distinct prompt of a JSONL file once with the pipeline's text encoder.",
        ("prompts", "JSONL prompt file"),
        "cache directory to write",
        batch_size=16,
        batch_help="prompts per encoder call",
    )
    parser.add_argument("--input-key", default="prompt", help="JSONL key of the prompt (default: prompt)")
    parser.add_argument("--cond-key", default="cond", help="key naming each record's cond file (default: cond)")
    parser.add_argument(
        "--negative-prompt",
        default=None,
        help='negative prompt to cache (default: the model family\'s stock one, "" or Qwen-Image\'s " ")',
    )
    parser.add_argument("--device", default="cpu", help="device of the text encoder (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="stored dtype (default: float32)")
    parser.add_argument(
        "--condition-image-key",
        default="condition_image",
        help="key of the reference image of an image-conditioned family (qwen_image_edit; default: condition_image)",
    )

    def summary(manifest: dict, out: Path) -> str:
        return (
            f"cached {manifest['count']} distinct prompts ({manifest['records']} records, {manifest['family']}) in "
            f"{out}; train with --prompt-data {out / 'prompts.jsonl'} --negative-cond {out / 'negative.safetensors'}"
        )

    options = ("input_key", "cond_key", "negative_prompt", "device", "dtype", "condition_image_key")
    return offline_files.run_command(parser, argv, write_prompt_cache, options, summary)


if __name__ == "__main__":
    sys.exit(main())
