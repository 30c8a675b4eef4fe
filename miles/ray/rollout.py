"""The RolloutManager: the rollout's data source, and the one place that decides the DP split.

``RolloutManager`` is a plain class (importable and testable without Ray); ``RayRolloutManager =
ray.remote(RolloutManager)`` is the actor the driver creates. It samples nothing itself: per rollout it takes the next
``--rollout-batch-size`` prompts and splits them into one ``PromptShard`` per DP rank (contiguous, equal, a
prompt's ``--n-samples-per-prompt`` samples kept together). Rank i of the actor group (or an engine replica)
generates shard i, so N ranks generate N× the samples in the time one takes::

    records = data source.next_batch(--rollout-batch-size)         # seeded, per-epoch shuffle, checkpointed cursor
    side    = each side input's source.next_batch(one per sample)  # the method's (DMD2 GAN: real data)
    return [Box(ray.put(PromptShard of ranks r's prompts and side records)) for r in range(DP size)]
"""

import logging
from typing import Any

import ray

from miles.config import DataSpec
from miles.rollout.data_source import JsonlPromptSource, make_prompt_shard, split_prompts
from miles.rollout.engine import data_base_dir
from miles.utils.types import Box, PromptShard, SideInput, SideRecords

__all__ = ["RolloutManager", "RayRolloutManager"]

logger = logging.getLogger(__name__)


class RolloutManager:
    """Owns the prompt source and its cursor, and the sources of the method's side inputs.

    Args:
        data: the run's data spec: ``prompt_data``, ``input_key``, ``seed`` (``--rollout-seed``), ``shuffle``,
            ``rollout_batch_size``, ``n_samples_per_prompt``.
        dp_size: data-parallel size of the trainer groups; every rollout is split into this many shards.
        side_inputs: the JSONL files the method needs beside the prompts (``Method.side_inputs``: the DMD2 GAN's
            real data), each dealt one record per generated sample from its own seeded, checkpointed cursor.

    Raises:
        FileNotFoundError / ValueError: as ``JsonlPromptSource`` for a bad ``--prompt-data`` or side input.
    """

    def __init__(self, data: DataSpec, dp_size: int, side_inputs: list[SideInput] = ()) -> None:
        self.data = data
        self.dp_size = dp_size
        self.data_source = JsonlPromptSource(
            data.prompt_data, input_key=data.input_key, seed=data.seed, shuffle=data.shuffle
        )
        self.base_dir = data_base_dir(data.prompt_data)
        self.side_sources = {
            side.name: JsonlPromptSource(
                side.path,
                input_key=data.input_key,
                seed=data.seed,
                purpose=f"{side.name}_shuffle",
                flag=side.flag,
            )
            for side in side_inputs
        }
        self.side_base_dirs = {side.name: data_base_dir(side.path) for side in side_inputs}

    def shards(self, rollout_id: int) -> list[PromptShard]:
        """The next rollout's prompts, one ``PromptShard`` per DP rank (advances the cursors).

        Raises:
            ValueError: if ``--rollout-batch-size`` does not split evenly over the DP size.
        """
        data = self.data
        n = data.n_samples_per_prompt
        records = self.data_source.next_batch(data.rollout_batch_size)
        side = {name: source.next_batch(len(records) * n) for name, source in self.side_sources.items()}
        return [
            make_prompt_shard(
                rollout_id,
                records[part.start : part.stop],
                input_key=data.input_key,
                n_samples_per_prompt=n,
                first_prompt_index=part.start,
                base_dir=self.base_dir,
                side_data={
                    name: SideRecords(dealt[part.start * n : part.stop * n], self.side_base_dirs[name])
                    for name, dealt in side.items()
                },
            )
            for part in split_prompts(len(records), self.dp_size)
        ]

    def generate(self, rollout_id: int) -> list[Box]:
        """One ``Box(ray.put(PromptShard))`` per DP rank for rollout ``rollout_id``."""
        return [Box(ray.put(shard)) for shard in self.shards(rollout_id)]

    # -- checkpointing -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The data cursors (prompts, and each side input's), saved with checkpoints."""
        state = {"data_source": self.data_source.state_dict()}
        if self.side_sources:
            state["side_sources"] = {name: source.state_dict() for name, source in self.side_sources.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the data cursors.

        A side input the checkpoint has no cursor of (phase 1 -> phase 2's real data) starts from its first record.
        """
        self.data_source.load_state_dict(state["data_source"])
        saved = state.get("side_sources", {})
        for name, source in self.side_sources.items():
            if name not in saved:
                # Phase 1 -> phase 2: the GAN head's real data joins the run; its cursor starts at its file's start.
                logger.info("the checkpoint has no cursor of side input %r: it starts from the first record", name)
                continue
            source.load_state_dict(saved[name])


RayRolloutManager = ray.remote(RolloutManager)
