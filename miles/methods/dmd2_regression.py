"""``--loss-type dmd2`` with DMD's regression loss (Yin et al. 2024, the first DMD paper): its hooks and checks.

With ``--dmd2-regression-weight w > 0`` and ``--dmd2-regression-pairs PAIRS.jsonl`` (written once, offline, by
``python -m miles.rollout.regression_pairs``: the teacher's ODE sample from each pair's keyed noise), the
RolloutManager deals one pair per generated sample (a side input, like the GAN's real data) and the student's loss
adds ``w · mean((x̂0 − y)²)`` of its one-step output from that noise (:mod:`miles.backends.fsdp_utils.loss_hub.
regression`). With w = 0 (the default) no pair is read and a run is exactly what it was without these flags. The
two flags are fields of :class:`~miles.backends.fsdp_utils.loss_hub.dmd2_types.DMD2Settings`.
"""

import argparse

from miles.backends.fsdp_utils.loss_hub import regression
from miles.backends.fsdp_utils.loss_hub.dmd2_types import DMD2Settings
from miles.config import GroupHooks
from miles.utils.types import SideInput
from miles.utils.validation import reject

__all__ = ["REGRESSION_ACTOR_HOOKS", "regression_side_inputs", "validate_regression_args"]

# The student's prepare and loss hooks with the regression rows (in place of DMD2_ACTOR_HOOKS' two).
REGRESSION_ACTOR_HOOKS = GroupHooks(
    prepare=regression.prepare_generator_regression_batch, loss=regression.dmd2_regression_loss
)


def validate_regression_args(args: argparse.Namespace, settings: DMD2Settings) -> None:
    """Reject regression flags that cannot run (the weight's range is its field's check).

    Raises:
        ArgumentValidationError: one line naming the flags.
    """
    if settings.regression_enabled and not settings.regression_pairs:
        reject(
            "--dmd2-regression-weight > 0 needs --dmd2-regression-pairs (write them once with python -m "
            "miles.rollout.regression_pairs)"
        )
    if settings.regression_pairs and not settings.regression_enabled:
        reject("--dmd2-regression-pairs is read by the regression loss only: set --dmd2-regression-weight > 0")
    if settings.regression_enabled and (args.custom_prepare_train_batch_path or args.custom_loss_function_path):
        # A user's own prepare or loss hook would silently drop the term (or get rows it does not expect).
        reject(
            "--dmd2-regression-weight adds rows to the student's DMD2 prepare and loss hooks; drop "
            "--custom-prepare-train-batch-path / --custom-loss-function-path, or the regression flags"
        )


def regression_side_inputs(settings: DMD2Settings) -> list[SideInput]:
    """The pairs as a side input (one record per generated sample), or none."""
    if not settings.regression_enabled:
        return []
    return [SideInput(regression.REGRESSION_DATA, settings.regression_pairs, "--dmd2-regression-pairs")]
