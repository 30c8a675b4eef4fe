"""LoRA adapters on a diffusers denoiser through ``peft``: the default target modules and one way to add an adapter.

The trainer's LoRA converter and the memory planner (:mod:`miles.driver.memory_plan`) both add adapters through
:func:`add_lora_adapter`, so the planner counts exactly the parameters a run trains.
"""

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

__all__ = [
    "ADAPTER_NAME",
    "DEFAULT_LORA_TARGET_MODULES",
    "AdaptersDisabled",
    "LoraSettings",
    "add_lora_adapter",
    "check_lora_flags",
    "adapter_parameters",
    "linear_suffixes",
    "LoraFlags",
    "merge_lora",
    "parse_target_modules",
    "unmatched_targets",
]

# The adapter name the trainer gives its LoRA (peft's own default name); exports strip it.
ADAPTER_NAME = "default"

logger = logging.getLogger(__name__)

# Module-name suffixes peft matches (``name == target`` or ``name.endswith("." + target)``): the attention
# projections of both token streams and the MLP projections of the diffusers DiTs. Modules a model lacks are skipped.
DEFAULT_LORA_TARGET_MODULES = (
    # attention: image stream, then the text stream of MMDiT blocks (SD3, FLUX, FLUX.2, Qwen-Image)
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    # GELU MLPs: ff / ff_context (SD3, FLUX), img_mlp / txt_mlp (Qwen-Image)
    "net.0.proj",
    "net.2",
    # FLUX single-stream blocks' MLP input
    "proj_mlp",
    # FLUX.2: SwiGLU MLPs, and the single-stream blocks' fused QKV + MLP input
    "linear_in",
    "linear_out",
    "to_qkv_mlp_proj",
)
# Not targeted: FLUX's single-block ``proj_out`` and FLUX.2's single-block ``attn.to_out`` share their suffixes with
# modules that are no single Linear elsewhere (the final ``proj_out``, SD3's ``attn.to_out`` ModuleList).


def add_lora_adapter(
    model: nn.Module,
    adapter_name: str,
    rank: int,
    *,
    alpha: float | None = None,
    target_modules: tuple[str, ...] | list[str] = DEFAULT_LORA_TARGET_MODULES,
    dropout: float = 0.0,
    adapter_device: str | torch.device | None = None,
) -> nn.Module:
    """Add a LoRA adapter named ``adapter_name`` to a diffusers model (``ModelMixin.add_adapter`` with a
    ``peft.LoraConfig``); peft freezes the base weights, the adapter's ``lora_A`` / ``lora_B`` require grad.

    Works on a model on the meta device: the adapter's tensors are then created on the meta device too (no memory),
    unless ``adapter_device`` says otherwise.

    Args:
        rank: the LoRA rank r (> 0).
        alpha: ``lora_alpha`` (the update is scaled by alpha / r); None means r (scale 1).
        target_modules: module-name suffixes (see :data:`DEFAULT_LORA_TARGET_MODULES`).
        dropout: ``lora_dropout``.
        adapter_device: where the adapter's tensors are created; None: where the base weights are. On a base whose
            weights are on the meta device, ``"cpu"`` gives the adapters real initial values, the same as on a
            loaded base (the same global-RNG draws, cast to the base's dtype as peft casts them): peft puts an
            adapter on its base layer's device, so each targeted layer's meta weight is swapped for a one-element
            placeholder on ``adapter_device`` (same shape and dtype, no memory) while the adapter is added.

    Returns:
        ``model``, now with the adapter.

    Raises:
        ValueError: if ``rank`` is not positive or no module of the model matches ``target_modules``.
    """
    from peft import LoraConfig

    if rank <= 0:
        raise ValueError(f"LoRA rank must be > 0, got {rank}")
    targets = list(target_modules)
    config = LoraConfig(
        r=rank, lora_alpha=rank if alpha is None else alpha, target_modules=targets, lora_dropout=dropout
    )
    # Checked here: a failed peft injection leaves a diffusers model half-configured for adapters.
    if not any(name == t or name.endswith("." + t) for name, _ in model.named_modules() for t in targets):
        raise ValueError(f"no module of {type(model).__name__} matches the LoRA target modules {targets}")
    # New adapter tensors go where the base weights are (the meta device stays weightless), or to adapter_device.
    device = torch.device(adapter_device) if adapter_device is not None else next(model.parameters()).device
    with torch.device(device), _weights_appear_on(adapted_linears(model, targets), device):
        model.add_adapter(config, adapter_name=adapter_name)
    return model


