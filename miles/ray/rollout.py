"""The RolloutManager: turns prompts into per-DP-rank shards of train pairs, once per rollout.

``RolloutManager`` is a plain class (importable and testable without Ray); ``RayRolloutManager =
ray.remote(RolloutManager)`` is the actor the driver creates. Per rollout::

    records = data source.next_batch(--rollout-batch-size)
    samples = engine.generate(prompt × --n-samples-per-prompt, stop steps from the step strategy)
              (or, with --train-only, data samples whose x0 is the record's image under --image-key)
    pairs   = converter(args, samples)                    # --custom-expand-samples-to-train-pairs-path
    return [Box(ray.put(shard)) for shard in exact DP split of pairs]
"""

import logging
import time
from pathlib import Path
from typing import Any

import ray
import torch

from miles.models import get_model_family
from miles.rollout.data_source import JsonlPromptSource, load_image_latent
from miles.rollout.engine import DiffusionEngine, default_device, needs_negative
from miles.utils.misc import load_function
from miles.utils.types import Box, DenoisingEnv, Sample, TrainPair

__all__ = ["RolloutManager", "RayRolloutManager", "split_for_dp"]

logger = logging.getLogger(__name__)


def split_for_dp(pairs: list[TrainPair], dp_size: int) -> list[list[TrainPair]]:
    """Split ``pairs`` into ``dp_size`` contiguous equal shards; rank r gets ``pairs[r·n : (r+1)·n]``.

    Raises:
        ValueError: if ``len(pairs)`` is not a multiple of ``dp_size``; nothing is ever dropped.
    """
    if dp_size < 1:
        raise ValueError(f"DP size must be >= 1, got {dp_size}")
    if len(pairs) % dp_size:
        raise ValueError(
            f"the rollout's {len(pairs)} train pairs do not split evenly over DP size {dp_size}: make "
            "--rollout-batch-size x --n-samples-per-prompt a multiple of the DP size "
            "(--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    per_rank = len(pairs) // dp_size
    return [pairs[rank * per_rank : (rank + 1) * per_rank] for rank in range(dp_size)]


class RolloutManager:
    """Owns the prompt source, the model family, the text encoder and the student's engine.

    Args:
        args: run args (``miles.utils.arguments.parse_args``).
        dp_size: data-parallel size of the trainer groups; every rollout is split into this many shards.

    Raises:
        ValueError: if ``--custom-expand-samples-to-train-pairs-path`` is unset or cannot be loaded.
    """

    def __init__(self, args: Any, dp_size: int) -> None:
        self.args = args
        self.dp_size = dp_size
        self.data_source = JsonlPromptSource(
            args.prompt_data,
            input_key=args.input_key,
            seed=args.rollout_seed,
            shuffle=getattr(args, "rollout_shuffle", True),
        )
        self.family = get_model_family(args.hf_checkpoint, getattr(args, "diffusion_model_family", None))
        self.latent_shape = self.family.latent_shape(args.hf_checkpoint)
        self.device = default_device()
        self.encoder = self.family.load_text_encoder(args.hf_checkpoint, device=self.device)
        converter_path = getattr(args, "custom_expand_samples_to_train_pairs_path", None)
        if not converter_path:
            raise ValueError(
                "--custom-expand-samples-to-train-pairs-path is not set: the RolloutManager needs a converter "
                "(--loss-type sft_loss and dmd2 set one)"
            )
        self.converter = load_function(converter_path)
        strategy_path = getattr(args, "diffusion_step_strategy_path", None)
        self.step_strategy = load_function(strategy_path) if strategy_path else None
        # --train-only needs no sampler for its rollouts; evaluation and weight updates create it on first use.
        self._engine = None if args.train_only else self._build_engine()

    def _build_engine(self) -> DiffusionEngine:
        return DiffusionEngine(
            self.args, self.family, self.args.hf_checkpoint, encoder=self.encoder, device=self.device
        )

    @property
    def engine(self) -> DiffusionEngine:
        if self._engine is None:
            self._engine = self._build_engine()
        return self._engine

    # -- rollouts ------------------------------------------------------------------------------------------------
    def generate_samples(self, rollout_id: int) -> list[Sample]:
        """The rollout's samples: ``--rollout-batch-size`` prompts × ``--n-samples-per-prompt``, sample index
        ``prompt_idx · n + j``."""
        args = self.args
        n = args.n_samples_per_prompt
        records = self.data_source.next_batch(args.rollout_batch_size)
        prompts = [self.data_source.prompt(record) for record in records for _ in range(n)]
        indices = list(range(len(prompts)))
        skip = {args.input_key, getattr(args, "image_key", None)}
        metadata = [
            {key: value for key, value in record.items() if key not in skip} for record in records for _ in range(n)
        ]
        if args.train_only:
            return self._data_samples(records, prompts, indices, metadata)
        if self.step_strategy is not None:
            stop_steps = self.step_strategy(args, rollout_id, indices, self.engine.num_steps)
        else:
            stop_steps = None
        return self.engine.generate(prompts, indices, rollout_id, stop_steps=stop_steps, metadata=metadata)

    def _data_samples(self, records, prompts, indices, metadata) -> list[Sample]:
        image_key = getattr(self.args, "image_key", "image")
        base_dir = Path(self.args.prompt_data).parent
        n = self.args.n_samples_per_prompt
        cond = self.family.encode_prompts(self.encoder, prompts)
        neg_row = {}
        if needs_negative(self.args):
            neg = self.family.encode_prompts(self.encoder, [getattr(self.args, "negative_prompt", "")])
            neg_row = {key: value[0].clone() for key, value in neg.items()}
        samples = []
        for position, (prompt, index, meta) in enumerate(zip(prompts, indices, metadata)):
            record = records[position // n]
            if image_key not in record:
                raise ValueError(
                    f"--train-only sample {index} (prompt {prompt!r}) has no image under --image-key {image_key!r}"
                )
            samples.append(
                Sample(
                    index=index,
                    prompt=prompt,
                    metadata=meta,
                    env=DenoisingEnv(
                        pos_cond={key: value[position].clone() for key, value in cond.items()},
                        neg_cond=neg_row,
                        guidance_scale=1.0,
                    ),
                    x0=load_image_latent(
                        self.family,
                        record[image_key],
                        base_dir,
                        expected_shape=self.latent_shape,
                        where=f"--train-only sample {index} (prompt {prompt!r}, --image-key {image_key!r})",
                    ).float(),
                )
            )
        return samples

    def generate(self, rollout_id: int) -> list[Box]:
        """Run one rollout and return one ``Box(ray.put(shard))`` per DP rank (shard = list of ``TrainPair``).

        Raises:
            ValueError: if the converter's pairs do not split evenly over the DP size.
        """
        start = time.perf_counter()
        samples = self.generate_samples(rollout_id)
        pairs = self.converter(self.args, samples)
        if len(pairs) % self.dp_size and len(samples) % self.dp_size == 0:
            # The samples split evenly, so the uneven count is the converter's doing, not the batch flags'.
            raise ValueError(
                f"--custom-expand-samples-to-train-pairs-path {self.args.custom_expand_samples_to_train_pairs_path} "
                f"returned {len(pairs)} train pairs for {len(samples)} samples in rollout {rollout_id}, which do not "
                f"split evenly over DP size {self.dp_size}; the converter must return a multiple of the DP size"
            )
        shards = split_for_dp(pairs, self.dp_size)
        logger.info(
            "rollout %d: %d samples -> %d pairs in %.2fs",
            rollout_id,
            len(samples),
            len(pairs),
            time.perf_counter() - start,
        )
        return [Box(ray.put(shard)) for shard in shards]

    # -- weights and evaluation ----------------------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the student's full state dict (CPU tensors; pass its ObjectRef as the argument) into the engine."""
        self.engine.load_weights(state_dict)

    def evaluate(
        self,
        prompts: list[str],
        sample_indices: list[int],
        num_steps: int | None = None,
        guidance_scale: float | None = None,
    ) -> torch.Tensor:
        """Full-trajectory samples of the current student: uint8 images ``(B, H, W, C)``.

        ``num_steps`` / ``guidance_scale`` default to ``--diffusion-num-steps`` / ``--diffusion-guidance-scale``.
        """
        latents = self.engine.sample(prompts, sample_indices, num_steps=num_steps, guidance_scale=guidance_scale)
        return self.family.latents_to_images(latents)

    # -- checkpointing -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The data cursor, saved with checkpoints."""
        return {"data_source": self.data_source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the data cursor."""
        self.data_source.load_state_dict(state["data_source"])


RayRolloutManager = ray.remote(RolloutManager)
