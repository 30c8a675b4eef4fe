"""``--loss-type sft_loss``: flow-matching SFT of the student (how the digits teacher is trained).

One actor group; the converter turns data samples (``--train-only``) or full-trajectory rollouts into pairs on their
clean latent, and the SFT hooks regress the velocity (``loss_hub.sft``). With ``--sft-uncond-prob p`` a share p of
the pairs trains on the negative prompt's cond, so the model learns the unconditional velocity CFG needs; the engine
is then told to encode the negative prompt.
"""

import argparse
from collections.abc import Callable
from typing import Any

from miles.backends.fsdp_utils.loss_hub import sft as sft_loss
from miles.config import GroupHooks
from miles.methods.base import Method, register_method
from miles.ray.data_conversion_hub import sft as sft_conversion

__all__ = ["SFTMethod"]


@register_method
class SFTMethod(Method):
    name = "sft_loss"
    description = "flow-matching SFT of the student"

    def default_hooks(self, args: argparse.Namespace) -> GroupHooks:
        return GroupHooks(prepare=sft_loss.prepare_sft_batch, loss=sft_loss.sft_loss_formula)

    def converter(self, args: argparse.Namespace) -> Callable:
        return sft_conversion.expand_samples_to_train_pairs

    def set_defaults(self, args: argparse.Namespace) -> None:
        if args.sft_uncond_prob > 0:
            args.encode_negative_prompt = True

    def export_schedule(self, args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any] | None:
        """An SFT model samples like its source (a teacher: the source's scheduler, untouched)."""
        return None
