"""``GroupTrainer``: what one rank of a trainer group does with its pairs, without Ray.

A plain class: it owns the group's model set (:mod:`~miles.backends.fsdp_utils.model_set`), its hooks, the window
loop and the checkpoint of its state, and it talks to the other ranks only through the ``Collectives`` it is handed.
The Ray shell (``FSDPTrainRayActor``) gives it a process group's collectives and a mesh; a unit test gives it
``LocalCollectives`` and no mesh, and it trains at world size 1 on the CPU with no process group at all.

One rollout, per rank::

    pairs = train_input_hook(ctx, pairs)                          # optional; every rank keeps an equal count
    for window in split(pairs, num_steps_per_rollout):            # step(): one optimizer step each
        for micro_batch in split(window, micro_batch_size):
            prepared = prepare_hook(ctx, micro_batch)
            new_pred = ctx.predict_velocity(models[prepared.component], ...)
            (loss_hook(ctx, micro_batch, prepared, new_pred=..., metrics=m) / len(window)).backward()
        clip; a non-finite norm skips the step; optimizer.step(); scheduler.step(); post-step hooks (the EMA)
    output = train_output_hook(ctx, pairs)                        # optional, no grad; later groups read it
    metrics averaged over the ranks (one gather per rollout, rank 0 keeps them)

A method whose update is not "backward of a summed loss" (a JVP method such as sCM) overrides :meth:`step`.
"""

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils import checkpoint
from miles.backends.fsdp_utils.context_parallel import dp_rank_of
from miles.backends.fsdp_utils.converters import ModelConverter, build_converters
from miles.backends.fsdp_utils.hooks import (
    check_hooks,
    check_loss,
    check_prepared,
    check_train_input,
    metric_key,
    split_windows,
)
from miles.backends.fsdp_utils.loss_hub.types import Metrics, TrainContext
from miles.backends.fsdp_utils.model import compute_context, resolve_dtype, window_sync
from miles.backends.fsdp_utils.model_set import ModelSet, build_model_set, local_bytes
from miles.backends.fsdp_utils.optimizer import apply_optimizer_spec, clip_grad_norm_
from miles.backends.fsdp_utils.sleep import SleepController
from miles.config import GroupHooks, GroupSpec, ProfileSpec, hook_name
from miles.models.base import DENOISER
from miles.utils.collectives import Collectives, check_equal_counts
from miles.utils.profiling import profiled
from miles.utils.types import TrainPair
from miles.utils.validation import HookResultError, NonFiniteError, NonFiniteWeightsError

__all__ = [
    "GroupTrainer",
    "host_means",
    "host_values",
    "reduce_step_metrics",
    "run_train_input",
    "timed",
]

logger = logging.getLogger(__name__)


