"""``--loss-type dmd2`` with DMD's regression loss (Yin et al. 2024, the first DMD paper): its flags and checks.

With ``--dmd2-regression-weight w > 0`` and ``--dmd2-regression-pairs PAIRS.jsonl`` (written once, offline, by
``python -m miles.rollout.regression_pairs``: the teacher's ODE sample from each pair's keyed noise), the
RolloutManager deals one pair per generated sample (a side input, like the GAN's real data) and the student's loss
adds ``w · mean((x̂0 − y)²)`` of its one-step output from that noise (:mod:`miles.backends.fsdp_utils.loss_hub.
regression`). With w = 0 (the default) no pair is read and a run is exactly what it was without these flags.
"""

import argparse

from miles.backends.fsdp_utils.loss_hub import regression
from miles.methods.base import hook_path
from miles.utils.types import SideInput
from miles.utils.validation import check_number, reject

__all__ = [
    "REGRESSION_ACTOR_HOOKS",
    "add_regression_arguments",
    "regression_enabled",
    "regression_side_inputs",
    "validate_regression_args",
]

# The student's prepare and loss hooks with the regression rows (in place of DMD2_ACTOR_HOOKS' two).
REGRESSION_ACTOR_HOOKS = {
    "custom_prepare_train_batch_path": hook_path(regression.prepare_generator_regression_batch),
    "custom_loss_function_path": hook_path(regression.dmd2_regression_loss),
}


def regression_enabled(args: argparse.Namespace) -> bool:
    """The regression term is on when it has a weight."""
    return args.dmd2_regression_weight > 0


def add_regression_arguments(group) -> None:
    """The regression flags, in the DMD2 argument group."""
    group.add_argument(
        "--dmd2-regression-weight",
        type=float,
        default=0.0,
        help="DMD's regression loss: w of mean((x0 - y)^2) between the student's one-step output from a cached "
        "noise and the teacher's ODE sample y from it (DMD: 0.25 with LPIPS; 0 = off).",
    )
    group.add_argument(
        "--dmd2-regression-pairs",
        type=str,
        default=None,
        help="With --dmd2-regression-weight: the pairs' JSONL, written once by python -m "
        "miles.rollout.regression_pairs TEACHER PROMPTS OUT_DIR (OUT_DIR/pairs.jsonl).",
    )


def validate_regression_args(args: argparse.Namespace) -> None:
    """Reject regression flags that cannot run.

    Raises:
        ArgumentValidationError: one line naming the flags.
    """
    check_number("--dmd2-regression-weight", args.dmd2_regression_weight, low=0)
    if regression_enabled(args) and not args.dmd2_regression_pairs:
        reject(
            "--dmd2-regression-weight > 0 needs --dmd2-regression-pairs (write them once with python -m "
            "miles.rollout.regression_pairs)"
        )
    if args.dmd2_regression_pairs and not regression_enabled(args):
        reject("--dmd2-regression-pairs is read by the regression loss only: set --dmd2-regression-weight > 0")
    if regression_enabled(args):
        hooks = {dest: getattr(args, dest) for dest in REGRESSION_ACTOR_HOOKS}
        if hooks != REGRESSION_ACTOR_HOOKS:
            # A user's own prepare or loss hook would silently drop the term (or get rows it does not expect).
            reject(
                "--dmd2-regression-weight adds rows to the student's DMD2 prepare and loss hooks; drop "
                "--custom-prepare-train-batch-path / --custom-loss-function-path, or the regression flags"
            )


def regression_side_inputs(args: argparse.Namespace) -> list[SideInput]:
    """The pairs as a side input (one record per generated sample), or none."""
    if not regression_enabled(args):
        return []
    return [SideInput(regression.REGRESSION_DATA, args.dmd2_regression_pairs, "--dmd2-regression-pairs")]
