"""Context (sequence) parallelism: the ranks of a trainer group split into DP × CP (``--context-parallel-size``).

The ranks of one CP group hold the same sample and split its image/video tokens between them inside the denoiser:
diffusers' own Ulysses implementation (``ContextParallelConfig``, ``ModelMixin.enable_parallelism`` and the
transformer class's ``_cp_plan``) splits the sequence before the first block, swaps sequence for heads around each
attention (all-to-all) and gathers the output after ``proj_out``, so every CP rank sees the whole prediction and
computes the same loss on it.

Layout (``world = dp × cp`` ranks, rank ``r``): DP rank ``r // cp``, CP rank ``r % cp``; CP groups are runs of
consecutive ranks (one node's GPUs on NVLink for the all-to-alls).

- FSDP shards over all ``world`` ranks (one flat mesh, torchtitan's ``dp_shard × cp``): the CP ranks hold the same
  parameters, so sharding them over DP only would keep ``cp`` copies of every shard, its gradient and its optimizer
  state. The gradient must stay the DP mean: each CP rank computes the same loss on the gathered output, but the
  gather's backward hands each rank the gradient of its own tokens only, so the CP group's parameter gradients add
  up to one sample gradient (measured: FSDP's default mean over ``dp × cp`` gave half the gradient norm at CP 2).
  The denoiser's FSDP units therefore divide by the DP size (:func:`enable_context_parallel`);
  tests/fast/backends/fsdp_utils/test_context_parallel.py checks a CP=2 step against one rank.
- The CP mesh is ``("ring", "ulysses")`` = ``(1, cp)`` per CP group, the names diffusers requires. Ring attention
  needs an attention backend that returns the log-sum-exp (flash attention on CUDA); torch's native SDPA does not, so
  only Ulysses is offered.
"""

import logging
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "build_meshes",
    "check_context_parallel",
    "check_pipeline",
    "cp_plan_of",
    "dp_rank_of",
    "enable_context_parallel",
    "heads_of",
    "model_class_of",
    "splits_text",
]

logger = logging.getLogger(__name__)

FLAG = "--context-parallel-size"


def dp_rank_of(rank: int, cp: int) -> int:
    """The DP rank of trainer rank ``rank`` when ``cp`` consecutive ranks form a CP group: ``rank // cp``."""
    return rank // cp


