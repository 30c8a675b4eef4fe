"""``RolloutGenerator``: one DP shard of prompts in, its train pairs out; the one copy of generation.

Every process that generates uses it: each actor rank (on its own FSDP student, its collectives the group's) and
each ``--rollout-num-gpus`` engine replica (on an unsharded copy of the student, ``LocalCollectives``). Per shard::

    samples = data samples of the records          # --train-only: each record's image or latent, no sampling
            | engine.generate(shard)               # else the student's few-step sampler (miles.rollout.engine)
    pairs   = converter(args, samples)             # the spec's converter (the user's or the method's), one per sample
    every rank holds as many pairs as the others    # one all-reduce, before any other collective
    pair.extras[name] = data sample of its record  # each side input the method declared (DMD2 GAN: "real")

A sample's noise, stop step and side-input record depend only on the rollout, the seed and the sample's index, so a
shard gives the same pairs on an actor rank and on a replica.
"""

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from miles.config import EngineSpec, hook_name
from miles.models.base import read_scheduler_config
from miles.rollout.conditioning import PromptConditioner
from miles.rollout.engine import RolloutEngine, convert_samples, data_samples
from miles.utils.collectives import Collectives, check_equal_counts
from miles.utils.types import PromptShard, SideRecords, TrainPair
from miles.utils.validation import HookResultError

__all__ = ["RolloutGenerator"]

logger = logging.getLogger(__name__)


class RolloutGenerator:
    """Generates and converts the shards of one process.

    Args:
        spec: the engine's spec: its schedule, step strategy, converter, the data keys and ``train_only``.
        family: the pipeline's model family.
        denoiser: the student the engine samples with (an FSDP module on an actor rank, a plain one on a replica).
        device: where the text encoder runs (for prompts without a cached cond).
        collectives: the generating group's (``LocalCollectives`` for a process that generates alone).
        group: the group's name in errors (``"actor"``).
        inference: a context factory every sampling pass runs in (the actor's: eval mode, no grad, the compute
            dtype, resharded after); default none.
        on_text_encoder: called with the text encoder's modules when it loads (the actor's: its group's sleep
            controller keeps them, :meth:`~miles.backends.fsdp_utils.sleep.SleepController.register`); default none.
        args: the command's parsed flags, the converter's and the step strategy's first argument (their documented
            signatures); nothing else reads them.
    """

    def __init__(
        self,
        spec: EngineSpec,
        family: Any,
        denoiser: nn.Module,
        *,
        args: Any = None,
        device: torch.device,
        collectives: Collectives,
        group: str = "actor",
        inference: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        on_text_encoder: Callable[[list[nn.Module]], None] | None = None,
    ) -> None:
        self.spec, self.args, self.family, self.denoiser, self.device = spec, args, family, denoiser, device
        self.collectives, self.group, self.inference = collectives, group, inference
        self.on_text_encoder = on_text_encoder
        self.converter = spec.converter
        self.latent_shape = family.latent_shape(spec.pipeline)
        self._engine: RolloutEngine | None = None

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine on the student (built on first use; its text encoder loads lazily, in the compute dtype
        ``--train-dtype``)."""
        if self._engine is None:
            spec = self.spec
            conditioner = PromptConditioner(
                spec,
                self.family,
                spec.pipeline,
                device=self.device,
                # The compute dtype (--train-dtype: float32, bfloat16, float16 are torch's own names).
                dtype=getattr(torch, spec.dtype),
                on_load=self.on_text_encoder,
            )
            self._engine = RolloutEngine(
                spec,
                self.family,
                self.denoiser,
                conditioner,
                self.latent_shape,
                read_scheduler_config(spec.pipeline)["num_train_timesteps"],
                args=self.args,
            )
        return self._engine

    def generate(self, shard: PromptShard) -> list[TrainPair]:
        """Collective: the shard's train pairs, in the shard's order (module docstring).

        Raises:
            HookResultError: naming the converter, when it returns something else than one pair per sample (on
                this rank) or failed on another rank.
            ValueError: when the ranks' pair counts differ, a side input does not hold one record per pair, or a
                data record has no usable image or latent.
        """
        if self.spec.data.train_only:
            samples = data_samples(self.spec, self.family, self.engine.conditioner, shard, self.latent_shape)
        else:
            with self.inference():
                samples = self.engine.generate(shard, sync_last_step=self._largest_step)
        path = hook_name(self.converter)
        problem, pairs = None, []
        try:
            pairs = convert_samples(self.args, self.converter, samples)
        except HookResultError as exc:
            problem = exc
        # Before any other collective: a rank whose converter failed would otherwise leave the others waiting.
        check_equal_counts(self.collectives, len(pairs), f"converter {path}", self.group, problem)
        for name, side in shard.side_data.items():
            self._attach(shard, name, side, pairs)
        return pairs

    def _largest_step(self, step: int) -> int:
        # Every rank of an FSDP group runs the same forwards: the largest last step of all ranks.
        return self.collectives.all_reduce_max([step])[0]

    def _attach(self, shard: PromptShard, name: str, side: SideRecords, pairs: list[TrainPair]) -> None:
        """Give each pair, in order, the data sample of the side input's record at the same position (its clean
        latent and prompt cond), as ``pair.extras[name]``: every micro-batch then holds as many side samples as
        pairs."""
        if len(pairs) != len(side.records):
            raise ValueError(
                f"{len(pairs)} train pairs but {len(side.records)} records of side input {name!r} in rollout "
                f"{shard.rollout_id}; a side input pairs one record with each train pair"
            )
        records = PromptShard(
            shard.rollout_id,
            list(shard.sample_indices),
            [str(record[self.spec.data.input_key]) for record in side.records],
            side.records,
            side.base_dir,
        )
        # Errors name the side input's record ("real sample 5 (prompt ...)" for the DMD2 GAN's real data).
        samples = data_samples(
            self.spec, self.family, self.engine.conditioner, records, self.latent_shape, source=f"{name} sample"
        )
        for pair, sample in zip(pairs, samples):
            pair.extras[name] = sample

    def sample(self, shard: PromptShard, num_steps: int | None = None, guidance_scale: float | None = None):
        """Full-trajectory samples of the shard with the current weights (evaluation): float32 latents
        ``(B, C, H, W)`` (:meth:`miles.rollout.engine.RolloutEngine.sample`)."""
        with self.inference():
            return self.engine.sample(shard, num_steps=num_steps, guidance_scale=guidance_scale)
