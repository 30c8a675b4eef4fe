"""The RolloutManager: the rollout's data source, and the one place that decides the DP split.

``RolloutManager`` is a plain class (importable and testable without Ray); ``RayRolloutManager =
ray.remote(RolloutManager)`` is the actor the driver creates. It samples nothing itself: per rollout it takes the next
``--rollout-batch-size`` prompts and splits them into one ``PromptShard`` per DP rank (contiguous, equal, a
prompt's ``--n-samples-per-prompt`` samples kept together). Rank i of the actor group (or an engine replica)
generates shard i, so N ranks generate N× the samples in the time one takes::

    records = data source.next_batch(--rollout-batch-size)         # seeded, per-epoch shuffle, checkpointed cursor
    return [Box(ray.put(PromptShard of ranks r's prompts)) for r in range(DP size)]
"""

import logging
from typing import Any

import ray

from miles.rollout.data_source import JsonlPromptSource, make_prompt_shard, split_prompts
from miles.rollout.engine import data_base_dir
from miles.utils.types import Box, PromptShard

__all__ = ["RolloutManager", "RayRolloutManager"]

logger = logging.getLogger(__name__)


class RolloutManager:
    """Owns the prompt source and its cursor.

    Args:
        args: run args (``miles.driver.arguments.parse_args``); reads ``prompt_data``, ``input_key``,
            ``rollout_seed``, ``rollout_shuffle``, ``rollout_batch_size``, ``n_samples_per_prompt``.
        dp_size: data-parallel size of the trainer groups; every rollout is split into this many shards.
        real_data: a JSONL of real samples (an image or latent and a prompt per record) to deal one per generated
            sample beside the prompts, from its own seeded, checkpointed cursor (the method asks for it: the DMD2
            GAN's ``--dmd2-gan-real-data``); None for none.

    Raises:
        FileNotFoundError / ValueError: as ``JsonlPromptSource`` for a bad ``--prompt-data``.
    """

    def __init__(self, args: Any, dp_size: int, real_data: str | None = None) -> None:
        self.args = args
        self.dp_size = dp_size
        self.data_source = JsonlPromptSource(
            args.prompt_data,
            input_key=args.input_key,
            seed=args.rollout_seed,
            shuffle=getattr(args, "rollout_shuffle", True),
        )
        self.base_dir = data_base_dir(args.prompt_data)
        self.real_source = None
        if real_data:
            self.real_source = JsonlPromptSource(
                real_data, input_key=args.input_key, seed=args.rollout_seed, purpose="real_shuffle", flag="real data"
            )
            self.real_base_dir = data_base_dir(real_data)

    def shards(self, rollout_id: int) -> list[PromptShard]:
        """The next rollout's prompts, one ``PromptShard`` per DP rank (advances the cursor).

        Raises:
            ValueError: if ``--rollout-batch-size`` does not split evenly over the DP size.
        """
        args = self.args
        n = args.n_samples_per_prompt
        records = self.data_source.next_batch(args.rollout_batch_size)
        real = self.real_source.next_batch(len(records) * n) if self.real_source is not None else None
        return [
            make_prompt_shard(
                rollout_id,
                records[part.start : part.stop],
                input_key=args.input_key,
                n_samples_per_prompt=n,
                first_prompt_index=part.start,
                base_dir=self.base_dir,
                real_records=None if real is None else real[part.start * n : part.stop * n],
                real_base_dir=getattr(self, "real_base_dir", "."),
            )
            for part in split_prompts(len(records), self.dp_size)
        ]

    def generate(self, rollout_id: int) -> list[Box]:
        """One ``Box(ray.put(PromptShard))`` per DP rank for rollout ``rollout_id``."""
        return [Box(ray.put(shard)) for shard in self.shards(rollout_id)]

    # -- checkpointing -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The data cursors (prompts, and real data when dealt), saved with checkpoints."""
        state = {"data_source": self.data_source.state_dict()}
        if self.real_source is not None:
            state["real_source"] = self.real_source.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the data cursors.

        Raises:
            ValueError: if the checkpoint has no real-data cursor but this run deals real data.
        """
        self.data_source.load_state_dict(state["data_source"])
        if self.real_source is not None:
            if "real_source" not in state:
                raise ValueError("the checkpoint was saved without real data; resume with the same flags")
            self.real_source.load_state_dict(state["real_source"])


RayRolloutManager = ray.remote(RolloutManager)
