"""``RolloutEngineWorker``: one dedicated rollout-engine replica (``--rollout-num-gpus N``).

By default the actor group's ranks generate the rollouts on their own FSDP modules. With ``--rollout-num-gpus N``
the rollouts run on N replicas of their own instead, each holding an unsharded copy of the student that the actor
group refreshes after every step (``FSDPTrainRayActor.update_weights``). The copy is stored in ``--train-dtype`` (the
modules the model keeps in float32 in float32, :mod:`miles.models.precision`), which is what an actor rank's FSDP2
policy gathers and computes with, so a replica's samples are the actor ranks' samples; a weight update copies the
CPU tensors into it in place. Replica j generates the shards of DP ranks
``j·D/N .. (j + 1)·D/N − 1`` with the same :class:`~miles.rollout.generator.RolloutGenerator` an actor rank uses
(``--train-only`` data, the converter, the method's side inputs), one box per DP rank.

A plain class; ``miles.ray.engine_group.EngineGroup`` turns it into N Ray actors.
"""

import logging
import time

import ray
import torch

from miles.config import RunSpec
from miles.models.capabilities import decode_latents
from miles.models.precision import cast_to_compute_dtype, resolve_dtype
from miles.rollout.generator import RolloutGenerator
from miles.utils.collectives import LocalCollectives
from miles.utils.device import worker_device
from miles.utils.log import setup_logging
from miles.utils.types import Box, PromptShard, RolloutResult

__all__ = ["RolloutEngineWorker"]

logger = logging.getLogger(__name__)


class RolloutEngineWorker:
    """One engine replica. Construct empty; ``init`` loads the student (so Ray can place the actor first)."""

    def init(self, run: RunSpec, num_threads: int | None = None) -> None:
        """Load the family, the student (the engine spec's pipeline, ``--hf-checkpoint``) in ``--train-dtype`` on
        this replica's device, and the rollout generator.

        Raises:
            ValueError: on an unknown ``--train-dtype`` or ``--diffusion-step-rule``.
        """
        setup_logging(run.log_level, worker=True)
        if num_threads:
            torch.set_num_threads(int(num_threads))
        spec = run.engine
        self.device = worker_device()
        self.family = spec.make_family()
        dtype = resolve_dtype(spec.dtype)
        # No float32 master copy (nothing trains here) and no autocast: the stored weights are the compute dtype's, as
        # the actor ranks' FSDP2 policy gathers them; buffers and kept modules as miles.models.precision says.
        denoiser = self.family.load_denoiser(spec.pipeline, dtype=dtype).eval().requires_grad_(False)
        cast_to_compute_dtype(denoiser, dtype)
        denoiser.to(self.device)
        self.generator = RolloutGenerator(
            spec,
            self.family,
            denoiser,
            args=run.args,
            device=self.device,
            collectives=LocalCollectives(),
            group="engine replica",
        )
        # Built now, not on first use: a bad step rule fails at start-up.
        self.engine = self.generator.engine

    def generate(self, rollout_id: int, shard_boxes: list[Box]) -> list[RolloutResult]:
        """Generate and convert each given DP shard; one ``RolloutResult`` per shard, in order."""
        results = []
        for box in shard_boxes:
            start = time.perf_counter()
            shard: PromptShard = ray.get(box.inner)
            pairs = self.generator.generate(shard)
            seconds = time.perf_counter() - start
            results.append(RolloutResult(Box(ray.put(pairs)), len(pairs), {"perf/engine-generate_time": seconds}))
        return results

    def evaluate(
        self, shard: PromptShard, num_steps: int | None = None, guidance_scale: float | None = None
    ) -> torch.Tensor:
        """Full-trajectory samples of the shard with the replica's current weights: uint8 ``(B, H, W, C)``."""
        latents = self.generator.sample(shard, num_steps=num_steps, guidance_scale=guidance_scale)
        return decode_latents(self.family, latents, self.device)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the student's full (unsharded) state dict of CPU tensors in place: each tensor is copied into the
        replica's own parameter or buffer (``copy_`` converts device and dtype one tensor at a time), so no second
        copy of the model is ever built on the device.

        Raises:
            RuntimeError: when keys are missing or unexpected (the trainer and the engine hold different models);
                nothing is copied then.
        """
        targets = self.generator.denoiser.state_dict(keep_vars=True)
        missing = sorted(set(targets) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(targets))
        if missing or unexpected:
            raise RuntimeError(
                f"update_weights: the student state dict does not match the engine's denoiser (missing "
                f"{missing[:5]}, unexpected {unexpected[:5]}); were --hf-checkpoint and the trainer's model built "
                "from the same pipeline?"
            )
        with torch.no_grad():
            for key, target in targets.items():
                target.copy_(state_dict[key])
