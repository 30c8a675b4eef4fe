"""``FSDPTrainRayActor``: one data-parallel rank of a trainer group (the actor, the DMD2 critic, ...), the Ray shell.

The shell owns what needs Ray and a process group: the rank's device, the group's process group and mesh, the
collectives over them, and the remote methods the driver calls. The work happens in two plain classes it builds:

- :class:`~miles.backends.fsdp_utils.trainer.GroupTrainer`: the group's model set, hooks, window loop and checkpoint;
- :class:`~miles.rollout.generator.RolloutGenerator` (the actor group only): the rank's shard of each rollout,
  sampled on its own FSDP student, converted to train pairs.

One rollout, per rank::

    generate (actor group):  pairs = generator.generate(ray.get(shard_box.inner))   # kept here for own train
                             return Box(ray.put(pairs))                            # for the paired rank of each group
    train (every group):     output, metrics, timers = trainer.train(rollout_id, pairs, external)
                             return TrainResult(Box(ray.put(output)), metrics (rank 0), timers)

The class is a plain Python class; ``RayTrainGroup`` turns it into a Ray actor.
"""

import contextlib
import logging
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from miles.backends.fsdp_utils.context_parallel import build_meshes
from miles.backends.fsdp_utils.export import write_pipeline
from miles.backends.fsdp_utils.frozen_trainer import FrozenGroupRunner
from miles.backends.fsdp_utils.hooks import check_hooks
from miles.backends.fsdp_utils.trainer import GroupTrainer, timed
from miles.config import GroupSpec, RunSpec
from miles.models.capabilities import decode_latents
from miles.rollout.generator import RolloutGenerator
from miles.utils.collectives import ProcessGroupCollectives
from miles.utils.device import worker_device
from miles.utils.log import setup_logging
from miles.utils.paths import KEEP_BEST_FILE
from miles.utils.profiling import profiled
from miles.utils.types import Box, PromptShard, RolloutResult, TrainPair, TrainResult
from miles.utils.validation import NonFiniteWeightsError

__all__ = ["FSDPTrainRayActor", "init_distributed"]

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def init_distributed(
    device: torch.device,
    address: str,
    rank: int,
    world_size: int,
    timeout_minutes: float,
    context_parallel_size: int = 1,
) -> tuple[Any, ProcessGroupCollectives, Any]:
    """Join the group's process group and build its FSDP mesh, its context-parallel mesh and its collectives.

    The default group is NCCL on CUDA and gloo on the CPU (the hybrid ``"cpu:gloo,cuda:nccl"`` string fails on a
    CPU-only torch); the collectives run on a gloo group of their own (:class:`ProcessGroupCollectives`). Both wait
    ``timeout_minutes`` (``--distributed-timeout-minutes``) before a rank gives up on the others, instead of NCCL's
    10 minutes, which rank 0 exporting an 80 GB pipeline or pushing weights to engine replicas outlasts.

    Args:
        device: the rank's device (:func:`miles.utils.device.worker_device`).
        address: rank 0's ``tcp://host:port``.
        context_parallel_size: ``--context-parallel-size`` (:func:`~miles.backends.fsdp_utils.context_parallel.
            build_meshes`).

    Returns:
        ``(mesh, collectives, cp_mesh)``: the 1-D FSDP mesh over all ranks, the collectives, and this rank's
        ``("ring", "ulysses")`` mesh (None without context parallelism).
    """
    timeout = timedelta(minutes=timeout_minutes)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size, timeout=timeout)
    mesh, cp_mesh = build_meshes(device.type, world_size, context_parallel_size)
    return mesh, ProcessGroupCollectives(device, timeout=timeout), cp_mesh


