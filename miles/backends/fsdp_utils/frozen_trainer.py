"""``FrozenGroupTrainer``: a trainer group that trains nothing and only runs its train-output hook.

A frozen group (the DMD2 reward group, :mod:`~miles.backends.fsdp_utils.loss_hub.reward`) takes part in every rollout
like any other group: it receives its rank's train pairs and the earlier groups' outputs, and its train-output hook's
value reaches the later groups as ``ctx.external_data[role]``. It loads no denoiser, builds no optimizer, takes no
step and has no checkpoint (its ``--save`` and ``--load`` are unset; the driver skips it when it saves and resumes).
The model its hook runs (a reward model) belongs to the hook, which loads it on first use and keeps it.

A method selects it for a group with ``custom_trainer_path`` and ``num_steps_per_rollout = 0`` among the group's
overrides (:func:`miles.utils.trainer_config.trains`).
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from miles.backends.fsdp_utils.hooks import TrainHooks, load_hooks
from miles.backends.fsdp_utils.sleep import SleepController
from miles.backends.fsdp_utils.trainer import GroupTrainer, host_means, timed
from miles.utils.collectives import Collectives
from miles.utils.types import TrainPair

__all__ = ["FrozenGroupTrainer", "FrozenModelSet"]


@dataclass
class FrozenModelSet:
    """The model set of a frozen group: nothing trainable, nothing to checkpoint (the shape of
    :class:`~miles.backends.fsdp_utils.model_set.ModelSet` the Ray shell and the driver read)."""

    trainable: nn.ModuleDict = field(default_factory=nn.ModuleDict)
    frozen: dict[str, nn.Module] = field(default_factory=dict)
    optimizer: None = None
    ema: None = None

    @property
    def denoiser(self) -> nn.Module:
        raise RuntimeError("a frozen trainer group holds no denoiser; it neither generates nor exports")

    def trainable_parameters(self) -> list[nn.Parameter]:
        return []

    def frozen_parameters(self) -> list[nn.Parameter]:
        return []

    def modules(self) -> list[nn.Module]:
        return []

    def states(self) -> dict:
        return {}

    def reshard(self) -> None:
        return None

    def memory_bytes(self, gradient_bytes: int = 0) -> dict[str, int]:
        return {"parameters": 0, "gradients": 0, "optimizer": 0, "frozen": 0}


class FrozenGroupTrainer(GroupTrainer):
    """One rank of a frozen group: :meth:`train` runs the train-output hook once per rollout, nothing else.

    Args: as :class:`~miles.backends.fsdp_utils.trainer.GroupTrainer` (``mesh`` and ``converters`` are ignored).

    Raises:
        ValueError: if the group has no ``--custom-train-output-function-path`` (it would do nothing), or on a bad
            hook path.
    """

    # mesh and converters (GroupTrainer's other keywords) shard and change a denoiser this group does not hold.
    def __init__(self, args, role: str, *, family: Any, device: torch.device, collectives: Collectives,
                 hooks: TrainHooks | None = None, **unused: Any) -> None:  # fmt: skip
        self.args, self.role, self.family, self.device = args, role, family, device
        self.collectives = collectives
        self.rank, self.world_size = collectives.rank, collectives.world_size
        self.hooks = hooks if hooks is not None else load_hooks(args)
        if self.hooks.train_output is None:
            raise ValueError(f"the frozen {role} group needs --custom-train-output-function-path; it trains nothing")
        self.output_before = None
        self.dtype = torch.float32
        self.models = FrozenModelSet()
        self.post_step_hooks = []
        self.ema_for_eval = False
        self.sleeper = SleepController([], None, device)
        self.max_skipped_steps = args.max_skipped_steps
        self.skipped_in_a_row = self.skipped_total = self.gradient_bytes = 0
        self._output_metrics: dict[str, list[float | torch.Tensor]] = {}

    def train(
        self, rollout_id: int, pairs: list[TrainPair], external: dict[str, Any]
    ) -> tuple[Any, list[dict[str, float]], dict[str, float]]:
        """Run the train-output hook on this rank's pairs. Returns ``(output, metrics, timers)`` as
        :meth:`GroupTrainer.train` does: the hook's figures as one record (rank 0; ``[]`` when it logs none) and
        ``train_output_time``."""
        if self.sleeper.asleep:
            raise RuntimeError(f"{self.role} group is asleep; call wake_up() before train (rollout {rollout_id})")
        if self.hooks.train_input is not None:
            pairs = self._train_input(rollout_id, pairs, external)
        timers = {"train_output_time": 0.0}
        self._output_metrics = {}
        output = timed(timers, "train_output_time", self.device, self.train_output, rollout_id, external, pairs)
        record = host_means(self._output_metrics)
        return output, self.reduce_metrics([record] if record else []), timers

    def train_output(self, rollout_id: int | str, external: dict[str, Any], pairs: list[TrainPair]) -> Any:
        """The train-output hook under no grad (a hook that needs a gradient enables it itself)."""
        ctx = self.context(rollout_id, external, 0)
        ctx.metrics = self._output_metrics
        with torch.no_grad():
            return self.hooks.train_output(ctx, pairs)

    def step(self, *args, **kwargs):
        raise RuntimeError(f"the frozen {self.role} group takes no optimizer step")

    @contextlib.contextmanager
    def inference(self):
        raise RuntimeError(f"the frozen {self.role} group holds no denoiser to sample with")
        yield  # pragma: no cover

    def save(self, save_dir: str, rollout_id: int, data_state: Any = None) -> str:
        raise RuntimeError(f"the frozen {self.role} group has no trainable state to checkpoint")

    def load(self, load_dir: str, rollout_id: int) -> None:
        raise RuntimeError(f"the frozen {self.role} group has no checkpoint to load")