def timed(timers: dict[str, float], key: str, device: torch.device, fn: Callable, *args):
    """Run ``fn(*args)``, adding its seconds to ``timers[key]``; on CUDA also the phase's peak device memory
    (``timers["peak_<phase>_bytes"]``, the largest over the calls).

    On CUDA the phase ends with one ``torch.cuda.synchronize``: kernels run after the host queued them, so without it
    the phase's last kernels would fall into the next phase's time (and MFU would read high). A phase that ended
    with a host transfer was in step already; the synchronize then costs nothing."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        # A named span in a --profile-rollouts trace; free when no profiler is on.
        with torch.profiler.record_function(key.removesuffix("_time")):
            return fn(*args)
    finally:
        if cuda:
            torch.cuda.synchronize(device)
        timers[key] = timers.get(key, 0.0) + time.perf_counter() - start
        if cuda:
            peak = f"peak_{key.removesuffix('_time')}_bytes"
            timers[peak] = max(timers.get(peak, 0), torch.cuda.max_memory_allocated(device))


def host_values(figures: dict[str, Any]) -> dict[str, list[float]]:
    """Every figure's values as Python numbers, with one device-to-host transfer per device for all of them.

    A loss hook appends its per-pair values to ``metrics[name]`` as tensors (on the device, with no sync) or as
    numbers; the trainer moves a whole window's figures to the host once (:func:`host_means`), instead of a
    ``.tolist()`` per micro-batch, each of which waits for the GPU to drain its queue.

    Args:
        figures: ``{name: value}``, a value being a number, a tensor (each element one value: per-pair ``(B,)``, a
            0-dim scalar) or a list of numbers and tensors.

    Returns:
        ``{name: [values in order]}``: each tensor's elements as Python floats (a float32 or bf16 value becomes the
        Python float ``tensor.cpu().tolist()`` gives), numbers as they are.
    """
    layout: list[tuple[str, torch.device | None, Any]] = []  # (name, device of a tensor or None, numel or number)
    parts: dict[torch.device, list[torch.Tensor]] = {}
    for name, value in figures.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, torch.Tensor):
                flat = item.detach().reshape(-1)
                # float64 holds every float32 / bf16 / small-integer value exactly, as the Python float it becomes.
                parts.setdefault(flat.device, []).append(flat.to(torch.float64))
                layout.append((name, flat.device, flat.numel()))
            else:
                layout.append((name, None, item))
    # The one transfer (per device holding figures): everything waits for the device here, and only here.
    host = {device: torch.cat(tensors).tolist() for device, tensors in parts.items()}
    offsets = dict.fromkeys(host, 0)
    values: dict[str, list[float]] = {}
    for name, device, item in layout:
        if device is None:
            values.setdefault(name, []).append(item)
            continue
        start = offsets[device]
        offsets[device] = start + item
        values.setdefault(name, []).extend(host[device][start : start + item])
    return values


def host_means(figures: dict[str, Any]) -> dict[str, float]:
    """``{name: sum(values) / len(values)}`` of :func:`host_values` (one transfer), summed as Python floats in order:
    exactly the figure a hook that extended its list with ``tensor.cpu().tolist()`` gave. A figure without values
    is left out."""
    return {name: sum(items) / len(items) for name, items in host_values(figures).items() if items}


def reduce_step_metrics(
    collectives: Collectives, role: str, step_metrics: list[dict[str, float]]
) -> list[dict[str, float]]:
    """Average each step's metrics over the DP ranks under their ``train/`` keys (:func:`metric_key`): one gather
    per rollout, the result on rank 0 only (``[]`` elsewhere)."""
    gathered = collectives.gather_objects(step_metrics)
    if collectives.rank != 0:
        return []
    reduced = []
    for steps in zip(*gathered):
        names = sorted({name for rank_metrics in steps for name in rank_metrics})
        row = {}
        for name in names:
            values = [rank_metrics[name] for rank_metrics in steps if name in rank_metrics]
            row[metric_key(role, name)] = sum(values) / len(values)
        reduced.append(row)
    return reduced


def run_train_input(
    hooks: GroupHooks, ctx: TrainContext, pairs: list[TrainPair], collectives: Collectives, role: str
) -> list[TrainPair]:
    """The train-input hook on this rank's pairs, checked (:func:`check_train_input`); every rank then agrees that
    they all hold as many pairs as before (one collective, also when this rank's hook failed).

    Raises:
        HookResultError: on every rank, naming the hook, when it returned something else on any rank.
    """
    received = len(pairs)
    pairs = hooks.train_input(ctx, pairs)
    path = hook_name(hooks.train_input)
    problem = None
    try:
        check_train_input(pairs, path, received)
    except HookResultError as exc:
        problem = exc
    count = len(pairs) if problem is None else 0
    check_equal_counts(collectives, count, f"train-input hook {path}", role, problem)
    return pairs


class GroupRank:
    """What every rank of a trainer group shares, trained (:class:`GroupTrainer`) or frozen
    (:class:`~miles.backends.fsdp_utils.frozen_trainer.FrozenGroupRunner`): the awake check and its hooks' context.
    A subclass sets ``role``, ``args``, ``family``, ``device``, ``dtype``, ``rank``, ``world_size``, ``models`` (its
    ``trainable`` and ``frozen`` modules) and ``sleeper``; :meth:`__init__` sets those both read from their
    constructor's arguments."""

    def __init__(
        self,
        spec: GroupSpec,
        family: Any,
        device: torch.device,
        collectives: Collectives,
        args: Any,
        profile: Any,
        context_parallel_size: int = 1,
    ) -> None:
        self.spec, self.role, self.family, self.device = spec, spec.role, family, device
        self.args, self.profile, self.collectives = args, profile, collectives
        self.rank, self.world_size = collectives.rank, collectives.world_size
        # A context-parallel group's ranks split one sample's sequence: the hooks see their DP rank and DP size.
        self.dp_rank = dp_rank_of(self.rank, context_parallel_size)
        self.dp_size = self.world_size // context_parallel_size

    def check_awake(self, what: str, rollout_id: int | str | None = None) -> None:
        """Refuse to compute while asleep. Only the driver wakes a group (``DeviceTurns``, after putting the group
        that held the shared GPU to sleep); a group that woke itself would sit on the GPU beside the other one.

        Raises:
            RuntimeError: naming the group, ``what`` and the rollout, if the group is asleep.
        """
        if self.sleeper.asleep:
            when = "" if rollout_id is None else f" (rollout {rollout_id})"
            raise RuntimeError(f"{self.role} group is asleep; call wake_up() before {what}{when}")

    def context(self, rollout_id: int | str, external: dict[str, Any], microbatch_id: int = 0) -> TrainContext:
        """What a hook sees for one micro-batch."""
        return TrainContext(
            args=self.args,
            models=dict(self.models.trainable),
            teacher_models=self.models.frozen,
            external_data=external,
            family=self.family,
            device=self.device,
            dtype=self.dtype,
            rollout_id=rollout_id,
            microbatch_id=microbatch_id,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )


class GroupTrainer(GroupRank):
    """One rank of a trainer group: its model set, hooks and window loop.

    Args:
        spec: the group's spec (:class:`miles.config.GroupSpec`): its models, optimizer, schedule, EMA, steps,
            micro-batch, dtype and hooks. The trainer reads nothing else.
        family: the model family instance (loading, the velocity forward).
        device: where the models train.
        collectives: the group's collectives (``LocalCollectives`` for a group of one).
        mesh: the group's 1-D FSDP mesh over all its ranks, or None for a group of one (nothing is sharded).
        cp_mesh: this rank's ``("ring", "ulysses")`` context-parallel mesh, or None: the denoiser and the teacher
            split each sample's sequence over it (:mod:`miles.backends.fsdp_utils.context_parallel`), and the hooks
            see the DP rank ``rank // cp`` (a CP group's ranks draw the same noise for the same pairs).
        args: the command's parsed flags, handed to the hooks only (``ctx.args``, the module builder's first
            argument; :attr:`miles.config.RunSpec.args`); None for hooks that read none.
        converters: changes applied to the trainable modules before sharding; default :func:`build_converters`.
        profile: the ``--profile-rollouts`` range and directory, or None.

    Raises:
        ValueError: on an unset prepare/loss hook, a spec without a model source (a frozen group) or a bad
            ``train_output_before_step``.
        RuntimeError: if a model does not load.
    """

    def __init__(
        self,
        spec: GroupSpec,
        family: Any,
        *,
        device: torch.device,
        collectives: Collectives,
        mesh=None,
        cp_mesh=None,
        args: Any = None,
        converters: list[ModelConverter] | None = None,
        profile: ProfileSpec | None = None,
    ) -> None:
        if not spec.trains:
            raise ValueError(f"the {spec.role} group's spec has no model source: it is frozen (FrozenGroupRunner)")
        super().__init__(spec, family, device, collectives, args, profile, 1 if cp_mesh is None else cp_mesh.size())
        self.hooks = check_hooks(spec.hooks)
        self.output_before = spec.train_output_before_step
        if self.output_before is not None and not 0 <= self.output_before < spec.steps_per_rollout:
            raise ValueError(
                f"train_output_before_step={self.output_before} must index one of the {spec.steps_per_rollout} "
                "optimizer steps of a rollout"
            )
        self.dtype = resolve_dtype(spec.dtype)
        self.sync_every_microbatch = spec.reshard_every_microbatch
        converters = build_converters(spec) if converters is None else converters
        self.models: ModelSet = build_model_set(spec, family, device, self.dtype, mesh, converters, args, cp_mesh)
        # Run after every optimizer step that was taken (not after a skipped one), in order.
        self.post_step_hooks: list[Callable[[], None]] = []
        if self.models.ema is not None:
            self.post_step_hooks.append(self.models.ema.update)
        self.ema_for_eval = self.models.ema is not None and spec.ema.for_eval
        self.sleeper = SleepController(self.models.modules(), self.models.optimizer, device, ema=self.models.ema)
        self.max_skipped_steps = spec.optimizer.max_skipped_steps
        self.skipped_in_a_row = 0
        self.skipped_total = 0
        self.gradient_bytes = 0
        self._output_metrics: Metrics = {}

    # -- the rollout ---------------------------------------------------------------------------------------------
    def train(
        self, rollout_id: int, pairs: list[TrainPair], external: dict[str, Any]
    ) -> tuple[Any, list[dict[str, float]], dict[str, float]]:
        """Train on this rank's pairs of one rollout.

        Args:
            external: earlier groups' train outputs for this rank, by role (``ctx.external_data``).

        Returns:
            ``(output, metrics, timers)``: the train-output hook's value (None without the hook); one record per
            optimizer step averaged over the ranks (``train/...`` keys, rank 0 only, ``[]`` on the others); the
            seconds of ``train_steps_time`` and ``train_output_time`` (and peak CUDA bytes).

        Raises:
            RuntimeError: if the group is asleep.
            ValueError / HookResultError: if the pairs do not split into ``--num-steps-per-rollout`` windows, or the
                train-input hook breaks the ranks' equal counts (raised on every rank before any model collective).
            NonFiniteError: after ``--max-skipped-steps`` non-finite steps in a row.
        """
        self.check_awake("train", rollout_id)
        with profiled(self.profile, self.role, self.rank, rollout_id, "train"):
            return self._train(rollout_id, pairs, external)

    def _train(
        self, rollout_id: int, pairs: list[TrainPair], external: dict[str, Any]
    ) -> tuple[Any, list[dict[str, float]], dict[str, float]]:
        if self.hooks.train_input is not None:
            pairs = self._train_input(rollout_id, pairs, external)
        windows = split_windows(pairs, self.spec.steps_per_rollout, self.spec.micro_batch_size)
        timers = {"train_steps_time": 0.0, "train_output_time": 0.0}
        self._output_metrics = {}
        output, output_done = None, self.hooks.train_output is None
        step_metrics = []
        for index, window in enumerate(windows):
            if not output_done and self.output_before == index:
                output = timed(
                    timers, "train_output_time", self.device, self.train_output, rollout_id, external, pairs
                )
                output_done = True
            first = index * len(windows[0])
            step_metrics.append(
                timed(timers, "train_steps_time", self.device, self.step, rollout_id, external, window, first)
            )
        if not output_done:
            output = timed(timers, "train_output_time", self.device, self.train_output, rollout_id, external, pairs)
        # A hook may have run a frozen model (kept gathered through the phase); free it before the next group.
        self.models.reshard()
        output_figures = host_means(self._output_metrics)  # the train-output hook's, joined to the last step's
        if output_figures:
            step_metrics[-1].update(output_figures)
        return output, self.reduce_metrics(step_metrics), timers

    def _train_input(self, rollout_id: int, pairs: list[TrainPair], external: dict[str, Any]) -> list[TrainPair]:
        ctx = self.context(rollout_id, external, 0)
        return run_train_input(self.hooks, ctx, pairs, self.collectives, self.role)

    def step(
        self, rollout_id: int, external: dict[str, Any], micro_batches: list[list[TrainPair]], first_microbatch_id: int
    ) -> dict[str, float]:
        """One optimizer step on one window: forward and backward of every micro-batch (prepare, forward, loss /
        the window's pair count), then :meth:`apply_gradients`. Returns the step's metrics (``loss``,
        ``grad_norm``, ``lr``, ``step``, ``skipped_steps`` and the loss hook's own, averaged over the pairs).

        A method whose update needs more than the backward of a summed loss (a JVP method such as sCM) overrides
        this and ends with :meth:`apply_gradients` too, so clipping, the non-finite skip and the post-step hooks
        stay the trainer's."""
        window_pairs = sum(len(mb) for mb in micro_batches)
        # Filled by the loss hook with per-pair tensors; moved to the host once, in apply_gradients.
        hook_metrics: Metrics = {}
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        for j, micro_batch in enumerate(micro_batches):
            ctx = self.context(rollout_id, external, first_microbatch_id + j)
            prepared = check_prepared(self.hooks.prepare(ctx, micro_batch), hook_name(self.hooks.prepare))
            if not self.sync_every_microbatch:
                for module in self.models.trainable.values():
                    window_sync(module, last_micro_batch=j == len(micro_batches) - 1)
            if prepared.component not in ctx.models:
                raise HookResultError(
                    f"prepare hook {hook_name(self.hooks.prepare)} asked for component "
                    f"{prepared.component!r}; this group trains {sorted(ctx.models)}"
                )
            model = ctx.models[prepared.component]
            with compute_context(model, self.dtype, self.device):
                new_pred = ctx.predict_velocity(model, prepared.latents, prepared.timestep, prepared.cond)
                loss_sum = check_loss(
                    self.hooks.loss(ctx, micro_batch, prepared, new_pred=new_pred, metrics=hook_metrics),
                    hook_name(self.hooks.loss),
                )
            # The hook returns a sum over pairs; dividing by the window's count makes the step the window mean.
            (loss_sum / window_pairs).backward()
            loss_total += loss_sum.detach().double()
        # float64 division on the device is the correctly rounded quotient Python's float division gives.
        return self.apply_gradients(rollout_id, {"loss": loss_total / window_pairs, **hook_metrics})

    def apply_gradients(self, rollout_id: int | str, metrics: dict[str, Any]) -> dict[str, float]:
        """Clip the accumulated gradients, then take the optimizer and LR steps and run the post-step hooks, or skip
        all of them on a non-finite norm; zero the gradients. Returns ``metrics`` (``loss`` and the hooks' figures)
        with ``grad_norm``, ``lr``, ``step`` and ``skipped_steps`` added.

        Args:
            metrics: the window's figures, ``loss`` among them, each a number, a tensor or a list of per-pair values
                (:func:`host_means`); they reach the host in one transfer together with the gradient norm.

        Raises:
            NonFiniteError: after ``--max-skipped-steps`` non-finite steps in a row.
        """
        figures = host_means({"grad_norm": self.clip_grad_norm(), **metrics})  # the window's one host transfer
        grad_norm = figures.pop("grad_norm")
        self.gradient_bytes = sum(
            local_bytes(p.grad) for p in self.models.trainable_parameters() if p.grad is not None
        )
        lr = self.models.scheduler.get_last_lr()[0]
        metrics = {"loss": figures["loss"], "grad_norm": grad_norm, "lr": lr, **figures}
        if math.isfinite(grad_norm):
            self.models.optimizer.step()
            self.models.scheduler.step()
            for hook in self.post_step_hooks:
                hook()
            self.skipped_in_a_row = 0
        else:
            # The global norm is the same on every rank, so every rank skips: no weight, moment or LR step sees it.
            self._skip_step(rollout_id, metrics)
        self.models.optimizer.zero_grad(set_to_none=True)
        metrics["step"] = self.models.scheduler.last_epoch
        metrics["skipped_steps"] = self.skipped_total
        return metrics

    def _skip_step(self, rollout_id: int | str, metrics: dict[str, float]) -> None:
        """A non-finite gradient norm: count the skipped step; after ``--max-skipped-steps`` in a row, stop the run
        naming the first non-finite figure (the last committed checkpoint stays the resume point)."""
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        first_bad = next(
            (f"{metric_key(self.role, name)}={value}" for name, value in metrics.items() if not math.isfinite(value)),
            f"{metric_key(self.role, 'grad_norm')}={metrics['grad_norm']}",
        )
        if self.rank == 0:
            logger.warning(
                "%s group, rollout %d: non-finite gradient norm (%s); optimizer step skipped (%d in a row)",
                self.role,
                rollout_id,
                first_bad,
                self.skipped_in_a_row,
            )
        if self.max_skipped_steps and self.skipped_in_a_row >= self.max_skipped_steps:
            raise NonFiniteError(
                f"{self.role} group, rollout {rollout_id}: {self.skipped_in_a_row} optimizer steps in a row had a "
                f"non-finite gradient norm (first non-finite figure {first_bad}); stopping so that no NaN reaches "
                "the weights (--max-skipped-steps)"
            )

    def clip_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the trainable parameters' gradients (before clipping), a 0-dim tensor on the device
        (left there: :meth:`apply_gradients` reads it with the window's other figures); clips to ``--clip-grad`` > 0
        (:func:`~miles.backends.fsdp_utils.optimizer.clip_grad_norm_`)."""
        grads = [p.grad for p in self.models.trainable_parameters() if p.grad is not None]
        return clip_grad_norm_(grads, self.spec.optimizer.clip_grad)

    def train_output(self, rollout_id: int | str, external: dict[str, Any], pairs: list[TrainPair]) -> Any:
        """Run the train-output hook on this rank's pairs under no grad (its figures join the last step's)."""
        ctx = self.context(rollout_id, external, 0)
        ctx.metrics = self._output_metrics
        try:
            with torch.no_grad(), compute_context(self.models.denoiser, self.dtype, self.device):
                return self.hooks.train_output(ctx, pairs)
        finally:
            self.models.reshard()

    def reduce_metrics(self, step_metrics: list[dict[str, float]]) -> list[dict[str, float]]:
        """Average each step's metrics over the DP ranks (:func:`reduce_step_metrics`), on rank 0 only."""
        return reduce_step_metrics(self.collectives, self.role, step_metrics)

    # -- weights -------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def inference(self):
        """A no-grad use of the denoiser in the compute dtype, in eval mode; resharded (and back in train mode)
        after: rollouts and evaluation on the student's own weights."""
        denoiser = self.models.denoiser
        denoiser.eval()
        try:
            with torch.no_grad(), compute_context(denoiser, self.dtype, self.device):
                yield
        finally:
            denoiser.train()
            self.models.reshard()

    def eval_weights(self):
        """The weights evaluation and export use: the EMA's with ``--ema-for-eval``, else the live ones."""
        return self.models.ema.applied() if self.ema_for_eval else contextlib.nullcontext()

    def check_finite_weights(self, what: str) -> None:
        """Collective: refuse non-finite weights (every rank checks its shards; one all-reduce).

        Raises:
            NonFiniteWeightsError: naming ``what`` and up to three parameters.
        """
        names = []
        for name, param in self.models.trainable.named_parameters():
            local = param.detach().to_local() if isinstance(param, DTensor) else param.detach()
            if not torch.isfinite(local).all():
                names.append(name)
        (bad,) = self.collectives.all_reduce_max([len(names)])
        if bad:
            shown = ", ".join(names[:3]) or "on another rank"
            raise NonFiniteWeightsError(f"{what} has non-finite weights ({shown}); refusing to use them")

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save(self, save_dir: str, rollout_id: int, data_state: Any = None) -> str:
        """Collective: check the weights are finite, then checkpoint every ``Stateful`` of the model set after
        ``rollout_id`` (:func:`miles.backends.fsdp_utils.checkpoint.save_checkpoint`). Returns the directory.

        Raises:
            RuntimeError: if the group is asleep (the driver hands it the device first: :meth:`check_awake`).
        """
        self.check_awake("save", rollout_id)
        self.check_finite_weights(f"the {self.role} group after rollout {rollout_id}")
        path = checkpoint.save_checkpoint(
            save_dir, rollout_id, self.models.states(), role=self.role, data_state=data_state
        )
        return str(path)

    def load(self, load_dir: str, rollout_id: int) -> None:
        """Collective: restore the model set from its checkpoint of ``rollout_id`` and check it is finite.

        Raises:
            RuntimeError: if the checkpoint is missing, corrupt, of another format or does not fit.
            NonFiniteWeightsError: if it holds non-finite weights.
        """
        # A checkpoint of phase 1 holds no GAN head and no EMA: phase 2 starts them fresh (the driver refuses any
        # other difference before Ray starts, miles.driver.resume); the denoiser must be there.
        saved = checkpoint.saved_entries(load_dir, rollout_id)
        fresh = frozenset(
            name
            for name in self.models.trainable
            if name != DENOISER and not any(key.startswith(f"train.model.{name}.") for key in saved)
        )
        fresh_ema = self.models.ema is not None and not any(key.startswith("ema.") for key in saved)
        checkpoint.load_checkpoint(load_dir, rollout_id, self.models.states(fresh, ema=not fresh_ema))
        if fresh_ema:
            self.models.ema.restart()
        if fresh or fresh_ema:
            started = [*sorted(fresh), *(["the EMA"] if fresh_ema else [])]
            logger.info(
                "%s group: the checkpoint of rollout %d holds no %s: started fresh", self.role, rollout_id,
                ", ".join(started),
            )  # fmt: skip
        # A resume may change --lr, --weight-decay, the betas: the loaded state holds the earlier run's.
        apply_optimizer_spec(self.models.optimizer, self.models.scheduler, self.spec.optimizer)
        self.check_finite_weights(f"the {self.role} checkpoint of rollout {rollout_id} in {load_dir}")
