"""``FSDPTrainRayActor``: one data-parallel rank of a trainer group (the actor, the DMD2 critic, ...).

The class is role-agnostic: the group's args (after its ``TrainerConfig`` overrides) say which checkpoint to train,
which frozen teacher to hold and which hooks carry the algorithm. The actor (student) group also generates the
rollouts: each rank samples its own shard on its own FSDP module, so nothing crosses processes but train pairs.

One rollout, per rank::

    generate (actor group):  shard = ray.get(prompt_box.inner)             # this rank's prompts
                             samples = engine.generate(shard)              # no_grad, on the student itself
                             pairs = converter(args, samples)              # --custom-expand-...-path
                             return Box(ray.put(pairs))                    # for the paired rank of every group
    train (every group):     pairs = ray.get(pairs_box.inner)              # the actor keeps its own in memory
                             pairs = train_input_hook(ctx, pairs)          # optional
                             for window in split(pairs, num_steps_per_rollout):      # one optimizer step each
                                 for micro_batch in split(window, micro_batch_size):
                                     prepared = prepare_hook(ctx, micro_batch)
                                     new_pred = ctx.predict_velocity(models[prepared.component], ...)
                                     (loss_hook(ctx, micro_batch, prepared, new_pred=..., metrics=m) / len(window)).backward()
                                 clip_grad_norm_; optimizer.step(); scheduler.step()
                             output = train_output_hook(ctx, pairs)        # optional, no grad; later groups read it
                             return TrainResult(Box(ray.put(output)), per-step metrics averaged over ranks, timers)

The class is a plain Python class; ``RayTrainGroup`` turns it into a Ray actor.
"""

import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils import checkpoint
from miles.backends.fsdp_utils.ema import ParameterEMA
from miles.backends.fsdp_utils.export import write_pipeline
from miles.backends.fsdp_utils.hooks import (
    check_loss,
    check_prepared,
    check_train_input,
    load_hooks,
    metric_key,
    split_windows,
)
from miles.backends.fsdp_utils.loss_hub.types import TrainContext
from miles.backends.fsdp_utils.model import (
    compute_context,
    load_frozen_denoiser,
    load_trainable_denoiser,
    reshard,
    resolve_dtype,
    shard_model,
    window_sync,
)
from miles.backends.fsdp_utils.optimizer import build_lr_scheduler, build_optimizer
from miles.backends.fsdp_utils.sleep import SleepController
from miles.models.base import read_scheduler_config
from miles.rollout.conditioning import PromptConditioner
from miles.rollout.engine import RolloutEngine, convert_samples, data_samples
from miles.utils.log import setup_logging
from miles.utils.misc import load_function
from miles.utils.types import Box, PromptShard, RolloutResult, TrainPair, TrainResult
from miles.utils.validation import HookResultError, NonFiniteError, NonFiniteWeightsError

__all__ = ["FSDPTrainRayActor"]

logger = logging.getLogger(__name__)

