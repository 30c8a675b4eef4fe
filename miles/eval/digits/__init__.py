"""The digits recipe's evaluation, built on the generic :mod:`miles.eval` modules.

* :mod:`miles.eval.digits.data`: the sklearn digits split, prompts and JSONL writer
  (``python -m miles.eval.digits.data OUT_DIR``).
* :mod:`miles.eval.digits.classifier`: the cached MLP digits classifier whose hidden layer is the feature space.
* :mod:`miles.eval.digits.reward`: DMDR's digits reward (``digit_log_prob``), a logistic regression on the pixels
  that is not the evaluator's classifier.
* :mod:`miles.eval.digits.metrics`: ``evaluate_images`` (accuracy, and the generic figures on classifier features
  against the held-out split), ``evaluate_real_baseline``, ``summary_notes``.
* :mod:`miles.eval.digits.grids`: ``save_digit_grid`` (one labelled row per digit).
* :mod:`miles.eval.digits.hook`: sampling digits pipelines, ``evaluate_pipeline``, ``evaluate_suite`` and the
  train-time ``digits_eval_hook``.

``miles.eval.digits.digits_eval_hook`` (the ``--eval-function-path`` of the recipe) and
``miles.eval.digits.evaluate_suite`` are re-exported from :mod:`~miles.eval.digits.hook`.
"""

import importlib
from typing import Any

__all__ = ["digits_eval_hook", "evaluate_suite"]


def __getattr__(name: str) -> Any:
    # Resolved on first use (PEP 562) rather than imported here: the hook pulls in torch and diffusers through the
    # digits pipeline, which ``python -m miles.eval.digits.data`` and the classifier do not need; and runpy warns
    # when a package's __init__ has already imported the module it is about to run as __main__.
    if name in __all__:
        return getattr(importlib.import_module("miles.eval.digits.hook"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