@contextlib.contextmanager
def _weights_appear_on(linears: list[nn.Linear], device: torch.device) -> Iterator[None]:
    """Within the block, each meta-device ``weight`` of ``linears`` is replaced by a zero-stride placeholder of the
    same shape and dtype on ``device`` (peft reads only its device and dtype); afterwards the meta weight is back,
    with the ``requires_grad`` peft gave the placeholder. No-op where ``device`` is the meta device."""
    swapped = []
    if device.type != "meta":
        for linear in linears:
            weight = linear.weight
            if weight.device.type == "meta":
                stand_in = torch.zeros((), dtype=weight.dtype, device=device).expand(weight.shape)
                linear.weight = nn.Parameter(stand_in, requires_grad=weight.requires_grad)
                swapped.append((linear, weight))
    try:
        yield
    finally:
        for linear, weight in swapped:
            weight.requires_grad_(linear.weight.requires_grad)
            linear.weight = weight


def adapter_parameters(model: nn.Module, adapter_name: str) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of one adapter's LoRA weights (peft names them ``...lora_A.<adapter>.weight``)."""
    return [(name, param) for name, param in model.named_parameters() if f".{adapter_name}." in f".{name}."]


@dataclass(frozen=True)
class LoraSettings:
    """One group's LoRA adapter (:meth:`LoraFlags.settings` of its ``--lora-*`` flags, the critic's
    ``--critic-lora-*``), as its :class:`~miles.config.GroupSpec` holds it.

    Attributes:
        rank: r > 0. alpha: ``lora_alpha`` (the update is scaled by alpha / r). dropout: ``lora_dropout`` in [0, 1).
        target_modules: module-name suffixes peft wraps.
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGET_MODULES
    dropout: float = 0.0


class LoraFlags(NamedTuple):
    """A group's LoRA flags as parsed (``--lora-*``, or the critic's ``--critic-lora-*``), before they become its
    :class:`LoraSettings`.

    Attributes:
        rank: 0 (or None) trains full weights. alpha: None means the rank. target_modules: None means
            :data:`DEFAULT_LORA_TARGET_MODULES`. dropout: in [0, 1).
    """

    rank: int | None
    alpha: float | None
    target_modules: tuple[str, ...] | None
    dropout: float | None

    def settings(self) -> LoraSettings | None:
        """The :class:`LoraSettings` these flags ask for, or None for full-weight training (rank 0, the default)."""
        if not self.rank or self.rank <= 0:
            return None
        targets = self.target_modules or DEFAULT_LORA_TARGET_MODULES
        alpha = self.rank if self.alpha is None else self.alpha
        return LoraSettings(rank=self.rank, alpha=float(alpha), target_modules=tuple(targets), dropout=self.dropout)


def unmatched_targets(model: nn.Module, targets: tuple[str, ...] | list[str]) -> list[str]:
    """The entries of ``targets`` that name no ``nn.Linear`` of ``model`` (peft's suffix rule); works on a model on the
    meta device."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return [t for t in targets if not any(_names_target(name, t) for name in linears)]


def _names_target(module_name: str, target: str) -> bool:
    """peft's rule: a target module name matches the whole name or its last dotted parts."""
    return module_name == target or module_name.endswith("." + target)


def adapted_linears(model: nn.Module, targets: tuple[str, ...] | list[str]) -> list[nn.Linear]:
    """The ``nn.Linear`` modules of ``model`` that ``targets`` name (peft's suffix rule); works on the meta device."""
    return [
        module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(_names_target(name, t) for t in targets)
    ]


def linear_suffixes(model: nn.Module) -> list[str]:
    """The distinct last names of ``model``'s ``nn.Linear`` modules (``to_q``, ``proj``, ...), for an error message."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            parts = name.split(".")
            # A Linear inside a ModuleList is named by its index: keep the list's name too ("to_out.0").
            names.add(".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1])
    return sorted(names)


class AdaptersDisabled(nn.Module):
    """The base of a LoRA model, seen as a model of its own: every forward runs with the adapters disabled (peft's
    ``disable_adapters`` state of each LoRA layer, restored after) and in eval mode.

    The DMD2 critic group's teacher when the critic is a LoRA on the teacher's weights (the field's "one frozen base":
    verl-omni's DMD2 runtime, vvvvvjdy/dmdr): the group holds one copy of the weights. The wrapped model is not a
    registered submodule, so moving, resharding or counting this module's own state touches nothing twice;
    :meth:`parameters` still yields the base's, for forwards that read the parameters' dtype and device, and
    :attr:`config` is the base's.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.__dict__["lora_model"] = model

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.lora_model.parameters(recurse)

    @property
    def config(self):
        """The base's diffusers config: a family's forward reads it (FLUX.1's ``guidance_embeds``, Wan's patch)."""
        return self.lora_model.config

    def forward(self, *args, **kwargs):
        from peft.tuners.tuners_utils import BaseTunerLayer

        model = self.lora_model
        was_training = model.training
        layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
        # peft's flag, not diffusers' disable_adapters / enable_adapters: those also set requires_grad on the
        # adapter, and under FSDP2 that lands on the gathered parameters while the sharded ones the optimizer holds
        # stay frozen (the critic's next step then had no gradient).
        states = [layer._disable_adapters for layer in layers]
        model.eval()
        for layer in layers:
            layer._disable_adapters = True
        try:
            return model(*args, **kwargs)
        finally:
            for layer, state in zip(layers, states):
                layer._disable_adapters = state
            model.train(was_training)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weights (``W ← W + (alpha / r)·B·A``, diffusers' ``fuse_lora``) and remove the
    peft layers (``unload_lora``): ``model`` is a plain diffusers model again, with the base's parameter names."""
    model.fuse_lora()
    model.unload_lora()
    return model


def parse_target_modules(text: str) -> tuple[str, ...]:
    """``--lora-target-modules`` text: comma- or space-separated module-name suffixes (``"to_q,to_k,to_v"``)."""
    import argparse

    names = tuple(part for part in text.replace(",", " ").split() if part)
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of module names, got {text!r}")
    return names


def check_lora_flags(prefix: str, flags: LoraFlags, pipeline: str | None, teacher: str | None = None) -> None:
    """Reject a group's LoRA flags that no run can use, with one line naming them (exit 2 through ``parse_args``).

    Args:
        prefix: the flags' prefix, ``"--"`` for the student or ``"--critic-"``, as the messages name them.
        flags: their values.
        pipeline: the pipeline directory whose denoiser the adapter goes on; its transformer config is built on the
            meta device (no weights) to check that every target module names a ``Linear`` of the model.
        teacher: for the critic, ``--teacher-load``: its adapter sits on the teacher's weights (one base per group),
            so ``pipeline`` must be that directory.

    Raises:
        ArgumentValidationError: for a negative rank, alpha <= 0, dropout outside [0, 1), or target modules that
            match no Linear of the model (the message names them and the model's Linear names), or a critic
            adapter on another pipeline than the teacher's. A rank above min(in, out) of every adapted Linear is
            logged as a warning.
    """
    from miles.utils.validation import check_number, reject

    rank, alpha, targets, dropout = flags
    if rank is None or rank < 0:
        reject(f"{prefix}lora-rank must be >= 0 (0 trains full weights), got {rank}")
    if rank == 0:
        return
    if alpha is not None:
        check_number(f"{prefix}lora-alpha", alpha, low=0, low_open=True)
    check_number(f"{prefix}lora-dropout", dropout, low=0, high=1, high_open=True)
    if teacher is not None and os.path.realpath(pipeline) != os.path.realpath(teacher):
        reject(
            f"{prefix}lora-rank puts the critic's adapter on the teacher's weights (one base in the critic group): "
            f"{prefix}load {pipeline} must be --teacher-load {teacher}, or set {prefix}lora-rank 0"
        )
    if pipeline is None:
        return
    from miles.models.memory import meta_denoiser, transformer_config

    try:
        model = meta_denoiser(transformer_config(pipeline))
    except (OSError, ValueError):
        return  # a family outside diffusers: the trainer's load names the problem
    missing = unmatched_targets(model, targets) if targets is not None else []  # the default list skips absent names
    if missing:
        reject(
            f"{prefix}lora-target-modules {','.join(missing)} match no Linear module of {type(model).__name__} in "
            f"{pipeline}; its Linear modules are named {', '.join(linear_suffixes(model))}"
        )
    # A rank above min(in, out) of a layer adds parameters but no capacity. It trains, so it is a warning: a recipe
    # written for a wide model may run on a narrow test model.
    widths = [
        min(m.in_features, m.out_features) for m in adapted_linears(model, targets or DEFAULT_LORA_TARGET_MODULES)
    ]
    if widths and rank > max(widths):
        logger.warning(
            "%slora-rank %d exceeds min(in, out) of every adapted Linear of %s (at most %d): a rank-%d update is "
            "already full rank there, and the rest adds parameters but no capacity",
            prefix, rank, type(model).__name__, max(widths), max(widths),
        )  # fmt: skip
