"""``FrozenGroupRunner``: one rank of a trainer group that trains nothing and only runs its train-output hook.

A frozen group (the DMD2 reward group, :mod:`~miles.backends.fsdp_utils.loss_hub.reward`) takes part in every rollout
like any other group: it receives its rank's train pairs and the earlier groups' outputs, and its train-output hook's
value reaches the later groups as ``ctx.external_data[role]``. It loads no denoiser, builds no optimizer, takes no
step and has no checkpoint (its spec has no model source, :attr:`miles.config.GroupSpec.trains` is False; the
driver skips it when it saves and resumes). The model its hook runs (a reward model) belongs to the hook, which loads
it on first use and keeps it.

It is a small class of its own beside :class:`~miles.backends.fsdp_utils.trainer.GroupTrainer`, not a subclass: the
two share the functions that gather metrics and run the train-input hook
(:func:`~miles.backends.fsdp_utils.trainer.reduce_step_metrics`, :func:`~miles.backends.fsdp_utils.trainer.run_train_input`),
and the Ray shell asks either for what it needs (``train``, ``train_output``, ``check_awake``, ``sleeper``,
``models``, ``gradient_bytes``).
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from miles.backends.fsdp_utils.loss_hub.types import Metrics
from miles.backends.fsdp_utils.sleep import SleepController
from miles.backends.fsdp_utils.trainer import GroupRank, host_means, reduce_step_metrics, run_train_input, timed
from miles.config import GroupSpec, ProfileSpec
from miles.utils.collectives import Collectives
from miles.utils.profiling import profiled
from miles.utils.types import TrainPair

__all__ = ["FrozenGroupRunner", "FrozenModelSet"]


@dataclass
class FrozenModelSet:
    """The model set of a frozen group: nothing trainable, nothing to checkpoint (the shape of
    :class:`~miles.backends.fsdp_utils.model_set.ModelSet` the Ray shell and the driver read)."""

    trainable: nn.ModuleDict = field(default_factory=nn.ModuleDict)
    frozen: dict[str, nn.Module] = field(default_factory=dict)

    @property
    def denoiser(self) -> nn.Module:
        raise RuntimeError("a frozen trainer group holds no denoiser; it neither generates nor exports")

    def trainable_parameters(self) -> list[nn.Parameter]:
        return []

    def frozen_parameters(self) -> list[nn.Parameter]:
        return []

    def modules(self) -> list[nn.Module]:
        return []

    def memory_bytes(self, gradient_bytes: int = 0) -> dict[str, int]:
        return {"parameters": 0, "gradients": 0, "optimizer": 0, "frozen": 0}


class FrozenGroupRunner(GroupRank):
    """One rank of a frozen group: :meth:`train` runs the train-output hook once per rollout, nothing else.

    Args:
        spec: the group's spec; its ``hooks.train_output`` (and ``hooks.train_input``, if any) run, its
            ``micro_batch_size`` and ``dtype`` reach the hook through ``ctx``.
        family: the model family instance (``ctx.family``: the reward hook decodes with it).
        device: where the hook runs.
        collectives: the group's collectives.
        args: the command's parsed flags, for the hooks only (``ctx.args``).
        profile: the ``--profile-rollouts`` range and directory, or None.
        context_parallel_size: ``--context-parallel-size``: the hooks see DP rank ``rank // context_parallel_size``
            (the ranks of a CP group hold the same pairs and draw the same noise).

    Raises:
        ValueError: if the group has no train-output hook (it would do nothing) or trains (its spec has a model
            source: a :class:`~miles.backends.fsdp_utils.trainer.GroupTrainer` runs it).
    """

    def __init__(
        self,
        spec: GroupSpec,
        family: Any,
        *,
        device: torch.device,
        collectives: Collectives,
        args: Any = None,
        profile: ProfileSpec | None = None,
        context_parallel_size: int = 1,
    ) -> None:
        if spec.trains:
            raise ValueError(f"the {spec.role} group trains {spec.init}; a GroupTrainer runs it, not a frozen runner")
        if spec.hooks.train_output is None:
            raise ValueError(
                f"the frozen {spec.role} group needs --custom-train-output-function-path; it trains nothing"
            )
        super().__init__(spec, family, device, collectives, args, profile, context_parallel_size)
        self.hooks = spec.hooks
        self.models = FrozenModelSet()
        self.sleeper = SleepController([], None, device)
        self.gradient_bytes = 0  # no gradient is ever held
        self.dtype = torch.float32  # in the hooks' context: the hook chooses its own dtypes

    def train(
        self, rollout_id: int, pairs: list[TrainPair], external: dict[str, Any]
    ) -> tuple[Any, list[dict[str, float]], dict[str, float]]:
        """Run the train-output hook on this rank's pairs. Returns ``(output, metrics, timers)`` as
        :meth:`GroupTrainer.train` does: the hook's figures as one record (rank 0; ``[]`` when it logs none) and
        ``train_output_time``.

        Raises:
            RuntimeError: if the group is asleep.
        """
        self.check_awake("train", rollout_id)
        with profiled(self.profile, self.role, self.rank, rollout_id, "train"):
            if self.hooks.train_input is not None:
                pairs = run_train_input(
                    self.hooks, self.context(rollout_id, external), pairs, self.collectives, self.role
                )
            timers = {"train_output_time": 0.0}
            figures: Metrics = {}
            output = timed(
                timers, "train_output_time", self.device, self._output, rollout_id, external, pairs, figures
            )
            record = host_means(figures)
            return output, reduce_step_metrics(self.collectives, self.role, [record] if record else []), timers

    def train_output(self, rollout_id: int | str, external: dict[str, Any], pairs: list[TrainPair]) -> Any:
        """The train-output hook alone (an evaluation's probe), its figures dropped."""
        return self._output(rollout_id, external, pairs, {})

    def _output(self, rollout_id: int | str, external: dict[str, Any], pairs: list[TrainPair], figures: dict) -> Any:
        ctx = self.context(rollout_id, external)
        ctx.metrics = figures
        # Under no grad as every train-output hook; a hook that needs a gradient enables it itself.
        with torch.no_grad():
            return self.hooks.train_output(ctx, pairs)

    @contextlib.contextmanager
    def inference(self):
        raise RuntimeError(f"the frozen {self.role} group holds no denoiser to sample with")
        yield  # pragma: no cover

    def eval_weights(self):
        return contextlib.nullcontext()

    def save(self, save_dir: str, rollout_id: int, data_state: Any = None) -> str:
        raise RuntimeError(f"the frozen {self.role} group has no trainable state to checkpoint")

    def load(self, load_dir: str, rollout_id: int) -> None:
        raise RuntimeError(f"the frozen {self.role} group has no checkpoint to load")
