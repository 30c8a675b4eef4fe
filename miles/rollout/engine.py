"""The rollout engine: the student's few-step sampler, run where the student's weights already are.

One ``RolloutEngine`` per process that generates: each rank of the actor group (on the student's own FSDP module,
under ``no_grad``; no second copy of the student and no weight transfer) or, with ``--rollout-num-gpus N``, each of
the N engine replicas. Every engine generates only its own shard of the rollout (``PromptShard``), so N ranks
generate N× the samples in the time one takes.

Math: :mod:`miles.utils.sampling` (σ schedule, CFG, the ``dmd2`` and ``euler`` step rules). Per shard::

    stop steps   = step strategy(args, rollout_id, sample indices, S)      # DMD2: stop_at_random_step (the spec's)
    last step    = max over the shard, or over every rank (sync_last_step), so FSDP ranks run equal forwards
    for each micro-batch of --micro-batch-size samples:
        cond     = prompt cond (cached or encoded), plus the negative prompt's when asked for
        x_0      = initial noise of (seed, rollout, sample index); run steps 0..last step
    sample       = its x_i and x̂0_i at its stop step (or the whole trajectory and the final sample)

Latents have any rank (``(C, H, W)`` images, ``(C, F, H, W)`` video): the initial noise and the re-noise are drawn
in the family's ``latent_shape`` and nothing else here reads the shape.

A sample's noise and stop step depend only on ``(seed, rollout, sample index)`` and every micro-batch holds the same
samples whatever the DP size (the shards are contiguous and a multiple of the micro-batch), so a rollout is
bit-identical at 1 and N DP ranks.
"""

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.config import DataSpec, EngineSpec, hook_name
from miles.rollout.conditioning import PromptConditioner
from miles.utils.sampling import (
    STEP_RULES,
    FlowNoiseSchedule,
    denoise,
    initial_noise,
    renoise_noise,
    sample_latents,
)
from miles.utils.types import DenoisingEnv, DiTTrajectory, PromptShard, Sample, TrainPair
from miles.utils.validation import HookResultError

__all__ = [
    "RolloutEngine",
    "convert_samples",
    "data_base_dir",
    "data_samples",
    "record_metadata",
]

logger = logging.getLogger(__name__)


def record_metadata(keys: DataSpec, record: dict) -> dict:
    """A record's fields other than the prompt, the image or latent and the cached cond (``Sample.metadata``)."""
    skip = {keys.input_key, keys.image_key, keys.latent_key, keys.cond_key}
    return {key: value for key, value in record.items() if key not in skip}


def _row(cond: dict[str, torch.Tensor], b: int) -> dict[str, torch.Tensor]:
    # clone: a view would pickle its whole batch storage into every sample's shard
    return {key: value[b].clone() for key, value in cond.items()}


