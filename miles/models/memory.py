"""What a diffusers denoiser costs in memory, from its config alone: parameter shapes on the meta device, FSDP2
shard sizes per DP rank, token counts, and an activation estimate per block.

Nothing here allocates weights: models are built with ``torch.device("meta")``, so a 20B-parameter config costs a
second and no memory. :mod:`miles.driver.memory_plan` puts these pieces together per trainer group.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from miles.models.pipeline_files import read_json
from miles.models.sd3 import CLIP_TOKENS, T5_TOKENS

__all__ = [
    "ActivationEstimate",
    "TEXT_TOKENS",
    "activation_estimate",
    "full_config",
    "image_tokens_at",
    "meta_denoiser",
    "shard_numel",
    "shard_bytes",
    "transformer_config",
]

# Text tokens per sample by denoiser class: what the family's stock pipeline feeds the transformer by default.
TEXT_TOKENS = {
    # StableDiffusion3Pipeline: 77 CLIP tokens + max_sequence_length=256 T5 tokens, padded to that length
    "SD3Transformer2DModel": CLIP_TOKENS + T5_TOKENS,
    # FluxPipeline: T5 padded to max_sequence_length=512
    "FluxTransformer2DModel": 512,
    # Flux2KleinPipeline: the text encoder's states padded to max_sequence_length=512
    "Flux2Transformer2DModel": 512,
    # QwenImagePipeline: the prompt's own length (padding to the longest), capped at max_sequence_length=512: a bound
    "QwenImageTransformer2DModel": 512,
}
# Pixels per image-token side beyond the transformer's patch size: the VAE's downscale factor, times the 2×2
# latent packing of the pipelines that pack (their transformers then have patch_size 1 or count the packing in it).
_PIXELS_PER_TOKEN = {
    "SD3Transformer2DModel": lambda config: 8 * int(config["patch_size"]),  # VAE 8×, patch p
    "FluxTransformer2DModel": lambda config: 16,  # VAE 8×, 2×2 packing (FluxPipeline._pack_latents)
    "Flux2Transformer2DModel": lambda config: 16,  # VAE 8×, 2×2 patchify (Flux2KleinPipeline._patchify_latents)
    "QwenImageTransformer2DModel": lambda config: 16,  # VAE 8×, 2×2 packing (QwenImagePipeline._pack_latents)
}


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


def image_tokens_at(config: dict, resolution: int) -> int:
    """Image tokens per sample at ``resolution`` × ``resolution`` pixels for a denoiser of ``config``.

    Raises:
        ValueError: for a class without a known pixels-per-token rule, or a resolution it does not divide.
    """
    rule = _PIXELS_PER_TOKEN.get(config.get("_class_name"))
    if rule is None:
        raise ValueError(f"no image-token rule for {config.get('_class_name')!r}; known: {sorted(_PIXELS_PER_TOKEN)}")
    pixels = rule(config)
    if resolution % pixels:
        raise ValueError(f"resolution {resolution} is not a multiple of {pixels} pixels per token side")
    return (resolution // pixels) ** 2


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


def _branch_elements(hidden: int, mlp: int, *, qk_norm: bool, rope: bool, swiglu: bool) -> tuple[int, int]:
    # Per token: (attention branch, MLP branch) elements autograd keeps (see activation_estimate).
    attention = 8 * hidden + (2 * hidden if qk_norm else 0) + (2 * hidden if rope else 0)
    feed_forward = 4 * hidden + (4 if swiglu else 2) * mlp
    return attention, feed_forward


def _outside_blocks(config: dict, image: int, text: int) -> int:
    """Elements per sample kept by the embedders and the output layer: the patch embedding's input, the text
    projection's input, and the final adaLN norm (input, normalised output) and output projection's input."""
    hidden = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    patch_inputs = int(config["in_channels"])
    if config.get("_class_name") == "SD3Transformer2DModel":
        patch_inputs *= int(config["patch_size"]) ** 2  # SD3 patchifies with a conv; the others get packed tokens
    return image * (3 * hidden + patch_inputs) + text * int(config["joint_attention_dim"])


def _blocks(config: dict, image: int, text: int) -> list[tuple[int, int]]:
    """``(elements kept, input elements)`` per sample of every transformer block, in forward order."""
    name = config.get("_class_name")
    hidden = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    if name == "SD3Transformer2DModel":
        attention, ff = _branch_elements(hidden, 4 * hidden, qk_norm=bool(config.get("qk_norm")), rope=False,
                                         swiglu=False)  # fmt: skip
        dual = set(config.get("dual_attention_layers") or ())
        # Joint blocks: an image and a text stream, each with its own attention projections and MLP; SD3.5's dual
        # attention layers run a second attention on the image stream (without its own norm input).
        return [
            ((image + text) * (attention + ff) + (image * (attention - hidden) if index in dual else 0),
             (image + text) * hidden)
            for index in range(int(config["num_layers"]))
        ]  # fmt: skip
    if name in ("FluxTransformer2DModel", "QwenImageTransformer2DModel", "Flux2Transformer2DModel"):
        swiglu = name == "Flux2Transformer2DModel"
        mlp = int(hidden * float(config.get("mlp_ratio", 4.0)))
        attention, ff = _branch_elements(hidden, mlp, qk_norm=True, rope=True, swiglu=swiglu)
        double = [((image + text) * (attention + ff), (image + text) * hidden)] * int(config["num_layers"])
        # Single-stream blocks (FLUX, FLUX.2): attention and MLP in parallel on one norm of the joined sequence; one
        # output projection of [attention, MLP activation] (its input h + m) replaces the separate ones.
        single_tokens = image + text
        single = (single_tokens * (attention + ff - 4 * hidden + hidden + mlp), single_tokens * hidden)
        return double + [single] * int(config.get("num_single_layers", 0))
    raise ValueError(f"no activation layout for {name!r}")


def activation_estimate(
    config: dict,
    image_tokens: int,
    text_tokens: int,
    batch: int,
    itemsize: int,
    gradient_checkpointing: bool,
) -> ActivationEstimate:
    """Activation bytes of one training forward of ``batch`` samples (an estimate, not a measurement).

    Formula: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1) count
    ``s·b·h·(34 + 5·a·s/h)`` bytes per transformer layer at 16 bits: attention 11sbh + 5as²b, MLP 19sbh, two
    LayerNorms 4sbh. Adapted to a DiT block, per token and in elements (× ``itemsize`` bytes):

    * attention branch ``8h``: the norm's input, its normalised output (the adaLN scale's gradient), the modulated
      input of Q/K/V, Q, K and V, the attention output (the output projection's input) and its projection (the
      residual gate's gradient); ``+2h`` with QK-norm (the un-normed Q and K), ``+2h`` with RoPE (Q and K before
      rotation). No ``5as²`` term: SDPA's flash / memory-efficient kernels keep no ``s × s`` score matrix. No
      dropout masks: DiTs train without dropout.
    * MLP branch ``4h + 2m`` (GELU: the norm's input and output, the modulated fc1 input, fc1's output m, the
      activation's output m, fc2's output) or ``4h + 4m`` (SwiGLU: fc1's output 2m, the gate's output, the
      product). m is the MLP width: 4h (SD3, FLUX, Qwen-Image), ``mlp_ratio``·h (FLUX.2).
    * a dual-stream (MMDiT) block counts both branches for every image and text token; SD3.5's dual-attention
      layers add a second attention branch on the image tokens; a single-stream block runs attention and MLP in
      parallel on one norm of all tokens, with one output projection of input ``h + m``.

    With gradient checkpointing (diffusers' per-block ``torch.utils.checkpoint``) the forward keeps only each
    block's inputs (``(image + text)·h``); the backward rebuilds one block at a time (:attr:`ActivationEstimate.
    recompute`). The embedders and the output layer keep their inputs and the final norm's (``image·(3h + patch
    input) + text·joint_attention_dim``) either way. Not counted: the backward's own transient activation gradients
    and allocator fragmentation; the headroom of the fit check covers them.

    Args:
        config: the transformer's full diffusers config (:func:`full_config`: a saved ``config.json`` may leave out
            arguments at their defaults).
        image_tokens, text_tokens: tokens per sample (see :func:`image_tokens_at`, :data:`TEXT_TOKENS`).
        batch: samples per trainer forward.
        itemsize: bytes per activation element (2 for bf16 compute, 4 for float32).

    Raises:
        ValueError: for a denoiser class without a layout here.
    """
    blocks = _blocks(config, image_tokens, text_tokens)
    outside = _outside_blocks(config, image_tokens, text_tokens)
    scale = batch * itemsize
    if not gradient_checkpointing:
        return ActivationEstimate(stored=(outside + sum(kept for kept, _ in blocks)) * scale, recompute=0)
    return ActivationEstimate(
        stored=(outside + sum(inputs for _, inputs in blocks)) * scale,
        recompute=max(kept for kept, _ in blocks) * scale,
    )
