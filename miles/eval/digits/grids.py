"""Digit grids: :mod:`miles.eval.grids`'s labelled grid with one row per digit, labelled "0".."9"."""

import os
from typing import Any

from PIL import Image

from miles.eval.grids import render_labelled_grid, save_labelled_grid

__all__ = ["DIGIT_ROW_NAMES", "render_digit_grid", "save_digit_grid"]

DIGIT_ROW_NAMES = tuple(str(digit) for digit in range(10))


def render_digit_grid(images: Any, labels: Any, **layout: Any) -> Image.Image:
    """``render_labelled_grid(images, labels, DIGIT_ROW_NAMES, **layout)``: row d holds the images labelled d.

    Args:
        images: uint8 ``[N, H, W]`` / ``[N, H, W, C]`` pixels or float latents ``[N, C, H, W]`` in ``[-1, 1]``.
        labels: int ``[N]`` digit of each image, 0..9.
        layout: ``per_row``, ``scale``, ``spacing``, ``label_width``, ``title`` of
            :func:`miles.eval.grids.render_labelled_grid`.

    Raises:
        ValueError: on a label outside 0..9 and the other errors of :func:`~miles.eval.grids.render_labelled_grid`.
    """
    return render_labelled_grid(images, labels, DIGIT_ROW_NAMES, **layout)


def save_digit_grid(images: Any, labels: Any, path: str | os.PathLike, **layout: Any) -> str:
    """Render the digit grid (see :func:`render_digit_grid`) and save it as PNG at ``path``; returns ``path``."""
    return save_labelled_grid(images, labels, DIGIT_ROW_NAMES, path, **layout)
