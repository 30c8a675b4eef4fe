"""Data passed between the rollout engine, the converters and the trainers.

Tensors of one sample carry no batch dimension; latents are float32 of the family's ``latent_shape``, any rank:
``(C, H, W)`` for an image family (``(1, 8, 8)`` pixels in [-1, 1] for the digits pipeline, VAE latents for SD3),
``(C, F, H, W)`` for a video family (F frames). Shapes below are written ``(C, H, W)`` and mean either.
Conditioning dicts hold the keyword arguments of the denoiser's forward, e.g. ``{"encoder_hidden_states": (L, D),
"pooled_projections": (P,)}``.
"""

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Box",
    "DenoisingEnv",
    "DiTTrajectory",
    "PromptShard",
    "RolloutResult",
    "Sample",
    "SideInput",
    "SideRecords",
    "TrainPair",
    "TrainResult",
    "collate_cond",
]


@dataclass
class Box:
    """Wraps a Ray ``ObjectRef`` so that ``ray.get`` on a list of boxes returns the boxes, not the payloads.

    The sync driver only waits on the trainers; the payload (a rollout shard, a group's train output) stays in the
    object store until the rank that needs it calls ``ray.get(box.inner)``.
    """

    inner: Any


@dataclass(frozen=True)
class SideInput:
    """A JSONL of records a method needs beside the prompts, one record per generated sample, from its own seeded,
    checkpointed cursor (the DMD2 GAN's real data). A method declares them (``Method.side_inputs``); the
    RolloutManager deals them into each ``PromptShard``; the rollout generator turns each record into a data
    ``Sample`` (its clean latent and prompt cond) and hands it to the sample's pair as ``pair.extras[name]``.

    Attributes:
        name: the key in ``PromptShard.side_data`` and ``TrainPair.extras`` (its cursor shuffles by
            ``"<name>_shuffle"``).
        path: the JSONL file (an image or latent and a prompt per record).
        flag: the flag that names the file, for error messages (``--dmd2-gan-real-data``).
    """

    name: str
    path: str
    flag: str


@dataclass
class SideRecords:
    """A shard's records of one side input: one per sample, in the shard's order.

    Attributes:
        records: the JSONL objects.
        base_dir: the directory their relative paths (images, latents, cached cond) resolve against.
    """

    records: list[dict[str, Any]]
    base_dir: str = "."


@dataclass
class PromptShard:
    """One DP rank's share of a rollout, as the RolloutManager hands it out: what to generate, not the samples.

    A prompt's ``--n-samples-per-prompt`` samples stay together in one shard; position p describes sample
    ``sample_indices[p]`` (``prompt_index · n_samples_per_prompt + j``).

    Attributes:
        rollout_id: the rollout (or ``"eval"`` for evaluation draws); keys the noise seeds.
        sample_indices: the samples' indices within the rollout, ascending.
        prompts: the prompt text of each sample.
        records: each sample's data-source record (the JSONL object: prompt, label, image or latent, cached cond).
        base_dir: the directory that relative paths in the records (images, latents, cached cond) resolve against.
        side_data: the method's side inputs dealt to this shard, by name (:class:`SideInput`), ``{}`` for none.
    """

    rollout_id: int | str
    sample_indices: list[int]
    prompts: list[str]
    records: list[dict[str, Any]]
    base_dir: str = "."
    side_data: dict[str, SideRecords] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sample_indices)


@dataclass
class RolloutResult:
    """What one generating process (an actor rank, or an engine replica per DP rank) returns of a rollout.

    Attributes:
        pairs: ``Box(ray.put(list[TrainPair]))`` for the paired rank of every trainer group.
        num_pairs: how many pairs the box holds.
        perf: in-process timers in seconds (``perf/<role>-generate_time``).
    """

    pairs: Box
    num_pairs: int
    perf: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainResult:
    """What one rank of a trainer group returns from a rollout's train (small: the payload stays in the store).

    Attributes:
        output: ``Box(ray.put(value))`` of the group's train-output hook (None without the hook); rank i of every
            later group reads it as ``ctx.external_data[role]``.
        metrics: one dict per optimizer step, averaged over the DP ranks (``train/...`` keys; rank 0 only, ``[]``
            on the others).
        perf: in-worker timers of this rollout in seconds (``perf/<role>-...`` keys) and the bytes the rank holds
            (``memory/<role>-{parameters,gradients,optimizer,frozen}_bytes``); rank 0 only.
    """

    output: Box
    metrics: list[dict[str, float]] = field(default_factory=list)
    perf: dict[str, float] = field(default_factory=dict)


