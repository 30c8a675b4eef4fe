"""``RolloutEngineWorker``: one dedicated rollout-engine replica (``--rollout-num-gpus N``).

By default the actor group's ranks generate the rollouts on their own FSDP modules. With ``--rollout-num-gpus N``
the rollouts run on N replicas of their own instead, each holding an unsharded copy of the student that the actor
group refreshes after every step (``FSDPTrainRayActor.update_weights``). Replica j generates the shards of DP ranks
``j·D/N .. (j + 1)·D/N − 1`` and converts them to train pairs, one box per DP rank, exactly as an actor rank would.

A plain class; ``miles.ray.engine_group.EngineGroup`` turns it into N Ray actors.
"""

import logging
import time
from typing import Any

import ray
import torch

from miles.models.base import read_scheduler_config
from miles.models.capabilities import decode_latents
from miles.rollout.conditioning import PromptConditioner
from miles.rollout.engine import RolloutEngine, convert_samples, default_device
from miles.utils.log import setup_logging
from miles.utils.misc import load_function
from miles.utils.types import Box, PromptShard, RolloutResult

__all__ = ["RolloutEngineWorker"]

logger = logging.getLogger(__name__)


class RolloutEngineWorker:
    """One engine replica. Construct empty; ``init`` loads the student (so Ray can place the actor first)."""

    def init(self, args: Any, num_threads: int | None = None) -> None:
        """Load the family, the student (``--hf-checkpoint``) on this replica's device, the converter.

        Raises:
            ValueError: on a bad converter or step-strategy path.
        """
        from miles.models import get_model_family

        setup_logging(getattr(args, "log_level", "INFO"), worker=True)
        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.args = args
        self.device = default_device()
        self.family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
        denoiser = self.family.load_denoiser(args.hf_checkpoint, dtype=torch.float32).to(self.device)
        self.engine = RolloutEngine(
            args,
            self.family,
            denoiser,
            PromptConditioner(args, self.family, args.hf_checkpoint, device=self.device),
            self.family.latent_shape(args.hf_checkpoint),
            read_scheduler_config(args.hf_checkpoint)["num_train_timesteps"],
        )
        self.converter = load_function(args.custom_expand_samples_to_train_pairs_path)

    def generate(self, rollout_id: int, shard_boxes: list[Box]) -> list[RolloutResult]:
        """Generate and convert each given DP shard; one ``RolloutResult`` per shard, in order."""
        results = []
        for box in shard_boxes:
            start = time.perf_counter()
            shard: PromptShard = ray.get(box.inner)
            pairs = convert_samples(self.args, self.converter, self.engine.generate(shard))
            seconds = time.perf_counter() - start
            results.append(RolloutResult(Box(ray.put(pairs)), len(pairs), {"perf/engine-generate_time": seconds}))
        return results

    def evaluate(
        self, shard: PromptShard, num_steps: int | None = None, guidance_scale: float | None = None
    ) -> torch.Tensor:
        """Full-trajectory samples of the shard with the replica's current weights: uint8 ``(B, H, W, C)``."""
        latents = self.engine.sample(shard, num_steps=num_steps, guidance_scale=guidance_scale)
        return decode_latents(self.family, latents)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the student's full (unsharded) state dict of CPU tensors.

        Raises:
            RuntimeError: when keys are missing or unexpected (the trainer and the engine hold different models).
        """
        denoiser = self.engine.denoiser
        dtype = next(denoiser.parameters()).dtype
        state_dict = {key: value.to(self.device, dtype) for key, value in state_dict.items()}
        missing, unexpected = denoiser.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise RuntimeError(
                f"update_weights: the student state dict does not match the engine's denoiser (missing "
                f"{missing[:5]}, unexpected {unexpected[:5]}); were --hf-checkpoint and the trainer's model built "
                "from the same pipeline?"
            )
