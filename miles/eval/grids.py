"""PNG grids of generated images, upscaled without smoothing: plain tiles, or one labelled row per class.

:func:`save_image_grid` tiles images in input order (the driver's train-time eval grid).
:func:`render_labelled_grid` / :func:`save_labelled_grid` gather the images of each class into one row and write the
row's name in a label column on the left (the digits grid is this with row names "0".."9"). Layout (all sizes in
output pixels; ``cell = H·scale × W·scale``)::

    ┌──────────────── title band (only with a title) ────────────────┐
    │ sp │ label │ sp │ cell │ sp │ cell │ sp │ ... (per_row cells) │ sp
    │ row_names[0]  images whose label is 0, in input order           │
    │ ...                                                               │
    │ row_names[R − 1]                                                  │

Rows are separated by ``spacing`` pixels of background (white). A class with fewer than ``per_row`` images leaves
its remaining cells blank; images beyond ``per_row`` are not drawn.
"""

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from miles.eval.images import to_uint8_images

__all__ = ["eval_grid_path", "render_labelled_grid", "save_labelled_grid", "save_image_grid", "tile_images"]

logger = logging.getLogger(__name__)

_BACKGROUND = 255
_INK = 0


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    # Pillow's bundled default font: no font file to ship or find. With FreeType it scales to ``size``; without it
    # Pillow falls back to its fixed-size bitmap font, which is still legible.
    return ImageFont.load_default(size=size)


def _text_width(font, text: str) -> int:
    left, _, right, _ = font.getbbox(text)
    return int(np.ceil(right - left))