@dataclass
class DenoisingEnv:
    """One sample's conditioning for the denoiser.

    Attributes:
        pos_cond: the prompt's cond kwargs, tensors without a batch dim.
        neg_cond: the negative prompt's cond kwargs, or ``{}`` when no consumer needs it. The engine fills it
            whenever the student rollout or the DMD2 teacher runs CFG (guidance > 1), and for SFT conditioning
            dropout (``--sft-uncond-prob > 0``).
        guidance_scale: CFG scale of the student rollout, 1 = no CFG.
    """

    pos_cond: dict[str, torch.Tensor]
    neg_cond: dict[str, torch.Tensor] = field(default_factory=dict)
    guidance_scale: float = 1.0


@dataclass
class DiTTrajectory:
    """What the engine returns of one sample's denoising run.

    Attributes:
        sigmas: float64 ``(S + 1,)``, the rollout's σ schedule in [0, 1], descending, with the terminal 0.
        timesteps: float64 ``(S,)``, ``σ · 1000`` for the S sampled steps.
        step_indices: the steps returned, ascending; ``[0, ..., S - 1]`` for a full trajectory, ``[i]`` for a
            rollout stopped at step i.
        latents: float32 ``(R, C, H, W)``, the denoiser's input ``x_i`` at each returned step (R = len(step_indices)).
        x0_preds: float32 ``(R, C, H, W)``, the engine's ``x̂0_i = x_i − σ_i·v_i`` at each returned step.
        final: float32 ``(C, H, W)``, the finished sample, or None when the rollout stopped early.
    """

    sigmas: torch.Tensor
    timesteps: torch.Tensor
    step_indices: list[int]
    latents: torch.Tensor
    x0_preds: torch.Tensor
    final: torch.Tensor | None = None

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


@dataclass
class Sample:
    """One generated (or, with ``--train-only``, one data) sample of a rollout.

    Attributes:
        index: the sample's index within the rollout, ``prompt_index · n_samples_per_prompt + j``.
        prompt: the text prompt.
        metadata: the data source's other fields (the digits data carries ``{"label": 7}``).
        env: conditioning used by the rollout.
        trajectory: the engine's output, None for data samples.
        x0: float32 ``(C, H, W)`` clean latent of a data sample (SFT), None for generated samples.
        reward: unused by SFT and DMD2; kept for converters that weight samples.
    """

    index: int
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    env: DenoisingEnv | None = None
    trajectory: DiTTrajectory | None = None
    x0: torch.Tensor | None = None
    reward: float | None = None


@dataclass
class TrainPair:
    """One training example as the trainers' hooks see it. A method whose pairs carry more subclasses it (the DMD2
    converter's ``DMD2Pair`` adds the rollout's stopped step).

    Attributes:
        sample_index: the source sample's index within the rollout; keys the critic's scores for the actor.
        prompt: the source sample's prompt text (groups a prompt's samples, e.g. for the health figures).
        x0: float32 ``(C, H, W)``, the clean target: a data latent (SFT) or the rollout's ``x̂0_i`` (DMD2).
        pos_cond: the prompt's cond kwargs.
        neg_cond: the negative prompt's cond kwargs, ``{}`` if the rollout did not encode it.
        extras: the method's side inputs for this pair by name, each a data ``Sample`` (``x0`` and ``env.pos_cond``
            of its record; the DMD2 GAN's ``"real"``), ``{}`` for none (:class:`SideInput`).
    """

    sample_index: int
    x0: torch.Tensor
    pos_cond: dict[str, torch.Tensor]
    neg_cond: dict[str, torch.Tensor] = field(default_factory=dict)
    prompt: str = ""
    extras: dict[str, Any] = field(default_factory=dict)


def collate_cond(conds: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-sample cond dicts into batched kwargs: each ``(...)`` tensor becomes ``(B, ...)``.

    Raises:
        ValueError: if the list is empty or the dicts do not share their keys (e.g. a missing negative cond).
    """
    if not conds:
        raise ValueError("cannot collate an empty list of cond dicts")
    keys = set(conds[0])
    for cond in conds[1:]:
        if set(cond) != keys:
            raise ValueError(f"cond dicts disagree on their keys: {sorted(keys)} vs {sorted(cond)}")
    return {key: torch.stack([cond[key] for cond in conds]) for key in conds[0]}
