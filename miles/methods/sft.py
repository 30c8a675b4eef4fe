"""``--loss-type sft_loss``: flow-matching SFT of the student (how the digits teacher is trained).

One actor group; the converter turns data samples (``--train-only``) or full-trajectory rollouts into pairs on their
clean latent, and the SFT hooks regress the velocity (``loss_hub.sft``). With ``--sft-uncond-prob p`` a share p of
the pairs trains on the negative prompt's cond, so the model learns the unconditional velocity CFG needs; the engine
is then told to encode the negative prompt.
"""

import argparse
from typing import Any

from miles.backends.fsdp_utils.loss_hub import sft as sft_loss
from miles.methods.base import Method, fill_defaults, hook_path, require_teacher_consumer
from miles.ray.data_conversion_hub import sft as sft_conversion

__all__ = ["SFTMethod", "SFT_DEFAULT_HOOKS"]

SFT_DEFAULT_HOOKS = {
    "custom_expand_samples_to_train_pairs_path": hook_path(sft_conversion.expand_samples_to_train_pairs),
    "custom_prepare_train_batch_path": hook_path(sft_loss.prepare_sft_batch),
    "custom_loss_function_path": hook_path(sft_loss.sft_loss_formula),
}


class SFTMethod(Method):
    name = "sft_loss"
    description = "flow-matching SFT of the student"

    def set_defaults(self, args: argparse.Namespace) -> None:
        fill_defaults(args, SFT_DEFAULT_HOOKS)
        if args.sft_uncond_prob > 0:
            args.encode_negative_prompt = True

    def validate(self, args: argparse.Namespace) -> None:
        require_teacher_consumer(args, SFT_DEFAULT_HOOKS)

    def export_schedule(self, args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any] | None:
        """An SFT model samples like its source (a teacher: the source's scheduler, untouched)."""
        return None
