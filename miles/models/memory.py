"""What a diffusers denoiser costs, from its config alone: parameter shapes on the meta device, FSDP2 shard sizes per
DP rank, activations per token and block, and the FLOPs of one forward.

Nothing here allocates weights: models are built with ``torch.device("meta")``, so a 20B-parameter config costs a
second and no memory. Nothing here knows a family: a family describes its own denoiser
(:class:`~miles.models.capabilities.MemoryLayout`: its tokens per sample, an :class:`ActivationLayout` built from
the block counts below, its FLOPs per sample), and :mod:`miles.driver.memory_plan` and
:mod:`miles.driver.estimate` put the pieces together per trainer group.
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.models.pipeline_files import read_json

__all__ = [
    "ActivationEstimate",
    "ActivationLayout",
    "BlockActivations",
    "TokenElements",
    "activation_estimate",
    "count_forward_flops",
    "cross_attention_layout",
    "full_config",
    "joint_layout",
    "meta_denoiser",
    "shard_numel",
    "shard_bytes",
    "transformer_config",
]


def transformer_config(pipeline: str | Path) -> dict:
    """``<pipeline>/transformer/config.json`` (a diffusers config, with its ``_class_name``)."""
    return read_json(Path(pipeline) / "transformer" / "config.json", "transformer config")


def meta_denoiser(config: dict) -> nn.Module:
    """The diffusers class named by ``config["_class_name"]``, built from ``config`` on the meta device (parameter
    shapes and dtypes, no storage).

    Raises:
        ValueError: if diffusers has no such class.
    """
    import diffusers

    name = config.get("_class_name")
    cls = getattr(diffusers, str(name), None)
    if cls is None:
        raise ValueError(f"transformer config names _class_name {name!r}, which diffusers does not have")
    with torch.device("meta"):
        return cls.from_config(config)


def full_config(model: nn.Module) -> dict:
    """A built diffusers model's config with every init argument (class defaults filled in) and its ``_class_name``."""
    return {**dict(model.config), "_class_name": type(model).__name__}


