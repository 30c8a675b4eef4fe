"""The generator EMA (``--ema-decay``): an exponential moving average of a group's trainable weights.

The math is diffusers' ``EMAModel`` (``diffusers.training_utils``): after optimizer step n the shadow weights move
toward the live ones, ``shadow ← shadow − (1 − d_n)·(shadow − param)``, with the warm-up ``d_n = max(min_decay,
min(decay, (1 + m) / (10 + m)))``, m = n − 1 − update_after_step, and ``d_n = 0`` (a copy of the weights) while
m ≤ 0. The warm-up is slow: with decay 0.99 it reaches 0.971 after 300 steps and 0.99 only after 890;
``min_decay = decay`` turns it off (a constant decay from the second step). The shadows are float32 and sharded
like the parameters: each rank averages its own shards (FSDP2's DTensor parameters, seen through their local
tensors, so no collective is needed). Rollouts keep using the live weights, so training stays on-policy; the export
and the evaluation use the shadows when ``--ema-for-eval`` (the default with an EMA).
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ParameterEMA"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ParameterEMA:
    """The EMA of the trainable parameters of ``modules`` (a name → module mapping, e.g. the group's trainables).

    Args:
        modules: the modules whose parameters are averaged, in a fixed order.
        decay: the EMA decay in (0, 1), e.g. 0.99.
        min_decay: the warm-up's floor in [0, decay] (``--ema-min-decay``; diffusers' ``min_decay``).
        update_after_step: optimizer steps during which the EMA copies the weights (``--ema-update-after-step``).

    Raises:
        ValueError: if ``decay`` is not in (0, 1) or ``min_decay`` not in [0, decay].
    """

    def __init__(
        self, modules: nn.ModuleDict, decay: float, min_decay: float = 0.0, update_after_step: int = 0
    ) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"--ema-decay must be in (0, 1), got {decay}")
        if not 0 <= min_decay <= decay:
            raise ValueError(f"--ema-min-decay must be in [0, --ema-decay {decay}], got {min_decay}")
        # Imported here, not at the top: diffusers.training_utils loads every diffusers model class (about 5 s), and
        # this module is on the path of train_diffusion.py's argument parsing (the methods' flags), --help included.
        from diffusers.training_utils import EMAModel

        self.modules = modules
        self.names = [name for name, param in modules.named_parameters() if param.requires_grad]
        with torch.no_grad():
            self._ema = EMAModel(
                self._locals(),
                decay=decay,
                min_decay=min_decay,
                update_after_step=update_after_step,
                foreach=True,
            )
        # float32 shadows whatever the parameters' dtype (a frozen copy would not need it; trainables are fp32).
        self._ema.shadow_params = [shadow.detach().float().clone() for shadow in self._ema.shadow_params]

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average again from the live weights, with its warm-up (no update made): for a resume whose
        checkpoint kept no EMA (phase 1 -> phase 2), after the weights are loaded."""
        self._ema.shadow_params = [param.detach().float().clone() for param in self._locals()]
        self._ema.optimization_step = 0

    def _params(self) -> list[torch.Tensor]:
        named = dict(self.modules.named_parameters())
        return [named[name] for name in self.names]

    def _locals(self) -> list[torch.Tensor]:
        # Re-read every time: FSDP2 swaps its registered parameters between phases; the local tensors are views.
        # Taken with grad enabled: EMAModel averages only the tensors that require grad.
        with torch.enable_grad():
            return [_local(param) for param in self._params()]

    @property
    def num_updates(self) -> int:
        return int(self._ema.optimization_step)

    @property
    def decay_value(self) -> float:
        """The decay of the last update (after warm-up)."""
        return float(getattr(self._ema, "cur_decay_value", 0.0) or 0.0)

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step toward the current weights (call after each optimizer step)."""
        self._ema.step(self._locals())

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """Run a block with the EMA weights in the modules, restoring the live weights after it. The modules must
        be resharded (no gathered parameters) on entry, and are again on exit."""
        params = self._locals()
        live = [param.clone() for param in params]
        torch._foreach_copy_(
            params, [shadow.to(param.dtype) for shadow, param in zip(self._ema.shadow_params, params)]
        )
        try:
            yield
        finally:
            torch._foreach_copy_(self._locals(), live)

    @property
    def shadows(self) -> list[torch.Tensor]:
        """The float32 shadows, one per averaged parameter (its local shard), in :attr:`names` order. The group's
        sleep puts them in its pinned host buffers and back (``SleepController``) by setting this list."""
        return self._ema.shadow_params

    @shadows.setter
    def shadows(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self._ema.shadow_params):
            raise ValueError(f"{len(tensors)} shadows given for {len(self._ema.shadow_params)} parameters")
        self._ema.shadow_params = list(tensors)

    def to(self, device: torch.device) -> None:
        """Move the shadows with blocking copies (no pinned memory; a group's sleep uses :attr:`shadows`)."""
        self._ema.shadow_params = [shadow.to(device) for shadow in self._ema.shadow_params]

    def state_dict(self) -> dict:
        """``{"num_updates": int, "shadow": {name: tensor}}``; shadows of DTensor parameters are DTensors with the
        parameters' mesh and placements, so DCP can reshard them to another world size."""
        shadows = {}
        for name, param, shadow in zip(self.names, self._params(), self._ema.shadow_params):
            if isinstance(param, DTensor):
                # the global shape given: a dim 0 smaller than the world (Wan's (1, 2, D) scale_shift_table) shards
                # unevenly, and from_local would infer another shape on each rank
                shadow = DTensor.from_local(
                    shadow,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
            shadows[name] = shadow
        return {"num_updates": self.num_updates, "shadow": shadows}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (loaded in place into its tensors by DCP)."""
        self._ema.optimization_step = int(state["num_updates"])
        for index, name in enumerate(self.names):
            self._ema.shadow_params[index].copy_(_local(state["shadow"][name]))