def build_meshes(device_type: str, world_size: int, cp: int) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The group's FSDP mesh and, with ``cp > 1``, this rank's CP mesh. Needs an initialised default process group.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        world_size: the group's ranks (DP × CP).
        cp: ``--context-parallel-size``.

    Returns:
        ``(fsdp_mesh, cp_mesh)``: a 1-D mesh over all ranks (named ``("dp",)`` without CP, ``("dp_cp",)`` with it)
        and the 2-D ``("ring", "ulysses")`` mesh of shape ``(1, cp)`` of this rank's CP group (None for ``cp == 1``).

    Raises:
        ValueError: when ``cp`` does not divide ``world_size``.
    """
    if cp < 1 or world_size % cp:
        raise ValueError(f"{FLAG} {cp} must divide the trainer group's {world_size} ranks")
    if cp == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",)), None
    fsdp_mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_cp",))
    grid = init_device_mesh(device_type, (world_size // cp, 1, cp), mesh_dim_names=("dp", "ring", "ulysses"))
    return fsdp_mesh, grid["ring", "ulysses"]


def cp_plan_of(model_class: type) -> dict | None:
    """The class's ``_cp_plan`` (diffusers' context-parallel plan), or None when it has none (SD3, the digits
    model)."""
    return getattr(model_class, "_cp_plan", None)


def splits_text(model_class: type) -> bool:
    """Whether the class's ``_cp_plan`` splits the text tokens too (``encoder_hidden_states``: FLUX, FLUX.2,
    Qwen-Image) or only the image/video tokens (Wan)."""
    plan = cp_plan_of(model_class) or {}
    return any(isinstance(entry, dict) and "encoder_hidden_states" in entry for entry in plan.values())


def check_context_parallel(
    model_class: type, image_tokens: int, num_heads: int, cp: int, text_tokens: int | None = None
) -> None:
    """Refuse a CP size the denoiser cannot run, in one line naming the flag.

    Args:
        model_class: the denoiser's diffusers class (``transformer/config.json``'s ``_class_name``).
        image_tokens: image/video tokens of one sample (the sequence every ``_cp_plan`` splits).
        num_heads: attention heads (Ulysses gives each CP rank ``num_heads / cp`` of them).
        cp: ``--context-parallel-size``.
        text_tokens: text tokens of one prompt, checked when the plan splits them too (:func:`splits_text`); None
            leaves them unchecked.

    Raises:
        ValueError: for a class without a ``_cp_plan``, or a token or head count that ``cp`` does not divide.
    """
    if cp == 1:
        return
    if cp_plan_of(model_class) is None:
        raise ValueError(
            f"{FLAG} {cp}: {model_class.__name__} has no context-parallel plan in diffusers (_cp_plan); use a "
            "family that has one (Wan, FLUX, FLUX.2, Qwen-Image) or --context-parallel-size 1"
        )
    if image_tokens % cp:
        raise ValueError(
            f"{FLAG} {cp} must divide the sequence length: one sample has {image_tokens} image tokens; change the "
            "resolution or frame count, or the flag"
        )
    if text_tokens is not None and splits_text(model_class) and text_tokens % cp:
        raise ValueError(
            f"{FLAG} {cp} must divide the text sequence too ({model_class.__name__} splits it): one prompt has "
            f"{text_tokens} text tokens"
        )
    if num_heads % cp:
        raise ValueError(f"{FLAG} {cp} must divide the denoiser's {num_heads} attention heads (Ulysses splits them)")


def _base_model(model: nn.Module) -> nn.Module:
    """The diffusers ``ModelMixin`` under a wrapper that forwards to it (``AdaptersDisabled``'s ``model``)."""
    while not hasattr(model, "enable_parallelism") and hasattr(model, "model"):
        model = model.model
    return model


def enable_context_parallel(model: nn.Module, cp_mesh: DeviceMesh | None, fsdp_ranks: int | None = None) -> Any:
    """Turn on diffusers' Ulysses context parallelism on ``model`` over ``cp_mesh`` (a no-op for None).

    Called after the model is sharded and loaded; the hooks diffusers adds split the sequence before the first block
    and gather the output, so callers see full-length ``(B, C, F, H, W)`` / ``(B, L, C)`` predictions as before.

    Gradients: the output gather's backward hands each CP rank the gradient of its own tokens only (no sum over the
    CP ranks), and every parameter's use inside the split region sees only local tokens, so the CP ranks' gradients
    of one sample add up to its gradient. FSDP's default mean over all ``dp × cp`` ranks would leave it divided by
    ``cp``; a trained model (``fsdp_ranks`` given) divides by the DP size instead (``set_gradient_divide_factor`` on
    each of its FSDP units): the sum over each CP group, the mean over the DP ranks.

    Args:
        model: a diffusers transformer, FSDP2-sharded or not, or a wrapper with ``.model`` (``AdaptersDisabled``).
        cp_mesh: this rank's ``("ring", "ulysses")`` mesh (:func:`build_meshes`), or None.
        fsdp_ranks: the FSDP mesh's size (DP × CP) of a trained model; None for a frozen one.

    Returns:
        diffusers' ``ParallelConfig`` recorded on the model, or None without ``cp_mesh``.

    Raises:
        ValueError: for a model without ``_cp_plan`` (:func:`check_context_parallel`'s message).
    """
    if cp_mesh is None:
        return None
    from diffusers import ContextParallelConfig
    from torch.distributed.fsdp import FSDPModule

    base = _base_model(model)
    cp = cp_mesh.size()
    if cp_plan_of(type(base)) is None:
        check_context_parallel(type(base), 0, 0, cp)
    # diffusers places the config with torch.device(accelerator, rank % torch.accelerator.device_count()): one
    # accelerator per rank, as on a CUDA cluster.
    base.enable_parallelism(config=ContextParallelConfig(ulysses_degree=cp, mesh=cp_mesh))
    if fsdp_ranks is not None:
        for module in base.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(max(fsdp_ranks // cp, 1)))
                # A sum-only reduce-scatter with the division before and after it: gloo has no PREMUL_SUM, and one
                # path on CPU and GPU is the one the CPU tests check (one extra scaling of the shards).
                module.set_force_sum_reduction_for_comms(True)
    logger.debug("context parallel: Ulysses over %d ranks on %s", cp, type(base).__name__)
    return base._parallel_config


def model_class_of(config: dict) -> type:
    """The diffusers class a ``transformer/config.json`` names (``_class_name``)."""
    import diffusers

    return getattr(diffusers, config["_class_name"])


def heads_of(config: dict) -> int:
    """Attention heads of a diffusers transformer config (``num_attention_heads``)."""
    return int(config.get("num_attention_heads", 0))


def check_pipeline(family: Any, path: str, cp: int) -> None:
    """:func:`check_context_parallel` on the denoiser of pipeline ``path`` (its config, its token count)."""
    if cp == 1:
        return
    config = family.transformer_config(path)
    image_tokens, text_tokens = family.tokens_per_sample(path)
    check_context_parallel(model_class_of(config), image_tokens, heads_of(config), cp, text_tokens)