def render_labelled_grid(
    images: Any,
    labels: Any,
    row_names: Sequence[str],
    *,
    per_row: int = 10,
    scale: int = 6,
    spacing: int = 4,
    label_width: int | None = None,
    title: str | None = None,
) -> Image.Image:
    """Draw one row per class and return the grid as a PIL image (mode "L" for grayscale, "RGB" for 3-channel input).

    Args:
        images: uint8 ``[N, H, W]`` or ``[N, H, W, C]`` (C = 1 or 3) pixels 0..255, or float latents
            ``[N, C, H, W]`` in ``[-1, 1]`` (see :func:`miles.eval.images.to_uint8_images`).
        labels: int ``[N]`` class of each image, ``0..len(row_names) − 1``; selects the row.
        row_names: the text of each row's label, e.g. ``["0", ..., "9"]`` or ``["cat", "dog"]`` (≥ 1 name).
        per_row: cells per row (≥ 1).
        scale: integer nearest-neighbour upscaling factor (≥ 1): each pixel becomes a ``scale × scale`` block.
        spacing: background pixels around and between cells (≥ 0).
        label_width: width of the left label column; default ``max(12, cell_width // 2)``, widened to fit the
            widest row name.
        title: optional text drawn in a band above the rows.

    Raises:
        ValueError: on a label outside ``0..len(row_names) − 1``, no row names, a label count that differs from the
            image count, an unsupported channel count, or a non-positive ``per_row`` / ``scale``.
    """
    pixels = to_uint8_images(images)
    if pixels.ndim == 4 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    if pixels.ndim == 4 and pixels.shape[-1] != 3:
        raise ValueError(f"grid images need 1 or 3 channels, got shape {list(pixels.shape)}")
    labels = np.asarray(labels).reshape(-1)
    num_rows = len(row_names)
    if num_rows < 1:
        raise ValueError("a labelled grid needs at least one row name")
    if len(labels) != len(pixels):
        raise ValueError(f"got {len(pixels)} images but {len(labels)} labels")
    if len(labels) and (
        not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() > num_rows - 1
    ):
        raise ValueError(
            f"grid labels must be integers 0..{num_rows - 1} (one per row name), "
            f"got values {sorted(set(labels.tolist()))[:12]}"
        )
    if per_row < 1 or scale < 1 or spacing < 0:
        raise ValueError(f"per_row={per_row} and scale={scale} must be >= 1 and spacing={spacing} >= 0")

    height, width = pixels.shape[1:3]
    cell_h, cell_w = height * scale, width * scale
    font_size = max(8, min(cell_h * 3 // 5, 24))
    font = _font(font_size)
    if label_width is not None:
        label_w = label_width
    else:
        label_w = max(12, cell_w // 2, *(_text_width(font, str(name)) for name in row_names))
    title_h = font_size + 2 * spacing if title else 0
    grid_w = spacing + label_w + spacing + per_row * (cell_w + spacing)
    if title:
        # Widen the canvas (blank on the right) rather than clip a title longer than the rows.
        grid_w = max(grid_w, _text_width(font, title) + 2 * spacing)
    grid_h = title_h + spacing + num_rows * (cell_h + spacing)
    channel_shape = (3,) if pixels.ndim == 4 else ()
    canvas = np.full((grid_h, grid_w, *channel_shape), _BACKGROUND, dtype=np.uint8)

    cells_x0 = spacing + label_w + spacing
    for row in range(num_rows):
        y0 = title_h + spacing + row * (cell_h + spacing)
        for column, index in enumerate(np.flatnonzero(labels == row)[:per_row]):
            x0 = cells_x0 + column * (cell_w + spacing)
            upscaled = np.repeat(np.repeat(pixels[index], scale, axis=0), scale, axis=1)
            canvas[y0 : y0 + cell_h, x0 : x0 + cell_w] = upscaled

    image = Image.fromarray(canvas)  # 2-D → mode "L", [H, W, 3] → "RGB"
    draw = ImageDraw.Draw(image)
    ink = (_INK,) * 3 if channel_shape else _INK
    for row, name in enumerate(row_names):
        center_y = title_h + spacing + row * (cell_h + spacing) + cell_h / 2
        _draw_centered(draw, str(name), (spacing + label_w / 2, center_y), font, ink)
    if title:
        left, top, _, _ = draw.textbbox((0, 0), title, font=font)
        draw.text((spacing - left, spacing - top), title, fill=ink, font=font)
    return image


def _draw_centered(draw: ImageDraw.ImageDraw, text: str, center: tuple[float, float], font, fill) -> None:
    # Centre by the ink bounding box rather than with ``anchor=``: the bitmap fallback font does not take anchors.
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    x = center[0] - (right - left) / 2 - left
    y = center[1] - (bottom - top) / 2 - top
    draw.text((x, y), text, fill=fill, font=font)


def save_labelled_grid(
    images: Any,
    labels: Any,
    row_names: Sequence[str],
    path: str | os.PathLike,
    *,
    per_row: int = 10,
    scale: int = 6,
    spacing: int = 4,
    label_width: int | None = None,
    title: str | None = None,
) -> str:
    """Render the grid (see :func:`render_labelled_grid`) and save it as PNG at ``path`` (parents created).

    Returns:
        ``path`` as a string.
    """
    image = render_labelled_grid(
        images, labels, row_names, per_row=per_row, scale=scale, spacing=spacing, label_width=label_width, title=title
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    logger.debug("saved labelled grid %s (%dx%d)", path, image.width, image.height)
    return str(path)


def tile_images(images: Any, *, per_row: int = 10, scale: int | None = None, spacing: int = 4) -> np.ndarray:
    """The canvas of :func:`save_image_grid`: uint8 ``(H', W', C)`` (``(H', W')`` for one channel).

    Raises:
        ValueError: for an empty batch or a non-positive ``per_row``.
    """
    pixels = np.asarray(images.numpy() if hasattr(images, "numpy") else images)
    if pixels.ndim == 5:
        n, frames, height, width, channels = pixels.shape
        pixels = pixels.transpose(0, 2, 1, 3, 4).reshape(n, height, frames * width, channels)
    if pixels.ndim == 3:
        pixels = pixels[..., None]
    if len(pixels) == 0 or per_row < 1:
        raise ValueError(f"save_image_grid needs images and per_row >= 1, got {len(pixels)} images, {per_row=}")
    n, height, width, channels = pixels.shape
    scale = scale or max(1, 48 // width)
    rows = -(-n // per_row)
    cell_h, cell_w = height * scale, width * scale
    canvas = np.full(
        (spacing + rows * (cell_h + spacing), spacing + min(n, per_row) * (cell_w + spacing), channels),
        _BACKGROUND,
        dtype=np.uint8,
    )
    for i, image in enumerate(pixels.astype(np.uint8)):
        top = spacing + (i // per_row) * (cell_h + spacing)
        left = spacing + (i % per_row) * (cell_w + spacing)
        canvas[top : top + cell_h, left : left + cell_w] = image.repeat(scale, axis=0).repeat(scale, axis=1)
    return canvas[..., 0] if channels == 1 else canvas


def save_image_grid(
    images: Any, path: str | os.PathLike, *, per_row: int = 10, scale: int | None = None, spacing: int = 4
) -> str:
    """Tile any model family's images in input order, ``per_row`` to a row, and save a PNG (parents created).

    The train-time eval grid of ``train_diffusion.py``: unlike :func:`save_labelled_grid` it needs no labels.

    Args:
        images: uint8 ``[N, H, W, C]`` (C = 1 or 3) or ``[N, H, W]``, pixels 0..255; a video family's
            ``[N, F, H, W, C]`` is drawn as one strip of its F frames side by side per cell (the frame strip;
            :func:`miles.eval.video.save_video_grid` writes the same cells as an animation).
        per_row: images per row (≥ 1).
        scale: nearest-neighbour upscaling factor; default makes small images (digits' 8×8) about 48 pixels wide.
        spacing: background pixels around and between cells.

    Returns:
        ``path`` as a string.

    Raises:
        ValueError: for an empty batch or a non-positive ``per_row``.
    """
    canvas = tile_images(images, per_row=per_row, scale=scale, spacing=spacing)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas).save(path, format="PNG")
    return str(path)


def eval_grid_path(args: Any, rollout_id: int) -> Path:
    """``<output-dir>/eval/rollout_<id>.png``: where the driver's train-time evaluation of a rollout puts its grid
    (an eval hook may draw its own there; otherwise the driver tiles the images)."""
    return Path(args.output_dir) / "eval" / f"rollout_{rollout_id}.png"