class FSDPTrainRayActor:
    """One rank of a trainer group. Construct empty; ``init`` does the work (so rank 0 can report its address)."""

    def __init__(self) -> None:
        self.run: RunSpec | None = None
        self.spec: GroupSpec | None = None
        self.role: str | None = None

    # -- setup ---------------------------------------------------------------------------------------------------
    def get_master_addr_and_port(self) -> tuple[str, int]:
        """This node's IP and a free TCP port, for the group's ``init_process_group`` (called on rank 0)."""
        return ray.util.get_node_ip_address(), _free_port()

    def init(
        self,
        run: RunSpec,
        role: str,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        num_threads: int | None = None,
        load_rollout_id: int | None = None,
    ) -> int:
        """Join the group's process group, build the group's trainer (models, optimizer), resume if asked.

        Args:
            run: the run's specs; this rank reads its group's (``run.group(role)``) and, on the actor group, the
                engine's.
            role: the group's role (``"actor"``, ``"critic"``); names its metrics and checkpoint metadata.
            master_addr, master_port: rank 0's address (``get_master_addr_and_port``).
            rank, world_size: this rank and the group's data-parallel size.
            num_threads: CPU threads for torch's intra-op pool: the CPUs of this rank's bundle, at most
                ``OMP_NUM_THREADS`` (``miles.ray.placement_group.rank_threads``; the groups of a bundle train one at
                a time, so each may use all of them).
            load_rollout_id: the committed rollout to resume from its load directory (the driver resolves it), or
                None.

        Returns:
            The first rollout id to train: 0, or ``load_rollout_id + 1``.

        Raises:
            ValueError: on an unset prepare/loss hook or a bad ``train_output_before_step`` (raised on every rank
                before any collective).
            RuntimeError: if the checkpoint does not load or holds non-finite weights.
        """
        setup_logging(run.log_level, worker=True)
        spec = run.group(role)
        self.run, self.spec, self.role, self.rank, self.world_size = run, spec, role, rank, world_size
        if num_threads:
            torch.set_num_threads(int(num_threads))
        if spec.trains:
            check_hooks(spec.hooks)  # an unset prepare or loss hook fails on every rank alike, before any collective
        self.device = worker_device()
        mesh, self.collectives, cp_mesh = init_distributed(
            self.device,
            f"tcp://{master_addr}:{master_port}",
            rank,
            world_size,
            run.distributed_timeout_minutes,
            run.context_parallel_size,
        )
        torch.manual_seed(spec.seed)
        # The family of the group's own pipeline (the critic's --critic-load); a frozen group's is the student's.
        self.family = run.engine.make_family(spec.init)
        options = dict(device=self.device, collectives=self.collectives, args=run.args, profile=run.profile)
        if spec.trains:
            trainer_class = spec.hooks.trainer or GroupTrainer
            if cp_mesh is not None:  # a user's trainer written before context parallelism takes no such keyword
                options["cp_mesh"] = cp_mesh
            self.trainer = trainer_class(spec, self.family, mesh=mesh, **options)
        else:
            self.trainer = FrozenGroupRunner(
                spec, self.family, context_parallel_size=run.context_parallel_size, **options
            )
        self._generator: RolloutGenerator | None = None
        # (rollout_id, object-ref hex, pairs) of this rank's last generate: its own train reads them from here.
        self._generated: tuple[int, str, list[TrainPair]] | None = None
        start_rollout_id = 0
        if load_rollout_id is not None:
            # A frozen group (no load directory of its own) resumes with the others at the same rollout.
            if spec.checkpoint.load:
                self.trainer.load(spec.checkpoint.load, load_rollout_id)
            start_rollout_id = load_rollout_id + 1
        logger.debug(
            "%s rank %d/%d ready on %s, starting at rollout %d", role, rank, world_size, self.device, start_rollout_id
        )
        return start_rollout_id

    def describe(self) -> dict[str, Any]:
        """Rank 0's start-up summary for the driver's one line per group: device, torch's intra-op threads (the
        bundle's CPUs, set by ``init``), parameters, memory held."""
        models = self.trainer.models
        return {
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "trainable_parameters": sum(p.numel() for p in models.trainable_parameters()),
            "frozen_parameters": sum(p.numel() for p in models.frozen_parameters()),
            "sharded": self.world_size > 1 and bool(models.modules()),  # a frozen group holds no module
            "bytes": self.memory_bytes(),
        }

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds at rest: trainable parameters (its shards), the gradients of its last optimizer
        step (before they were freed), the optimizer state, and the frozen models."""
        return self.trainer.models.memory_bytes(self.trainer.gradient_bytes)

    # -- rollouts ------------------------------------------------------------------------------------------------
    @property
    def generator(self) -> RolloutGenerator:
        """The rollout generator on this rank's own student (built on first use)."""
        if self._generator is None:
            self._generator = RolloutGenerator(
                self.run.engine,
                self.family,
                self.trainer.models.denoiser,
                args=self.run.args,
                device=self.device,
                collectives=self.collectives,
                group=self.role,
                inference=self.trainer.inference,
                # The text encoders (no prompt cache) sleep and wake with the group's own state.
                on_text_encoder=self.trainer.sleeper.register,
            )
        return self._generator

    def generate(self, rollout_id: int, shard_box: Box) -> RolloutResult:
        """Collective: generate this rank's shard of rollout ``rollout_id`` and convert it to train pairs
        (:meth:`RolloutGenerator.generate`: ``--train-only`` data or the student's samples, the converter, the
        method's side inputs). The pairs stay in this process for the rank's own train and are put in the object
        store once for the paired ranks of the other groups.

        Returns:
            ``RolloutResult`` with ``Box(ray.put(pairs))``, the pair count and ``perf/<role>-generate_time``.

        Raises:
            ValueError / HookResultError: on a bad converter output, or when the ranks' pair counts differ.
        """
        self.trainer.check_awake("generate", rollout_id)
        timers: dict[str, float] = {}
        shard = ray.get(shard_box.inner)
        with profiled(self.run.profile, self.role, self.rank, rollout_id, "generate"):
            pairs = timed(timers, "generate_time", self.device, self.generator.generate, shard)
        box = Box(ray.put(pairs))
        self._generated = (rollout_id, box.inner.hex(), pairs)
        return RolloutResult(pairs=box, num_pairs=len(pairs), perf=self._perf_record(timers))

    def evaluate(
        self, shard: PromptShard, num_steps: int | None = None, guidance_scale: float | None = None
    ) -> torch.Tensor:
        """Collective: full-trajectory samples of this rank's eval shard with the student: uint8 ``(B, H, W, C)``.

        ``num_steps`` / ``guidance_scale`` default to ``--diffusion-num-steps`` / ``--diffusion-guidance-scale``.
        Every rank must get a shard of the same size (the group pads).

        Raises:
            RuntimeError: if the group is asleep (the driver hands it the device first).
        """
        self.trainer.check_awake("evaluate", shard.rollout_id)
        with self.trainer.eval_weights():
            latents = self.generator.sample(shard, num_steps=num_steps, guidance_scale=guidance_scale)
        return decode_latents(self.family, latents, self.device)

    # -- training ------------------------------------------------------------------------------------------------
    def _pairs(self, rollout_id: int | str, pairs_box: Box) -> list[TrainPair]:
        generated = self._generated
        if generated is not None and generated[0] == rollout_id and generated[1] == pairs_box.inner.hex():
            return generated[2]
        return ray.get(pairs_box.inner)

    def train(self, rollout_id: int, pairs_box: Box, external_data: dict[str, Box] | None = None) -> TrainResult:
        """Train on this rank's pairs of one rollout (:meth:`GroupTrainer.train`).

        Args:
            rollout_id: the rollout's id (seeds the hooks' random draws).
            pairs_box: ``Box(ObjectRef)`` of this rank's ``list[TrainPair]`` (``generate``'s output of the paired
                actor rank).
            external_data: ``{role: Box(ObjectRef)}``, the same-rank train outputs of earlier groups this rollout;
                exposed to the hooks resolved, as ``ctx.external_data[role]``.

        Returns:
            ``TrainResult``: the train-output hook's value boxed (None without the hook), and on rank 0 the
            per-step metrics averaged over the ranks, this rollout's in-worker timers and the bytes held.

        Raises:
            RuntimeError: if the group is asleep (the driver wakes it before training).
            ValueError: if the pairs do not split into ``--num-steps-per-rollout`` windows, or ranks disagree on
                their pair counts (raised on every rank before any model collective).
        """
        pairs = self._pairs(rollout_id, pairs_box)
        external = {role: ray.get(box.inner) for role, box in (external_data or {}).items()}
        output, metrics, timers = self.trainer.train(rollout_id, pairs, external)
        perf = self._perf_record(timers)
        if self.rank == 0:
            perf.update({f"memory/{self.role}-{name}_bytes": n for name, n in self.memory_bytes().items()})
        return TrainResult(output=Box(ray.put(output)), metrics=metrics, perf=perf)

    def train_output(self, rollout_id: int | str, pairs_box: Box, external_data: dict[str, Box] | None = None) -> Box:
        """Collective: run only the train-output hook on this rank's pairs (no optimizer step), e.g. to score a
        fixed probe batch at evaluation time. Returns ``Box(ray.put(output))``.

        Raises:
            ValueError: if the group has no train-output hook.
            RuntimeError: if the group is asleep (the driver hands it the device first).
        """
        if self.trainer.hooks.train_output is None:
            raise ValueError(f"the {self.role} group has no --custom-train-output-function-path")
        self.trainer.check_awake("train_output", rollout_id)
        external = {role: ray.get(box.inner) for role, box in (external_data or {}).items()}
        output = self.trainer.train_output(rollout_id, external, self._pairs(rollout_id, pairs_box))
        return Box(ray.put(output))

    def _perf_record(self, timers: dict[str, float]) -> dict[str, float]:
        """Rank 0's timers as ``perf/<role>-<name>`` (seconds) and ``memory/<role>-peak_<phase>_bytes``; ``{}``
        on the other ranks."""
        if self.rank != 0:
            return {}
        return {f"{'memory' if k.startswith('peak_') else 'perf'}/{self.role}-{k}": v for k, v in timers.items()}

    # -- weights out -----------------------------------------------------------------------------------------------
    def get_full_state_dict(self, eval_weights: bool = False) -> dict[str, torch.Tensor]:
        """Collective: the trainable denoiser's unsharded state dict on CPU at rank 0, ``{}`` on other ranks; with
        ``eval_weights``, the weights evaluation uses (the EMA's with ``--ema-for-eval``).

        Raises:
            RuntimeError: if the group is asleep (the driver hands it the device first).
        """
        self.trainer.check_awake("get_full_state_dict")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = self.trainer.eval_weights() if eval_weights else contextlib.nullcontext()
        with weights:
            return get_model_state_dict(self.trainer.models.denoiser, options=options)

    def update_weights(self, engines: list) -> None:
        """Collective: gather the full weights; rank 0 puts them in the object store once and loads them into every
        engine replica (``--rollout-num-gpus``), waiting for all of them."""
        state_dict = self.get_full_state_dict()
        if self.rank == 0:
            ref = ray.put(state_dict)
            # A top-level ObjectRef argument reaches each replica resolved, read straight from the object store.
            ray.get([engine.load_weights.remote(ref) for engine in engines])
        # The other ranks wait on the host (a gloo group), outside NCCL's watchdog, while rank 0 alone pushes.
        self.collectives.barrier()

    def export_hf(
        self,
        out_dir: str,
        schedule: dict[str, Any] | None,
        run_paths: list[tuple[str, str]] | None = None,
        keep_best: dict[str, Any] | None = None,
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
            keep_best: ``--keep-best``'s export (``<save-hf>-best``): its record, written into the export; the
                driver checked the directory before Ray and replaces it only with a better rollout's student.

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
                Path(self.spec.init),
                Path(out_dir),
                self.family,
                state_dict,
                schedule,
                # A best export replaces only an earlier best export (its keep_best.json), or what the user allowed.
                overwrite=self.run.export.overwrite
                or keep_best is not None
                and (Path(out_dir) / KEEP_BEST_FILE).is_file(),
                run_paths=run_paths or [],
                lora=self.spec.lora,
                # The best export holds the merged weights only; --save-hf-lora's adapter is the last export's.
                save_lora=self.run.export.save_lora and keep_best is None,
                keep_best=keep_best,
                name="--keep-best's export" if keep_best is not None else "--save-hf",
            )
            logger.debug("exported %s pipeline to %s", self.role, out_dir)
        # The other ranks wait on the host (a gloo group), outside NCCL's watchdog, while rank 0 alone writes.
        self.collectives.barrier()
        return str(out_dir)

    # -- checkpoints and memory ------------------------------------------------------------------------------------
    def save(self, rollout_id: int, data_state: Any = None) -> str:
        """Collective: checkpoint this group after ``rollout_id`` into ``--save`` (:meth:`GroupTrainer.save`).

        Raises:
            ValueError: if the group's ``--save`` is unset.
        """
        save = self.spec.checkpoint.save
        if not save:
            raise ValueError(f"{self.role} group has no --save directory; pass --save to checkpoint")
        return self.trainer.save(save, rollout_id, data_state)

    def sleep(self) -> float:
        """Move model shards and optimizer state to the CPU (no-op when asleep); returns the seconds it took."""
        start = time.perf_counter()
        self.trainer.sleeper.sleep()
        return time.perf_counter() - start

    def wake_up(self) -> float:
        """Move them back to the training device (no-op when awake); returns the seconds it took."""
        start = time.perf_counter()
        self.trainer.sleeper.wake_up()
        return time.perf_counter() - start

    def sleep_state(self) -> str:
        """``"awake"`` or ``"asleep"``."""
        return self.trainer.sleeper.state

    def shutdown(self) -> None:
        """Free the group's pinned host buffers (awake) and close the process group."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None and not trainer.sleeper.asleep:
            trainer.sleeper.release_host_buffers()
        if dist.is_initialized():
            dist.destroy_process_group()
