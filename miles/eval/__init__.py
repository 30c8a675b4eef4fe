"""Evaluation of generated images: generic figures, grids and reports, and the digits evaluation built from them.

Generic modules (they import only :mod:`miles.utils` and third-party libraries, so a user's own evaluation can use
them on any model family's images and any feature extractor):

* :mod:`miles.eval.metrics`: ``frechet_distance``, ``precision_recall``, ``spread_ratio`` and ``feature_figures`` on
  feature arrays the caller computes.
* :mod:`miles.eval.grids`: ``save_image_grid`` (tiles in input order) and ``save_labelled_grid`` (one named row per
  class).
* :mod:`miles.eval.report`: ``write_summary`` (markdown + JSON) and ``log_to_wandb``.
* :mod:`miles.eval.images`: ``to_uint8_images``, latents in ``[-1, 1]`` or pixels to uint8.
* :mod:`miles.eval.video`: ``save_video_grid`` and ``save_animation``, a video family's samples as animated GIFs.

:mod:`miles.eval.digits` is the digits recipe's evaluation (its data split, classifier, figures and the
``--eval-function-path`` hook). Import the modules directly; this package imports nothing so that
``import miles.eval.grids`` stays cheap.
"""
