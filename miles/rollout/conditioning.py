"""The cond kwargs of a rollout's prompts: read from a prompt cache, or encoded by the family's text encoder.

A prompt cache stores each prompt's cond once, offline, so that no text encoder (SD3's T5-XXL is 4.7B parameters)
has to sit on the training devices. A cached record names its file under ``--cond-key`` (default ``cond``), a path
relative to the JSONL file::

    {"prompt": "a red fox in the snow", "cond": "cond/3f2a….safetensors"}

and the file holds the family's cond kwargs for that prompt without a batch dimension (for SD3
``encoder_hidden_states (L, D)`` and ``pooled_projections (P,)``). The negative prompt's cond comes from
``--negative-cond`` (a file of the same kind) or is encoded from ``--negative-prompt``. ``python -m
miles.rollout.prompt_cache`` writes such a cache for any family.

An image-conditioned family (:class:`miles.models.capabilities.ImageConditioned`, Qwen-Image-Edit) encodes each
record's prompt with its reference image (``--condition-image-key``).

Records without a cached cond are encoded by the family's text encoder, loaded on first use in the process that
needs it (each DP rank encodes its own shard), in the trainer's compute dtype, and handed to the group's sleep
controller: it then sleeps and wakes with the actor group's own state. ``--dry-run`` counts it in the memory plan
(:func:`miles.driver.memory_plan.text_encoder_memory`).
"""

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.config import EngineSpec
from miles.models.base import encode_one_prompt, text_encoder_modules
from miles.models.capabilities import ImageConditioned, supports

__all__ = ["PromptConditioner", "load_cond_file"]

logger = logging.getLogger(__name__)


def load_cond_file(path: str | Path, where: str = "") -> dict[str, torch.Tensor]:
    """Read one prompt's cond kwargs from a ``.safetensors`` file as float32 CPU tensors (no batch dim).

    Raises:
        FileNotFoundError: if the file does not exist (the message starts with ``where``).
        ValueError: if it is not a readable safetensors file or holds no tensor.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    prefix = f"{where}: " if where else ""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{prefix}cached cond file {path} does not exist")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{prefix}cached cond file {path} is not a readable safetensors file ({exc})") from exc
    if not tensors:
        raise ValueError(f"{prefix}cached cond file {path} holds no tensor")
    return {key: value.float() for key, value in tensors.items()}


class PromptConditioner:
    """Gives batched cond kwargs for shards of records, and the negative prompt's cond.

    Args:
        spec: the engine's spec: the data's ``cond_key``, ``negative_cond``, ``negative_prompt`` and where it came
            from.
        family: the pipeline's model family (``load_text_encoder``, ``encode_prompts``).
        pipeline_path: the pipeline whose text encoder encodes uncached prompts.
        device: where the text encoder runs.
        dtype: its weights' dtype (a trainer's compute dtype, ``--train-dtype``); the cond it returns is float32
            whatever it is.
        on_load: called once with the encoder's torch modules when it loads (an actor rank registers them with its
            group's sleep controller, so that they leave the GPU when the group sleeps).
    """

    def __init__(
        self,
        spec: EngineSpec,
        family: Any,
        pipeline_path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        on_load: Callable[[list[nn.Module]], None] | None = None,
    ) -> None:
        self.spec = spec
        self.family = family
        self.pipeline_path = pipeline_path
        self.device = device
        self.dtype = dtype
        self.on_load = on_load
        self.cond_key = spec.data.cond_key
        self._encoder = None
        self._negative: dict[str, torch.Tensor] | None = None

    @property
    def encoder(self):
        """The family's text encoder in ``dtype`` on ``device``, loaded on first use."""
        if self._encoder is None:
            self._encoder = self.family.load_text_encoder(self.pipeline_path, device=self.device, dtype=self.dtype)
            logger.debug("loaded the %s text encoder on %s in %s", self.family.name, self.device, self.dtype)
            if self.on_load is not None:
                self.on_load(text_encoder_modules(self._encoder))
        return self._encoder

    def cond(self, prompts: list[str], records: list[dict], base_dir: str | Path = ".") -> dict[str, torch.Tensor]:
        """Batched cond kwargs ``{name: (B, ...)}`` (float32, CPU) of B prompts, in order.

        A record that names a cached file under ``--cond-key`` is read from it; the others are encoded together.

        Raises:
            ValueError: if cached and encoded conds disagree on keys or shapes (a cache written for another
                pipeline), or as :func:`load_cond_file`.
        """
        rows: list[dict[str, torch.Tensor] | None] = [None] * len(prompts)
        to_encode = []
        for position, record in enumerate(records):
            cached = record.get(self.cond_key) if isinstance(record, dict) else None
            if isinstance(cached, str):
                rows[position] = load_cond_file(Path(base_dir) / cached, where=f"prompt {prompts[position]!r}")
            else:
                to_encode.append(position)
        if len(to_encode) == len(prompts):
            return self._encode(list(prompts), list(records), base_dir)
        if to_encode:
            encoded = self._encode([prompts[p] for p in to_encode], [records[p] for p in to_encode], base_dir)
            for row, position in enumerate(to_encode):
                rows[position] = {key: value[row] for key, value in encoded.items()}
        return _stack_rows(rows)

    def _encode(self, prompts: list[str], records: list, base_dir: str | Path) -> dict[str, torch.Tensor]:
        """Encode prompts with the family's text encoder; an image-conditioned family's with each record's reference
        image (``--condition-image-key``) too.

        Raises:
            ValueError: naming the prompt and the flag, for a record without a reference image; as
                :func:`miles.rollout.data_source.load_image` for a bad one.
        """
        if not supports(self.family, ImageConditioned):
            return self.family.encode_prompts(self.encoder, prompts)
        from miles.rollout.data_source import load_image

        key = self.spec.data.condition_image_key
        images = []
        for prompt, record in zip(prompts, records):
            if not isinstance(record, dict) or key not in record:
                raise ValueError(
                    f"prompt {prompt!r}: the {self.family.name} family edits a reference image, but the record has none "
                    f"under --condition-image-key {key!r}"
                )
            images.append(load_image(record[key], base_dir))
        return self.family.encode_conditioned(self.encoder, prompts, images)

    def negative(self) -> dict[str, torch.Tensor]:
        """The negative prompt's cond kwargs, one row without a batch dim: from ``--negative-cond`` when given,
        else ``--negative-prompt`` (unset: the family's ``stock_negative_prompt``) encoded by the text encoder, with
        one log line that says which prompt and why. Computed once per process."""
        if self._negative is None:
            path = self.spec.negative_cond
            if path:
                self._negative = load_cond_file(path, where="--negative-cond")
            else:
                prompt = self.spec.negative_prompt
                origin = self.spec.negative_prompt_origin or "--negative-prompt"
                if prompt is None:
                    prompt = self.family.stock_negative_prompt
                    origin = f"the {self.family.name} family's (its stock pipeline's default)"
                logger.info("encoding the negative prompt %r: %s", prompt, origin)
                self._negative = encode_one_prompt(self.family, self.encoder, prompt)
        return self._negative


def _stack_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    keys = set(rows[0])
    for row in rows[1:]:
        if set(row) != keys:
            raise ValueError(
                f"cached cond keys {sorted(row)} differ from {sorted(keys)}; was the prompt cache written for "
                "this pipeline?"
            )
    try:
        return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    except RuntimeError as exc:
        raise ValueError(f"cached cond shapes differ within a batch ({exc}); rewrite the prompt cache") from exc