class RolloutEngine:
    """Generates the samples of prompt shards on a given denoiser.

    Args:
        spec: the engine's spec: ``num_steps``, ``flow_shift``, ``timesteps``, ``guidance_scale``, ``step_rule``,
            ``step_strategy``, ``encode_negative``, ``micro_batch_size``, ``seed`` and the data keys.
        family: the pipeline's model family.
        denoiser: the student (plain module or FSDP module; the engine only runs it under ``no_grad``).
        conditioner: gives the prompts' cond and the negative cond.
        latent_shape: one sample's ``(C, H, W)`` (video: ``(C, F, H, W)``), the family's ``latent_shape``.
        num_train_timesteps: the model's timestep scale (the scheduler config's; 1000 for SD3 and digits).
        args: the command's parsed flags, the step strategy's first argument (its documented signature).

    Raises:
        ValueError: on an unknown ``--diffusion-step-rule``.
    """

    def __init__(
        self,
        spec: EngineSpec,
        family: Any,
        denoiser: nn.Module,
        conditioner: PromptConditioner,
        latent_shape: tuple[int, ...],
        num_train_timesteps: int = 1000,
        *,
        args: Any = None,
    ) -> None:
        self.spec, self.args = spec, args
        self.family = family
        self.denoiser = denoiser
        self.conditioner = conditioner
        self.latent_shape = tuple(latent_shape)
        self.num_train_timesteps = num_train_timesteps
        self.schedule = FlowNoiseSchedule(
            spec.num_steps, spec.flow_shift, num_train_timesteps, timesteps=list(spec.timesteps or []) or None
        )
        self.step_rule = spec.step_rule
        if self.step_rule not in STEP_RULES:
            raise ValueError(f"--diffusion-step-rule {self.step_rule!r} is unknown; choose one of {list(STEP_RULES)}")
        self.guidance_scale = float(spec.guidance_scale)
        self.step_strategy = spec.step_strategy
        # The negative cond travels with every sample when a consumer asks for it (the method sets the flag), and
        # whenever the student itself samples with CFG.
        self.encode_negative = spec.encode_negative or self.guidance_scale != 1.0
        logger.debug("rollout engine: %s, %s, rule %s", family.name, self.schedule, self.step_rule)

    @property
    def num_steps(self) -> int:
        return self.schedule.num_steps

    def stop_steps(self, shard: PromptShard) -> list[int | None]:
        """Per sample, the step to stop at (the step strategy's) or None for the whole trajectory.

        Raises:
            ValueError: if the strategy returns the wrong count or a step outside ``[0, S)``.
        """
        if self.step_strategy is None:
            return [None] * len(shard)
        steps = list(self.step_strategy(self.args, shard.rollout_id, list(shard.sample_indices), self.num_steps))
        path = hook_name(self.step_strategy)
        if len(steps) != len(shard):
            raise ValueError(
                f"--diffusion-step-strategy-path {path} returned {len(steps)} stop steps for {len(shard)} samples"
            )
        for index, step in zip(shard.sample_indices, steps):
            if step is not None and not (isinstance(step, int) and 0 <= step < self.num_steps):
                raise ValueError(
                    f"--diffusion-step-strategy-path {path} stops sample {index} at step {step!r}, outside "
                    f"[0, {self.num_steps}) (--diffusion-num-steps)"
                )
        return steps

    @torch.no_grad()
    def generate(self, shard: PromptShard, *, sync_last_step: Callable[[int], int] | None = None) -> list[Sample]:
        """Generate the shard's samples in micro-batches of ``--micro-batch-size``.

        Args:
            shard: this process's share of the rollout.
            sync_last_step: maps this shard's last needed step to the one every process runs (an all-reduce of the
                maximum over FSDP ranks, so that all ranks run the same forwards); default the shard's own.

        Returns:
            One ``Sample`` per shard position, in order, with ``env`` (the prompt's cond; the negative cond when
            asked for) and ``trajectory`` (``[i]`` with x_i, x̂0_i at the stop step i; or every step and the final
            sample for a sample without stop step).
        """
        stop_steps = self.stop_steps(shard)
        last_step = max(self.num_steps - 1 if step is None else step for step in stop_steps)
        if sync_last_step is not None:
            last_step = sync_last_step(last_step)
        neg_row = self.conditioner.negative() if self.encode_negative else {}
        seed = self.spec.seed
        micro_batch_size = max(1, int(self.spec.micro_batch_size))
        samples: list[Sample] = []
        for start in range(0, len(shard), micro_batch_size):
            end = min(start + micro_batch_size, len(shard))
            indices = shard.sample_indices[start:end]
            cond = self.conditioner.cond(shard.prompts[start:end], shard.records[start:end], shard.base_dir)
            neg = {key: value.expand(len(indices), *value.shape) for key, value in neg_row.items()} or None
            result = denoise(
                self.family,
                self.denoiser,
                initial_noise(self.latent_shape, seed, shard.rollout_id, indices),
                cond,
                self.schedule,
                neg_cond=neg,
                guidance_scale=self.guidance_scale,
                step_rule=self.step_rule,
                last_step=last_step,
                fresh_noise=lambda k, idx=indices: renoise_noise(self.latent_shape, seed, shard.rollout_id, idx, k),
            )
            latents = torch.stack(result.latents, dim=1)  # (b, last_step + 1, *latent_shape)
            x0_preds = torch.stack(result.x0_preds, dim=1)
            for b, position in enumerate(range(start, end)):
                step = stop_steps[position]
                steps = list(range(self.num_steps)) if step is None else [step]
                samples.append(
                    Sample(
                        index=shard.sample_indices[position],
                        prompt=shard.prompts[position],
                        metadata=record_metadata(self.spec.data, shard.records[position]),
                        # neg_row is shared by all samples: pickle stores one copy per shard
                        env=DenoisingEnv(pos_cond=_row(cond, b), neg_cond=neg_row, guidance_scale=self.guidance_scale),
                        trajectory=DiTTrajectory(
                            sigmas=self.schedule.sigmas.clone(),
                            timesteps=self.schedule.timesteps.clone(),
                            step_indices=steps,
                            latents=latents[b, steps].clone(),
                            x0_preds=x0_preds[b, steps].clone(),
                            final=result.final[b].clone() if step is None else None,
                        ),
                    )
                )
        return samples

    @torch.no_grad()
    def sample(
        self,
        shard: PromptShard,
        *,
        num_steps: int | None = None,
        guidance_scale: float | None = None,
        batch_size: int = 64,
    ) -> torch.Tensor:
        """Full trajectories of the shard with the engine's weights (evaluation): float32 latents
        ``(B, *latent_shape)``.

        ``num_steps`` overrides ``--diffusion-num-steps`` (then ``--diffusion-timesteps`` is ignored);
        ``guidance_scale`` overrides ``--diffusion-guidance-scale``.
        """
        schedule = self.schedule
        if num_steps:
            schedule = FlowNoiseSchedule(num_steps, self.spec.flow_shift, self.num_train_timesteps)
        guidance = self.guidance_scale if guidance_scale is None else float(guidance_scale)
        return sample_latents(
            self.family,
            self.denoiser,
            lambda start, end: self.conditioner.cond(
                shard.prompts[start:end], shard.records[start:end], shard.base_dir
            ),
            list(shard.sample_indices),
            latent_shape=self.latent_shape,
            schedule=schedule,
            guidance_scale=guidance,
            step_rule=self.step_rule,
            seed=self.spec.seed,
            negative=self.conditioner.negative() if guidance != 1.0 else None,
            batch_size=batch_size,
            rollout_id=shard.rollout_id,
        )


