"""``--loss-type custom_loss``: the user's own hooks, nothing filled in.

One actor group. The converter, prepare and loss hooks are the user's (``--custom-*-path``); a hook that needs the
negative prompt's cond asks for it with ``--encode-negative-prompt``.
"""

import argparse

from miles.methods.base import Method, register_method
from miles.utils.validation import reject

__all__ = ["CustomMethod"]


@register_method
class CustomMethod(Method):
    name = "custom_loss"
    description = "the user's own converter, prepare and loss hooks"

    def validate(self, args: argparse.Namespace) -> None:
        if not (args.custom_prepare_train_batch_path and args.custom_loss_function_path):
            reject(
                "--loss-type custom_loss needs --custom-prepare-train-batch-path and --custom-loss-function-path "
                "(and the converter, --custom-expand-samples-to-train-pairs-path)"
            )
        super().validate(args)