def shard_numel(shape: tuple[int, ...], world: int, rank: int) -> int:
    """Elements of ``rank``'s shard of a parameter of ``shape`` under FSDP2 over ``world`` ranks.

    FSDP2 shards dim 0 as ``torch.chunk`` does: chunks of ``ceil(d0 / world)`` rows, so the first ranks hold full
    chunks, the last may hold fewer or none (``fully_shard``'s ``_chunk_with_empty``). One rank holds everything.
    """
    numel = math.prod(shape)
    if world == 1 or not shape:
        return numel
    chunk = -(-shape[0] // world)
    rows = max(0, min(chunk, shape[0] - rank * chunk))
    return rows * (numel // shape[0] if shape[0] else 0)


def shard_bytes(shapes: list[tuple[int, ...]], world: int, rank: int, itemsize: int) -> int:
    """Bytes of ``rank``'s shards of parameters of ``shapes`` stored with ``itemsize`` bytes per element."""
    return sum(shard_numel(shape, world, rank) for shape in shapes) * itemsize


@dataclass(frozen=True)
class TokenElements:
    """Elements per image token and per text token (of one sample)."""

    image: int
    text: int

    def per_sample(self, image_tokens: int, text_tokens: int) -> int:
        """Elements of one sample of ``image_tokens`` + ``text_tokens`` tokens."""
        return self.image * image_tokens + self.text * text_tokens


@dataclass(frozen=True)
class BlockActivations:
    """One block's activations per token: ``kept``, what autograd keeps for its backward; ``inputs``, its inputs (all
    that gradient checkpointing keeps of it)."""

    kept: TokenElements
    inputs: TokenElements


@dataclass(frozen=True)
class ActivationLayout:
    """A denoiser's activation elements per token: every block (forward order) and ``outside``, what the embedders
    and the output layer keep (kept with or without gradient checkpointing)."""

    blocks: tuple[BlockActivations, ...]
    outside: TokenElements


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes one trainer forward keeps for its backward, per rank (an estimate).

    Attributes:
        stored: bytes held at the end of the forward: every block's saved tensors, or with gradient checkpointing
            every block's inputs plus the embedders' and the output layer's.
        recompute: bytes of the largest block's saved tensors, rebuilt during the backward under gradient
            checkpointing (0 without it: they are already in ``stored``).
    """

    stored: int
    recompute: int

    @property
    def peak(self) -> int:
        return self.stored + self.recompute


def _hidden(config: dict) -> int:
    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def _branches(hidden: int, mlp: int, *, qk_norm: bool, rope: bool, swiglu: bool) -> tuple[int, int]:
    """Per token: (attention branch, MLP branch) elements autograd keeps (see :func:`activation_estimate`)."""
    attention = 8 * hidden + (2 * hidden if qk_norm else 0) + (2 * hidden if rope else 0)
    feed_forward = 4 * hidden + (4 if swiglu else 2) * mlp
    return attention, feed_forward


def joint_layout(
    config: dict,
    *,
    patch_inputs: int,
    qk_norm: bool = True,
    rope: bool = True,
    swiglu: bool = False,
    dual_attention_layers: tuple[int, ...] = (),
) -> ActivationLayout:
    """The layout of an MMDiT (SD3, FLUX.1, FLUX.2, Qwen-Image): the config's ``num_layers`` joint blocks, then its
    ``num_single_layers`` single-stream blocks (none without the key), with an MLP ``mlp_ratio`` (default 4) times
    the token width.

    A joint block runs an image and a text stream, each with its own attention projections and MLP, so both branches
    count for every token; SD3.5's dual-attention layers (``dual_attention_layers``) run a second attention on the
    image stream (without its own norm input). A single-stream block (FLUX, FLUX.2) runs attention and MLP in
    parallel on one norm of the joined sequence, with one output projection of input ``h + m``. A block's input is
    ``h`` per token. Outside the blocks: the patch embedding's input (``patch_inputs`` per image token), the text
    projection's (``joint_attention_dim`` per text token) and the final adaLN norm's input, output and the output
    projection's input (``3h`` per image token).

    Args:
        config: the transformer's full diffusers config (:func:`full_config`).
        patch_inputs: elements of one image token at the patch embedding (SD3: ``in_channels · patch²``; a packed
            family's token: ``in_channels``).
        qk_norm, rope: whether the attention normalises Q and K, and rotates them.
        swiglu: a SwiGLU MLP (FLUX.2) instead of a GELU one.
    """
    hidden = _hidden(config)
    mlp = int(hidden * float(config.get("mlp_ratio", 4.0)))
    attention, ff = _branches(hidden, mlp, qk_norm=qk_norm, rope=rope, swiglu=swiglu)
    inputs = TokenElements(hidden, hidden)
    dual = set(dual_attention_layers)
    blocks = [
        BlockActivations(TokenElements(attention + ff + (attention - hidden if index in dual else 0), attention + ff),
                         inputs)
        for index in range(int(config["num_layers"]))
    ]  # fmt: skip
    single = attention + ff - 4 * hidden + hidden + mlp
    blocks += [BlockActivations(TokenElements(single, single), inputs)] * int(config.get("num_single_layers", 0))
    outside = TokenElements(3 * hidden + patch_inputs, int(config["joint_attention_dim"]))
    return ActivationLayout(tuple(blocks), outside)


def cross_attention_layout(
    config: dict, *, patch_inputs: int, text_dim: int, ffn_dim: int, qk_norm: bool = True, rope: bool = True
) -> ActivationLayout:
    """The layout of a DiT whose image (video) tokens attend to the text by cross-attention (Wan).

    Per image token and block: the self-attention branch and the MLP as in :func:`joint_layout` (``ffn_dim`` wide,
    GELU), and the cross-attention's norm input and output, Q, the normed Q and the attention output (``5h``); per
    text token and block, the cross-attention's K, normed K and V (``3h``). A block's input is ``h`` per image token
    (the text states enter every block from one tensor, kept once, outside). Outside the blocks: the patch
    embedding's input (``patch_inputs`` per image token), the final norm's input, output and the projection's input
    (``3h``), and the text embedder's input, hidden and activated states and output (``text_dim + 3h`` per text
    token).
    """
    hidden = _hidden(config)
    attention, ff = _branches(hidden, ffn_dim, qk_norm=qk_norm, rope=rope, swiglu=False)
    cross = 5 * hidden if qk_norm else 4 * hidden
    block = BlockActivations(TokenElements(attention + cross + ff, 3 * hidden), TokenElements(hidden, 0))
    outside = TokenElements(3 * hidden + patch_inputs, text_dim + 3 * hidden)
    return ActivationLayout((block,) * int(config["num_layers"]), outside)


def activation_estimate(
    layout: ActivationLayout,
    image_tokens: int,
    text_tokens: int,
    batch: int,
    itemsize: int,
    gradient_checkpointing: bool,
) -> ActivationEstimate:
    """Activation bytes of one training forward of ``batch`` samples (an estimate, not a measurement).

    Formula: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1) count
    ``s·b·h·(34 + 5·a·s/h)`` bytes per transformer layer at 16 bits: attention 11sbh + 5as²b, MLP 19sbh, two
    LayerNorms 4sbh. Adapted to a DiT block, per token and in elements (× ``itemsize`` bytes), by the family's
    ``layout`` (:func:`joint_layout`, :func:`cross_attention_layout`):

    * attention branch ``8h``: the norm's input, its normalised output (the adaLN scale's gradient), the modulated
      input of Q/K/V, Q, K and V, the attention output (the output projection's input) and its projection (the
      residual gate's gradient); ``+2h`` with QK-norm (the un-normed Q and K), ``+2h`` with RoPE (Q and K before
      rotation). No ``5as²`` term: SDPA's flash / memory-efficient kernels keep no ``s × s`` score matrix. No
      dropout masks: DiTs train without dropout.
    * MLP branch ``4h + 2m`` (GELU: the norm's input and output, the modulated fc1 input, fc1's output m, the
      activation's output m, fc2's output) or ``4h + 4m`` (SwiGLU: fc1's output 2m, the gate's output, the
      product). m is the MLP width.

    With gradient checkpointing (diffusers' per-block ``torch.utils.checkpoint``) the forward keeps only each
    block's inputs; the backward rebuilds one block at a time (:attr:`ActivationEstimate.recompute`). The embedders
    and the output layer keep theirs either way. Not counted: the backward's own transient activation gradients and
    allocator fragmentation; the headroom of the fit check covers them.

    Args:
        layout: the family's :class:`ActivationLayout` of the denoiser.
        image_tokens, text_tokens: tokens per sample (the family's ``tokens_per_sample``).
        batch: samples per trainer forward.
        itemsize: bytes per activation element (2 for bf16 compute, 4 for float32).
    """

    def elements(count: TokenElements) -> int:
        return count.per_sample(image_tokens, text_tokens)

    outside = elements(layout.outside)
    scale = batch * itemsize
    if not gradient_checkpointing:
        return ActivationEstimate(stored=(outside + sum(elements(b.kept) for b in layout.blocks)) * scale, recompute=0)
    return ActivationEstimate(
        stored=(outside + sum(elements(b.inputs) for b in layout.blocks)) * scale,
        recompute=max((elements(b.kept) for b in layout.blocks), default=0) * scale,
    )


def count_forward_flops(
    family: Any, config: dict, latent_shape: tuple[int, ...], cond: dict[str, torch.Tensor]
) -> tuple[float, int]:
    """``(FLOPs, parameters)`` of one denoiser forward of one sample, as ``family.predict_velocity`` runs it, counted
    by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and attention) on the meta device: the denoiser built
    from ``config`` without weights, latents ``(1, *latent_shape)`` at timestep 500, the family's one-sample
    ``cond`` (as ``benchmarks/gpu_check.py`` counts SD3.5's forward).

    Raises:
        ValueError: if diffusers has no class of ``config["_class_name"]``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    model = meta_denoiser(config)
    with torch.device("meta"):
        latents = torch.empty(1, *latent_shape)
        timestep = torch.full((1,), 500.0)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        family.predict_velocity(model, latents, timestep, cond)
    return float(counter.get_total_flops()), sum(p.numel() for p in model.parameters())
