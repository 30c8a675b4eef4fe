"""Evaluation of generated digits: real data, a reference classifier, metrics, image grids and summaries.

Modules (import them directly; this package imports nothing so that ``import miles.eval.grids`` stays cheap):

* :mod:`miles.eval.digits_data`: the sklearn digits split, prompts and JSONL writer (``write_digits_jsonl``).
* :mod:`miles.eval.classifier`: the cached MLP digits classifier (``load_classifier``, ``features``, ``predict``).
* :mod:`miles.eval.metrics`: ``evaluate_images`` (accuracy, Fréchet distance, precision/recall, spread ratio).
* :mod:`miles.eval.grids`: ``save_digit_grid`` (one labelled row per digit).
* :mod:`miles.eval.report`: ``write_summary`` (markdown + JSON) and ``log_to_wandb``.
"""