def data_samples(
    spec: EngineSpec,
    family: Any,
    conditioner: PromptConditioner,
    shard: PromptShard,
    latent_shape,
    source: str = "--train-only sample",
) -> list:
    """``--train-only``: the shard's records as data samples whose ``x0`` is the record's clean latent (``source``
    names them in errors: ``"real sample"`` for the GAN's real data).

    The latent is the record's ``--latent-key`` file (already in latent space) or its ``--image-key`` image turned
    into a latent by the family (see :func:`miles.rollout.data_source.load_record_latent`). A sample carries the
    negative prompt's cond when the engine spec asks every sample for it (``encode_negative``).

    Raises:
        ValueError / FileNotFoundError: naming the sample, for a record without image or latent, or a bad one.
    """
    from miles.rollout.data_source import load_record_latent

    cond = conditioner.cond(shard.prompts, shard.records, shard.base_dir)
    neg_row = conditioner.negative() if spec.encode_negative else {}
    samples = []
    for position, (index, prompt, record) in enumerate(zip(shard.sample_indices, shard.prompts, shard.records)):
        x0 = load_record_latent(
            spec.data,
            family,
            record,
            shard.base_dir,
            expected_shape=latent_shape,
            where=f"{source} {index} (prompt {prompt!r})",
        )
        samples.append(
            Sample(
                index=index,
                prompt=prompt,
                metadata=record_metadata(spec.data, record),
                env=DenoisingEnv(pos_cond=_row(cond, position), neg_cond=neg_row, guidance_scale=1.0),
                x0=x0.float(),
            )
        )
    return samples


def data_base_dir(path: str | Path | None) -> str:
    """The directory that relative paths inside a JSONL data file resolve against."""
    return str(Path(path).parent) if path else "."


def convert_samples(args: Any, converter: Callable, samples: list[Sample]) -> list[TrainPair]:
    """Run the converter (``fn(args, samples)``: ``--custom-expand-samples-to-train-pairs-path``, else the
    method's) and check what it returns.

    Raises:
        HookResultError: naming the hook, if it returns something other than a list of ``TrainPair``, or another
            number of pairs than samples.
    """
    path = hook_name(converter)
    pairs = converter(args, samples)
    if not isinstance(pairs, list) or not all(isinstance(pair, TrainPair) for pair in pairs):
        got = (
            type(pairs).__name__
            if not isinstance(pairs, list)
            else "a list holding "
            + ", ".join(sorted({type(pair).__name__ for pair in pairs if not isinstance(pair, TrainPair)}))
        )
        raise HookResultError(f"converter {path} returned {got}; expected a list of miles.utils.types.TrainPair")
    if len(pairs) != len(samples):
        # The batch sizes (--global-batch-size, the DP split, the critic's steps) count one pair per sample: a
        # converter that drops pairs would silently train on a smaller batch.
        raise HookResultError(
            f"converter {path} returned {len(pairs)} train pairs for {len(samples)} samples; it must return one pair "
            "per sample, in order (the batch sizes count samples)"
        )
    return pairs