# The trainable denoiser's component name: PreparedBatch.component and TrainContext.models use it.
TRANSFORMER = "transformer"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _training_device() -> torch.device:
    """The CUDA device Ray assigned to this actor, or the CPU on a machine without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = 0
    gpu_ids = [str(i) for i in ray.get_gpu_ids()] if ray.is_initialized() else []
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU unless told not to; then find ours among the visible ones.
    if gpu_ids and gpu_ids[0] in visible:
        index = visible.index(gpu_ids[0])
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class FSDPTrainRayActor:
    """One rank of a trainer group. Construct empty; ``init`` does the work (so rank 0 can report its address)."""

    def __init__(self) -> None:
        self.args = None
        self.role: str | None = None

    # -- setup ---------------------------------------------------------------------------------------------------
    def get_master_addr_and_port(self) -> tuple[str, int]:
        """This node's IP and a free TCP port, for the group's ``init_process_group`` (called on rank 0)."""
        return ray.util.get_node_ip_address(), _free_port()

    def init(
        self,
        args,
        role: str,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        num_threads: int | None = None,
        load_rollout_id: int | None = None,
    ) -> int:
        """Join the group's process group, load and shard the models, build the optimizer, resume if asked.

        Args:
            args: the group's args (``compute_trainer_args(args, trainer)``).
            role: the group's role (``"actor"``, ``"critic"``); names its metrics and checkpoint metadata.
            master_addr, master_port: rank 0's address (``get_master_addr_and_port``).
            rank, world_size: this rank and the group's data-parallel size.
            num_threads: CPU threads for torch's intra-op pool: the CPUs of this rank's bundle (the groups of a
                bundle train one at a time, so each may use all of them).
            load_rollout_id: the committed rollout to resume from ``--load`` (the driver resolves it), or None.

        Returns:
            The first rollout id to train: 0, or ``load_rollout_id + 1``.

        Raises:
            ValueError: on a bad hook path, an unset prepare/loss hook or a bad ``train_output_before_step``
                (raised on every rank before any collective).
            RuntimeError: if the checkpoint does not load or holds non-finite weights.
        """
        setup_logging(getattr(args, "log_level", "INFO"), worker=True)
        self.args, self.role, self.rank, self.world_size = args, role, rank, world_size
        if num_threads:
            torch.set_num_threads(int(num_threads))
        # Hooks first: a bad path fails on every rank alike, before anyone waits in a collective.
        self.hooks = load_hooks(args)
        before = getattr(args, "train_output_before_step", None)
        if before is not None and not 0 <= before < args.num_steps_per_rollout:
            raise ValueError(
                f"train_output_before_step={before} must index one of the {args.num_steps_per_rollout} optimizer "
                "steps of a rollout"
            )

        self.device = _training_device()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size
        )
        self.mesh = init_device_mesh(self.device.type, (world_size,), mesh_dim_names=("dp",))
        torch.manual_seed(args.seed)

        from miles.models import get_model_family

        self.family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
        self.dtype = resolve_dtype(args.train_dtype)
        # Gathered through each phase, reduce-scattered once per optimizer step (see model.py), unless memory is short.
        self.sync_every_microbatch = bool(getattr(args, "fsdp_reshard_every_microbatch", False))
        self.model = load_trainable_denoiser(
            self.family,
            args.hf_checkpoint,
            self.mesh,
            self.device,
            self.dtype,
            gradient_checkpointing=getattr(args, "gradient_checkpointing", False),
            reshard_after_forward=self.sync_every_microbatch,
        )
        self.teacher_models = {}
        if getattr(args, "teacher_load", None):
            self.teacher_models[TRANSFORMER] = load_frozen_denoiser(
                self.family,
                args.teacher_load,
                self.mesh,
                self.device,
                self.dtype,
                reshard_after_forward=self.sync_every_microbatch,
            )
        # The group's trainable modules: the denoiser, plus what --custom-build-modules-path adds (the DMD2 GAN head),
        # all under one optimizer, clipped, checkpointed and slept together.
        self.modules = nn.ModuleDict({TRANSFORMER: self.model})
        builder = getattr(args, "custom_build_modules_path", None)
        if builder:
            for name, module in self._build_extra_modules(load_function(builder), builder).items():
                self.modules[name] = module
        self.optimizer = build_optimizer(list(self.modules.values()), args)
        self.scheduler = build_lr_scheduler(self.optimizer, args, args.num_rollout * args.num_steps_per_rollout)
        ema_decay = getattr(args, "ema_decay", None)
        self.ema = (
            ParameterEMA(
                self.modules,
                ema_decay,
                min_decay=getattr(args, "ema_min_decay", 0.0),
                update_after_step=getattr(args, "ema_update_after_step", 0),
            )
            if ema_decay
            else None
        )
        self.ema_for_eval = self.ema is not None and getattr(args, "ema_for_eval", True)
        self.state = checkpoint.TrainState(self.modules, self.optimizer, self.ema)
        self.sleeper = SleepController(
            [*self.modules.values(), *self.teacher_models.values()], self.optimizer, self.device, ema=self.ema
        )
        self.max_skipped_steps = int(getattr(args, "max_skipped_steps", 3) or 0)
        self._skipped_in_a_row = 0
        self._skipped_total = 0
        self._gradient_bytes = 0
        self._engine: RolloutEngine | None = None
        self._converter: Callable | None = None
        # (rollout_id, object-ref hex, pairs) of this rank's last generate: its own train reads them from here.
        self._generated: tuple[int, str, list[TrainPair]] | None = None

        start_rollout_id = 0
        if getattr(args, "load", None) and load_rollout_id is not None:
            checkpoint.load_checkpoint(args.load, load_rollout_id, self.state, self.scheduler)
            self._check_finite_weights(f"the {role} checkpoint of rollout {load_rollout_id} in {args.load}")
            start_rollout_id = load_rollout_id + 1
        logger.debug(
            "%s rank %d/%d ready on %s, starting at rollout %d", role, rank, world_size, self.device, start_rollout_id
        )
        return start_rollout_id

    def _build_extra_modules(self, builder: Callable, path: str) -> dict[str, nn.Module]:
        """Call ``--custom-build-modules-path`` (``fn(args, models) -> {name: nn.Module}``) on the loaded denoiser,
        then place and shard each module it returns like the denoiser (one FSDP unit each)."""
        extras = builder(self.args, {TRANSFORMER: self.model})
        if not isinstance(extras, dict) or not all(
            isinstance(name, str) and isinstance(module, nn.Module) for name, module in extras.items()
        ):
            raise HookResultError(
                f"--custom-build-modules-path {path} returned {type(extras).__name__}; expected a dict of "
                "name -> torch.nn.Module"
            )
        if TRANSFORMER in extras:
            raise ValueError(
                f"--custom-build-modules-path {path} returned a module named {TRANSFORMER!r}, the denoiser's"
            )
        for module in extras.values():
            module.to(self.device).train().requires_grad_(True)
            if self.world_size > 1:
                shard_model(module, [], self.mesh, self.dtype, reshard_after_forward=self.sync_every_microbatch)
        return extras

    def _check_finite_weights(self, what: str) -> None:
        """Refuse non-finite weights (every rank checks its shards; one all-reduce)."""
        bad = torch.zeros((), dtype=torch.int64, device=self.device)
        names = []
        for name, param in self.modules.named_parameters():
            local = param.detach().to_local() if isinstance(param, DTensor) else param.detach()
            if not torch.isfinite(local).all():
                bad += 1
                names.append(name)
        dist.all_reduce(bad)
        if int(bad):
            shown = ", ".join(names[:3]) or "on another rank"
            raise NonFiniteWeightsError(f"{what} has non-finite weights ({shown}); refusing to use them")

    def describe(self) -> dict[str, Any]:
        """Rank 0's start-up summary for the driver's one line per group: device, parameters, memory held."""
        trainable = sum(p.numel() for p in self.modules.parameters())
        frozen = sum(p.numel() for model in self.teacher_models.values() for p in model.parameters())
        return {
            "device": str(self.device),
            "trainable_parameters": trainable,
            "frozen_parameters": frozen,
            "sharded": self.world_size > 1,
            "bytes": self.memory_bytes(),
        }

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds at rest: trainable parameters (its shards), the gradients of its last optimizer
        step (before they were freed), the optimizer state, and the frozen models."""
        optim = sum(
            _local_bytes(value)
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        return {
            "parameters": sum(_local_bytes(p) for p in self.modules.parameters()),
            "gradients": self._gradient_bytes,
            "optimizer": optim,
            "frozen": sum(_local_bytes(p) for model in self.teacher_models.values() for p in model.parameters()),
        }

    # -- rollouts ------------------------------------------------------------------------------------------------
    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine on this rank's own student (built on first use; its text encoder loads lazily)."""
        if self._engine is None:
            args = self.args
            conditioner = PromptConditioner(args, self.family, args.hf_checkpoint, device=self.device)
            self._engine = RolloutEngine(
                args,
                self.family,
                self.model,
                conditioner,
                self.family.latent_shape(args.hf_checkpoint),
                read_scheduler_config(args.hf_checkpoint)["num_train_timesteps"],
            )
        return self._engine

    def _all_reduce_max(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    @contextlib.contextmanager
    def _student_inference(self):
        """A no-grad use of the student in the compute dtype, in eval mode; resharded (and back in train mode) after."""
        self.model.eval()
        try:
            with torch.no_grad(), compute_context(self.model, self.dtype, self.device):
                yield
        finally:
            self.model.train()
            reshard(self.model)

    def generate(self, rollout_id: int, shard_box: Box) -> RolloutResult:
        """Collective: generate this rank's shard of rollout ``rollout_id`` and convert it to train pairs.

        With ``--train-only`` the shard's records are data samples (their images or latents); otherwise the
        rollout engine samples them on this rank's student. The converter (``--custom-expand-samples-to-train-pairs
        -path``) runs here; its pairs stay in this process for the rank's own train and are put in the object store
        once for the paired ranks of the other groups.

        Returns:
            ``RolloutResult`` with ``Box(ray.put(pairs))``, the pair count and ``perf/<role>-generate_time``.

        Raises:
            ValueError: on a bad converter path or output, or when the ranks' pair counts differ.
        """
        timers: dict[str, float] = {}
        pairs = self._timed(timers, "generate_time", self._generate_pairs, shard_box)
        box = Box(ray.put(pairs))
        self._generated = (rollout_id, box.inner.hex(), pairs)
        return RolloutResult(pairs=box, num_pairs=len(pairs), perf=self._perf_record(timers))

    def _generate_pairs(self, shard_box: Box) -> list[TrainPair]:
        args = self.args
        shard: PromptShard = ray.get(shard_box.inner)
        if args.train_only:
            samples = data_samples(
                args, self.family, self.engine.conditioner, shard, self.family.latent_shape(args.hf_checkpoint)
            )
        else:
            with self._student_inference():
                samples = self.engine.generate(shard, sync_last_step=self._all_reduce_max)
        if self._converter is None:
            self._converter = load_function(args.custom_expand_samples_to_train_pairs_path)
        path = args.custom_expand_samples_to_train_pairs_path
        problem, pairs = None, []
        try:
            pairs = convert_samples(args, self._converter, samples)
        except HookResultError as exc:
            problem = exc
        # Before any other collective: a rank whose converter failed would otherwise leave the others waiting.
        self._check_equal_counts(len(pairs), f"converter {path}", problem)
        if shard.real_records is not None:
            self._attach_real_samples(shard, pairs)
        return pairs

    def _attach_real_samples(self, shard: PromptShard, pairs: list[TrainPair]) -> None:
        """Pair each train pair, in order, with the shard's real sample of the same position (its latent and
        prompt cond: ``real_x0``, ``real_cond``), so every micro-batch holds as many real as generated samples.

        Raises:
            ValueError: if the converter returned another count than the real samples dealt.
        """
        if len(pairs) != len(shard.real_records):
            raise ValueError(
                f"{len(pairs)} train pairs but {len(shard.real_records)} real samples in rollout {shard.rollout_id}; "
                "real data pairs with one train pair per generated sample"
            )
        real = PromptShard(
            shard.rollout_id,
            list(shard.sample_indices),
            [str(record[self.args.input_key]) for record in shard.real_records],
            shard.real_records,
            shard.real_base_dir,
        )
        shape = self.family.latent_shape(self.args.hf_checkpoint)
        for pair, sample in zip(pairs, data_samples(self.args, self.family, self.engine.conditioner, real, shape)):
            pair.real_x0, pair.real_cond = sample.x0, sample.env.pos_cond

    def evaluate(
        self, shard: PromptShard, num_steps: int | None = None, guidance_scale: float | None = None
    ) -> torch.Tensor:
        """Collective: full-trajectory samples of this rank's eval shard with the student: uint8 ``(B, H, W, C)``.

        ``num_steps`` / ``guidance_scale`` default to ``--diffusion-num-steps`` / ``--diffusion-guidance-scale``.
        Every rank must get a shard of the same size (the group pads).
        """
        with self.sleeper.awake(), self._eval_weights(), self._student_inference():
            latents = self.engine.sample(shard, num_steps=num_steps, guidance_scale=guidance_scale)
        return self.family.latents_to_images(latents)

    def _eval_weights(self):
        """The weights evaluation and export use: the EMA's with ``--ema-for-eval``, else the live ones."""
        return self.ema.applied() if self.ema_for_eval else contextlib.nullcontext()

    # -- training ------------------------------------------------------------------------------------------------
    def _context(self, rollout_id: int, external_data: dict[str, Any], microbatch_id: int) -> TrainContext:
        return TrainContext(
            args=self.args,
            models=dict(self.modules),
            teacher_models=self.teacher_models,
            external_data=external_data,
            family=self.family,
            device=self.device,
            dtype=self.dtype,
            rollout_id=rollout_id,
            microbatch_id=microbatch_id,
            dp_rank=self.rank,
            dp_size=self.world_size,
        )

    def _reshard_all(self) -> None:
        # Sharded models stay gathered through a phase (model.py); free them at its end so that sleep moves shards.
        for model in [*self.modules.values(), *self.teacher_models.values()]:
            reshard(model)

    def _check_equal_counts(
        self, num_pairs: int, source: str = "the train-input hook", problem: Exception | None = None
    ) -> None:
        """Every rank must run the same number of micro-batches, or the FSDP collectives would hang.

        Collective: ``problem`` is this rank's failed check of the hook's result; it is raised here, after every rank
        took part, and the other ranks raise naming the first failed rank instead of waiting for it forever."""
        # One MAX all-reduce: the largest count, the smallest (negated) and the first failed rank (negated, with a
        # sentinel below every rank when none failed).
        none_failed = -(1 << 30)
        first_failed = -self.rank if problem is not None else none_failed
        counts = torch.tensor([num_pairs, -num_pairs, first_failed], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        largest, smallest, failed_rank = int(counts[0]), -int(counts[1]), -int(counts[2])
        if problem is not None:
            raise problem
        if int(counts[2]) != none_failed:
            raise HookResultError(
                f"{source} failed its check on DP rank {failed_rank} of the {self.role} group (that rank's error "
                "says why)"
            )
        if largest != smallest:
            raise ValueError(
                f"{self.role} ranks hold different numbers of train pairs ({smallest}..{largest}) after {source}; "
                "it must keep every rank's count equal"
            )

    def _pairs(self, rollout_id: int, pairs_box: Box) -> list[TrainPair]:
        generated = self._generated
        if generated is not None and generated[0] == rollout_id and generated[1] == pairs_box.inner.hex():
            return generated[2]
        return ray.get(pairs_box.inner)

    def train(self, rollout_id: int, pairs_box: Box, external_data: dict[str, Box] | None = None) -> TrainResult:
        """Train on this rank's pairs of one rollout.

        Args:
            rollout_id: the rollout's id (seeds the hooks' random draws).
            pairs_box: ``Box(ObjectRef)`` of this rank's ``list[TrainPair]`` (``generate``'s output of the paired
                actor rank).
            external_data: ``{role: Box(ObjectRef)}``, the same-rank train outputs of earlier groups this rollout;
                exposed to the hooks resolved, as ``ctx.external_data[role]``.

        Returns:
            ``TrainResult``: the train-output hook's value boxed (None without the hook), and on rank 0 the
            per-step metrics averaged over the ranks and this rollout's in-worker timers.

        Raises:
            RuntimeError: if the group is asleep (the driver wakes it before training).
            ValueError: if the pairs do not split into ``--num-steps-per-rollout`` windows, or ranks disagree on
                their pair counts (raised on every rank before any model collective).
        """
        if self.sleeper.asleep:
            raise RuntimeError(f"{self.role} group is asleep; call wake_up() before train (rollout {rollout_id})")
        args = self.args
        pairs = self._pairs(rollout_id, pairs_box)
        external = {role: ray.get(box.inner) for role, box in (external_data or {}).items()}
        if self.hooks.train_input is not None:
            received = len(pairs)
            pairs = self.hooks.train_input(self._context(rollout_id, external, 0), pairs)
            problem = None
            try:
                check_train_input(pairs, args.custom_train_input_function_path, received)
            except HookResultError as exc:
                problem = exc
            path = args.custom_train_input_function_path
            self._check_equal_counts(len(pairs) if problem is None else 0, f"train-input hook {path}", problem)
        windows = split_windows(pairs, args.num_steps_per_rollout, args.micro_batch_size)
        micro_batches_per_window = len(windows[0])

        timers = {"train_steps_time": 0.0, "train_output_time": 0.0}
        self._output_metrics: dict[str, list[float]] = {}
        output, output_done = None, self.hooks.train_output is None
        before = getattr(args, "train_output_before_step", None)
        step_metrics = []
        for window_index, window in enumerate(windows):
            if not output_done and before == window_index:
                output = self._timed(timers, "train_output_time", self._train_output, rollout_id, external, pairs)
                output_done = True
            first = window_index * micro_batches_per_window
            metrics = self._timed(timers, "train_steps_time", self._train_window, rollout_id, external, window, first)
            step_metrics.append(metrics)
        if not output_done:
            output = self._timed(timers, "train_output_time", self._train_output, rollout_id, external, pairs)
        # A hook may have run a frozen model (kept gathered through the phase); free it before the next group.
        self._reshard_all()
        for name, values in self._output_metrics.items():
            if values:
                step_metrics[-1][name] = sum(values) / len(values)
        metrics = self._reduce_metrics(step_metrics)
        perf = self._perf_record(timers)
        if self.rank == 0:
            perf.update({f"memory/{self.role}-{name}_bytes": n for name, n in self.memory_bytes().items()})
        return TrainResult(output=Box(ray.put(output)), metrics=metrics, perf=perf)

    def _perf_record(self, timers: dict[str, float]) -> dict[str, float]:
        """Rank 0's timers as ``perf/<role>-<name>`` (seconds) and ``memory/<role>-peak_<phase>_bytes``; ``{}``
        on the other ranks."""
        if self.rank != 0:
            return {}
        return {f"{'memory' if k.startswith('peak_') else 'perf'}/{self.role}-{k}": v for k, v in timers.items()}

    def _timed(self, timers: dict[str, float], key: str, fn: Callable, *args):
        """Run ``fn(*args)``, adding its seconds to ``timers[key]``; on CUDA also the phase's peak device memory
        (``timers["peak_<phase>_bytes"]``, the largest over the calls)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            timers[key] = timers.get(key, 0.0) + time.perf_counter() - start
            if cuda:
                peak = f"peak_{key.removesuffix('_time')}_bytes"
                timers[peak] = max(timers.get(peak, 0), torch.cuda.max_memory_allocated(self.device))

    def _train_window(
        self, rollout_id: int, external: dict[str, Any], micro_batches: list[list[TrainPair]], first_microbatch_id: int
    ) -> dict[str, float]:
        """Forward/backward every micro-batch of one window, then one optimizer step. Returns the window's metrics."""
        window_pairs = sum(len(mb) for mb in micro_batches)
        hook_metrics: dict[str, list[float]] = {}
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        for j, micro_batch in enumerate(micro_batches):
            ctx = self._context(rollout_id, external, first_microbatch_id + j)
            prepared = check_prepared(self.hooks.prepare(ctx, micro_batch), self.args.custom_prepare_train_batch_path)
            if not self.sync_every_microbatch:
                for module in self.modules.values():
                    window_sync(module, last_micro_batch=j == len(micro_batches) - 1)
            if prepared.component not in ctx.models:
                raise HookResultError(
                    f"prepare hook {self.args.custom_prepare_train_batch_path} asked for component "
                    f"{prepared.component!r}; this group trains {sorted(ctx.models)}"
                )
            model = ctx.models[prepared.component]
            with compute_context(model, self.dtype, self.device):
                new_pred = ctx.predict_velocity(model, prepared.latents, prepared.timestep, prepared.cond)
                loss_sum = check_loss(
                    self.hooks.loss(ctx, micro_batch, prepared, new_pred=new_pred, metrics=hook_metrics),
                    self.args.custom_loss_function_path,
                )
            # The hook returns a sum over pairs; dividing by the window's count makes the step the window mean.
            (loss_sum / window_pairs).backward()
            loss_total += loss_sum.detach().double()
        grad_norm = self._clip_grad_norm()
        self._gradient_bytes = sum(_local_bytes(p.grad) for p in self.modules.parameters() if p.grad is not None)
        lr = self.scheduler.get_last_lr()[0]
        metrics = {"loss": float(loss_total) / window_pairs, "grad_norm": grad_norm, "lr": lr}
        for name, values in hook_metrics.items():
            if values:
                metrics[name] = sum(values) / len(values)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update()
            self._skipped_in_a_row = 0
        else:
            # The global norm is the same on every rank, so every rank skips: no weight, moment or LR step sees it.
            self._skip_step(rollout_id, metrics)
        self.optimizer.zero_grad(set_to_none=True)
        metrics["step"] = self.scheduler.last_epoch
        metrics["skipped_steps"] = self._skipped_total
        return metrics

    def _skip_step(self, rollout_id: int, metrics: dict[str, float]) -> None:
        """A non-finite gradient norm: skip the optimizer, scheduler and EMA step and count it; after
        ``--max-skipped-steps`` in a row, stop the run naming the first non-finite figure (the last committed
        checkpoint stays the resume point)."""
        self._skipped_in_a_row += 1
        self._skipped_total += 1
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
                self._skipped_in_a_row,
            )
        if self.max_skipped_steps and self._skipped_in_a_row >= self.max_skipped_steps:
            raise NonFiniteError(
                f"{self.role} group, rollout {rollout_id}: {self._skipped_in_a_row} optimizer steps in a row had a "
                f"non-finite gradient norm (first non-finite figure {first_bad}); stopping so that no NaN reaches "
                "the weights (--max-skipped-steps)"
            )

    def _clip_grad_norm(self) -> float:
        """Global L2 norm of the gradients (before clipping); clips to ``--clip-grad`` when it is > 0."""
        params = [p for p in self.modules.parameters() if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
        # Sharded grads give a DTensor norm over this rank's shard; full_tensor() reduces it to the global norm.
        if isinstance(total_norm, DTensor):
            total_norm = total_norm.full_tensor()
        if self.args.clip_grad and self.args.clip_grad > 0 and torch.isfinite(total_norm):
            torch.nn.utils.clip_grads_with_norm_(params, self.args.clip_grad, total_norm, foreach=True)
        return float(total_norm)

    def _train_output(self, rollout_id: int, external: dict[str, Any], pairs: list[TrainPair]) -> Any:
        ctx = self._context(rollout_id, external, 0)
        ctx.metrics = self._output_metrics = {}
        try:
            with torch.no_grad(), compute_context(self.model, self.dtype, self.device):
                return self.hooks.train_output(ctx, pairs)
        finally:
            self._reshard_all()

    def train_output(self, rollout_id: int | str, pairs_box: Box, external_data: dict[str, Box] | None = None) -> Box:
        """Collective: run only the train-output hook on this rank's pairs (no optimizer step), e.g. to score a
        fixed probe batch at evaluation time; the group wakes for it if it sleeps. Returns ``Box(ray.put(output))``.

        Raises:
            ValueError: if the group has no train-output hook.
        """
        if self.hooks.train_output is None:
            raise ValueError(f"the {self.role} group has no --custom-train-output-function-path")
        external = {role: ray.get(box.inner) for role, box in (external_data or {}).items()}
        with self.sleeper.awake():
            output = self._train_output(rollout_id, external, self._pairs(rollout_id, pairs_box))
        return Box(ray.put(output))

    def _reduce_metrics(self, step_metrics: list[dict[str, float]]) -> list[dict[str, float]]:
        """Average each step's metrics over the DP ranks: one gather per rollout, the result on rank 0 only."""
        if self.world_size > 1:
            gathered: list[list[dict[str, float]]] | None = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(step_metrics, gathered, dst=0)
        else:
            gathered = [step_metrics]
        if self.rank != 0:
            return []
        reduced = []
        for steps in zip(*gathered):
            names = sorted({name for rank_metrics in steps for name in rank_metrics})
            row = {}
            for name in names:
                values = [rank_metrics[name] for rank_metrics in steps if name in rank_metrics]
                row[metric_key(self.role, name)] = sum(values) / len(values)
            reduced.append(row)
        return reduced

    # -- weights out -----------------------------------------------------------------------------------------------
    def get_full_state_dict(self, eval_weights: bool = False) -> dict[str, torch.Tensor]:
        """Collective: the trainable denoiser's unsharded state dict on CPU at rank 0, ``{}`` on other ranks; with
        ``eval_weights``, the weights evaluation uses (the EMA's with ``--ema-for-eval``)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        with self.sleeper.awake(), self._eval_weights() if eval_weights else contextlib.nullcontext():
            return get_model_state_dict(self.model, options=options)

    def update_weights(self, engines: list) -> None:
        """Collective: gather the full weights; rank 0 puts them in the object store once and loads them into every
        engine replica (``--rollout-num-gpus``), waiting for all of them."""
        state_dict = self.get_full_state_dict()
        if self.rank == 0:
            ref = ray.put(state_dict)
            # A top-level ObjectRef argument reaches each replica resolved, read straight from the object store.
            ray.get([engine.load_weights.remote(ref) for engine in engines])
        dist.barrier()

    def export_hf(
        self, out_dir: str, schedule: dict[str, Any] | None, run_paths: list[tuple[str, str]] | None = None
    ) -> str:
        """Collective: write the trained denoiser as a diffusers pipeline directory (rank 0 writes).

        The directory is a copy of ``--hf-checkpoint``'s pipeline (hidden files such as tool markers left out) with
        ``transformer/`` replaced by ``save_pretrained`` of an unsharded copy holding the trained weights; its
        scheduler config records the sampling schedule (:func:`miles.models.sampling_schedule.write_sampling_schedule`
        with ``schedule``'s keyword arguments; for a family with ``stock_scheduler``, the scheduler becomes the stock
        diffusers scheduler of the student's rule and grid; ``schedule`` None keeps the source's scheduler).
        Written to a temporary sibling and renamed into place, so a crash never leaves a half-written pipeline at
        ``out_dir``.

        Args:
            run_paths: ``(flag, path)`` of every directory the run reads or writes; ``out_dir`` is checked against
                them (and for what it may replace, :func:`miles.utils.paths.check_export_target`) before the copy
                and again right before the rename.

        Returns:
            ``out_dir``.

        Raises:
            NonFiniteWeightsError: if the weights hold NaN or inf.
            ArgumentValidationError: if ``out_dir`` may not be written (see ``check_export_target``).
            CheckpointWriteError: if the directory cannot be written (a full disk); nothing at ``out_dir`` changed.
        """
        state_dict = self.get_full_state_dict(eval_weights=True)
        if self.rank == 0:
            bad = [key for key, value in state_dict.items() if not torch.isfinite(value).all()]
            if bad:
                raise NonFiniteWeightsError(
                    f"refusing to export {self.role} weights with non-finite values to {out_dir} ({', '.join(bad[:3])})"
                )
            write_pipeline(
                Path(self.args.hf_checkpoint),
                Path(out_dir),
                self.family,
                state_dict,
                schedule,
                overwrite=bool(getattr(self.args, "overwrite_save_hf", False)),
                run_paths=run_paths or [],
            )
            logger.debug("exported %s pipeline to %s", self.role, out_dir)
        dist.barrier()
        return str(out_dir)

    # -- checkpoints and memory ------------------------------------------------------------------------------------
    def save(self, rollout_id: int, data_state: Any = None) -> str:
        """Collective: checkpoint this group after ``rollout_id`` into ``--save`` (see ``checkpoint.py``).

        Raises:
            ValueError: if the group's ``--save`` is unset.
        """
        if not self.args.save:
            raise ValueError(f"{self.role} group has no --save directory; pass --save to checkpoint")
        with self.sleeper.awake():
            self._check_finite_weights(f"the {self.role} group after rollout {rollout_id}")
            path = checkpoint.save_checkpoint(
                self.args.save, rollout_id, self.state, self.scheduler, role=self.role, data_state=data_state
            )
        return str(path)

    def sleep(self) -> float:
        """Move model shards and optimizer state to the CPU (no-op when asleep); returns the seconds it took."""
        start = time.perf_counter()
        self.sleeper.sleep()
        return time.perf_counter() - start

    def wake_up(self) -> float:
        """Move them back to the training device (no-op when awake); returns the seconds it took."""
        start = time.perf_counter()
        self.sleeper.wake_up()
        return time.perf_counter() - start

    def sleep_state(self) -> str:
        """``"awake"`` or ``"asleep"``."""
        return self.sleeper.state

    def shutdown(self) -> None:
        """Close the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of a tensor (its shard of a DTensor)."""
    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return tensor.numel() * tensor.element_size()
