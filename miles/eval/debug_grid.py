"""The DMD2 debug image: for a few fixed samples, the student's input, the three x̂0 estimates and the gradient.

DMD2's authors answer a collapsing run with "look at x_i, the student's, the teacher's and the fake score's x̂0
and the gradient" (tianweiy/DMD2 issue #33); this draws exactly that, one row per sample, one column per entry of
``columns`` in order, e.g. ``{"x_i": ..., "x0 student": ..., "x0 teacher": ..., "x0 critic": ..., "g": ...}``.

Layout (output pixels; ``cell = max H · scale × max W · scale`` over the columns as drawn)::

    ┌ header band: column names (only with titles=True) ────────────────────────────┐
    │ sp │ cell │ sp │ cell │ sp │ ... │ sp │ cell │ ±scale │ sp │   sample 0
    │ sp │ cell │ sp │ cell │ sp │ ... │ sp │ cell │ ±scale │ sp │   sample 1 ...

* **Image columns** (every column not in ``signed``): with ``decode`` (e.g. a model family's
  ``latents_to_images``, through its VAE) the column is ``decode(latents)``, uint8 ``(N, H', W', 3 or 1)`` or
  ``(N, H', W')``. Without it the tensor is taken as pixels in ``[-1, 1]``, ``uint8 = round((x + 1) · 127.5)``
  after clipping, as :func:`miles.eval.digits_data.to_uint8_images` does: 1 or 3 channels as they are, more than
  3 (raw VAE latents) shown as their first 3 channels in RGB, 2 as their mean in grey.
* **Signed columns** (the DMD2 gradient g): the mean over channels, divided by that row's ``max |·|`` so the row's
  colours are symmetric around 0, through the diverging colormap :data:`COLORMAP` (0 → its near-white middle,
  ``+max`` → its red end, ``−max`` → its blue end). With ``titles=True`` the row's scale ``±max |·|`` is printed
  right of the cell. A row of zeros stays at the middle colour.
* Non-finite values (nan, ±inf) of either kind are drawn in :data:`NON_FINITE_RGB` (magenta), which neither a
  digit nor ``RdBu_r`` contains; they are left out of a signed row's scale.
* **Video** (a 5-D column ``(N, C, F, H, W)``, a video family's latents): each sample's F frames are drawn side by
  side, left to right in time, as one ``H × F·W`` strip (decoded frames likewise); a signed column's row scale
  covers all its frames.
* Every column is brought to the common cell size by nearest-neighbour upscaling (pixel blocks, no smoothing), so
  a gradient in latent resolution lines up with VAE-decoded images; integer ratios are exact pixel repeats.
"""

import logging
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib import colormaps
from PIL import Image, ImageDraw, ImageFont

__all__ = ["render_dmd2_debug_grid", "save_dmd2_debug_grid", "COLORMAP", "NON_FINITE_RGB"]

logger = logging.getLogger(__name__)

COLORMAP = "RdBu_r"  # matplotlib's diverging red (positive) / blue (negative) map
NON_FINITE_RGB = (255, 0, 255)
_BACKGROUND = (200, 200, 200)  # light grey: separates black and white digits and the colormap's white middle
_INK = (0, 0, 0)
_TARGET_CELL = 64  # default scale: small images (digits' 8×8) are drawn about this many pixels wide


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    # Pillow's bundled font, as miles.eval.grids uses: nothing to ship; without FreeType a fixed-size bitmap font.
    return ImageFont.load_default(size=size)


def _check_columns(columns: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    if not columns:
        raise ValueError("render_dmd2_debug_grid needs at least one column")
    checked: dict[str, torch.Tensor] = {}
    first = None
    for name, value in columns.items():
        tensor = torch.as_tensor(value).detach()
        if tensor.ndim not in (4, 5) or not tensor.is_floating_point():
            raise ValueError(
                f"column {name!r}: expected a float tensor (N, C, H, W) or, for video, (N, C, F, H, W), got "
                f"{tensor.dtype} of shape {tuple(tensor.shape)}"
            )
        if first is None:
            first = name
            if tensor.shape[0] == 0:
                raise ValueError(f"column {name!r} has no samples (N = 0)")
        elif tensor.shape[0] != checked[first].shape[0]:
            raise ValueError(
                f"column {name!r} has {tensor.shape[0]} samples but column {first!r} has {checked[first].shape[0]}; "
                "every column needs the same N rows"
            )
        checked[name] = tensor
    return checked


def _frame_strip(tensor: torch.Tensor) -> torch.Tensor:
    """``(N, C, F, H, W)`` → ``(N, C, H, F·W)``, the frames side by side; a 4-D tensor is returned as it is."""
    if tensor.ndim == 4:
        return tensor
    n, c, f, h, w = tensor.shape
    return tensor.permute(0, 1, 3, 2, 4).reshape(n, c, h, f * w)


def _unit_pixels(tensor: torch.Tensor) -> np.ndarray:
    """float ``(N, C, H, W)`` in [-1, 1] → uint8 ``(N, H, W, 3)`` per the module docstring's channel rule."""
    x = tensor.float().cpu()
    channels = x.shape[1]
    if channels == 2:
        x = x.mean(dim=1, keepdim=True)
    elif channels > 3:
        x = x[:, :3]
    x = x.numpy().astype(np.float64)
    bad = ~np.isfinite(x).all(axis=1)
    pixels = np.floor((np.clip(np.nan_to_num(x), -1.0, 1.0) + 1.0) * 127.5 + 0.5).astype(np.uint8)
    pixels = np.moveaxis(pixels, 1, -1)
    if pixels.shape[-1] == 1:
        pixels = np.repeat(pixels, 3, axis=-1)
    pixels[bad] = NON_FINITE_RGB
    return pixels


def _decoded(name: str, tensor: torch.Tensor, decode: Callable[[torch.Tensor], Any]) -> np.ndarray:
    images = decode(tensor)
    if hasattr(images, "detach"):
        images = images.detach().cpu().numpy()
    images = np.asarray(images)
    if images.ndim == 5 and tensor.ndim == 5:
        # decoded video (N, F, H', W', C) → the frames side by side (N, H', F·W', C)
        n, f, h, w, c = images.shape
        images = images.transpose(0, 2, 1, 3, 4).reshape(n, h, f * w, c)
    if images.ndim == 3:
        images = images[..., None]
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3) or len(images) != len(tensor):
        raise ValueError(
            f"column {name!r}: decode returned {images.dtype} of shape {tuple(images.shape)}, expected uint8 "
            f"(N={len(tensor)}, H, W, 3 or 1)"
        )
    return np.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images


def _signed(tensor: torch.Tensor) -> tuple[np.ndarray, list[float]]:
    """float ``(N, C, H, W)`` → uint8 ``(N, H, W, 3)`` colormap pixels and each row's scale ``max |mean_C|``."""
    values = tensor.float().cpu().mean(dim=1).numpy().astype(np.float64)
    finite = np.isfinite(values)
    magnitude = np.where(finite, np.abs(values), 0.0)
    scales = magnitude.reshape(len(values), -1).max(axis=1)
    # A row of zeros divides by 1 instead of 0, so it stays at the middle colour.
    unit = np.where(finite, values, 0.0) / np.where(scales > 0, scales, 1.0)[:, None, None]
    pixels = colormaps[COLORMAP]((unit + 1.0) / 2.0, bytes=True)[..., :3]
    pixels[~finite] = NON_FINITE_RGB
    return pixels, scales.tolist()


def _upscale(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 ``(N, h, w, 3)`` → ``(N, height, width, 3)`` by nearest neighbour."""
    n, h, w, _ = pixels.shape
    if height % h == 0 and width % w == 0:
        return pixels.repeat(height // h, axis=1).repeat(width // w, axis=2)
    return np.stack([np.asarray(Image.fromarray(p).resize((width, height), Image.Resampling.NEAREST)) for p in pixels])


def render_dmd2_debug_grid(
    columns: Mapping[str, torch.Tensor],
    *,
    signed: Collection[str] = frozenset({"g"}),
    decode: Callable[[torch.Tensor], Any] | None = None,
    scale: int | None = None,
    titles: bool = True,
    spacing: int = 2,
) -> Image.Image:
    """Draw the grid (see the module docstring) and return it as an RGB PIL image.

    Args:
        columns: column name → float tensor of shape ``(N, C, H, W)`` or, for video, ``(N, C, F, H, W)`` (any
            float dtype or device), drawn left to right in this order; every column has the same N (one row per
            sample). H and W may differ between columns (latent-resolution g beside decoded images).
        signed: names of the columns drawn as signed heatmaps; names not in ``columns`` are ignored.
        decode: ``latents (N, C, H, W) → uint8 (N, H', W', 3 or 1)`` (video: ``(N, C, F, H, W) → (N, F, H', W',
            3 or 1)``), applied to every image column (not to the signed ones); None reads image columns as pixels
            in ``[-1, 1]``.
        scale: integer nearest-neighbour upscaling factor (≥ 1) of the largest column; default
            ``max(1, 64 // largest side)``. Smaller columns are upscaled further to the same cell size.
        titles: draw the header row of column names and each signed row's ``±max |·|``; False draws pixels only.
        spacing: background pixels around and between cells (≥ 0).

    Returns:
        ``PIL.Image`` in mode "RGB". With ``titles=False`` it is exactly
        ``(spacing + len(columns) · (cell_w + spacing)) × (spacing + N · (cell_h + spacing))`` pixels.

    Raises:
        ValueError: naming the column, for a tensor that is not float 4-D or 5-D, a column whose N differs from the
            first column's, or a ``decode`` result that is not uint8 ``(N, H', W', 1 or 3)``; for no columns, N = 0,
            or a ``scale`` below 1 / negative ``spacing``.
    """
    if (scale is not None and scale < 1) or spacing < 0:
        raise ValueError(f"scale={scale} must be >= 1 (or None) and spacing={spacing} >= 0")
    tensors = _check_columns(columns)
    with torch.no_grad():
        drawn: dict[str, np.ndarray] = {}
        row_scales: dict[str, list[float]] = {}
        for name, tensor in tensors.items():
            if name in signed:
                drawn[name], row_scales[name] = _signed(_frame_strip(tensor))
            elif decode is not None:
                drawn[name] = _decoded(name, tensor, decode)
            else:
                drawn[name] = _unit_pixels(_frame_strip(tensor))

    height = max(pixels.shape[1] for pixels in drawn.values())
    width = max(pixels.shape[2] for pixels in drawn.values())
    scale = scale or max(1, _TARGET_CELL // max(height, width))
    cell_h, cell_w = height * scale, width * scale
    rows = len(next(iter(drawn.values())))

    font = _font(max(8, min(14, cell_h // 3)))
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def text_size(text: str) -> tuple[int, int]:
        left, top, right, bottom = probe.textbbox((0, 0), text, font=font)
        return right - left, bottom - top

    labels = {name: [f"±{s:.2g}" for s in scales] for name, scales in row_scales.items()} if titles else {}
    # Each column's slot: the cell (or its header, if wider), plus a band for the row scales of a signed column.
    label_w = {name: max(text_size(t)[0] for t in texts) + spacing + 2 for name, texts in labels.items()}
    # 4 more pixels than its header text, so that neighbouring names never touch.
    slot_w = {name: max(cell_w, text_size(name)[0] + 4 if titles else 0) + label_w.get(name, 0) for name in drawn}
    header_h = max(text_size(name)[1] for name in drawn) + 2 * spacing + 2 if titles else 0
    canvas_w = spacing + sum(slot_w[name] + spacing for name in drawn)
    canvas_h = header_h + spacing + rows * (cell_h + spacing)
    canvas = np.empty((canvas_h, canvas_w, 3), dtype=np.uint8)
    canvas[:] = _BACKGROUND

    lefts = {}
    x = spacing
    for name, pixels in drawn.items():
        lefts[name] = x + (slot_w[name] - label_w.get(name, 0) - cell_w) // 2
        cells = _upscale(pixels, cell_h, cell_w)
        for row in range(rows):
            top = header_h + spacing + row * (cell_h + spacing)
            canvas[top : top + cell_h, lefts[name] : lefts[name] + cell_w] = cells[row]
        x += slot_w[name] + spacing

    image = Image.fromarray(canvas)
    if titles:
        draw = ImageDraw.Draw(image)
        x = spacing
        for name in drawn:
            _draw_text(draw, name, (x + (slot_w[name] - label_w.get(name, 0)) / 2, spacing + 1), font, centre_x=True)
            for row, text in enumerate(labels.get(name, [])):
                top = header_h + spacing + row * (cell_h + spacing)
                _draw_text(draw, text, (lefts[name] + cell_w + spacing + 1, top + cell_h / 2), font, centre_y=True)
            x += slot_w[name] + spacing
    return image


def _draw_text(draw, text: str, at: tuple[float, float], font, *, centre_x=False, centre_y=False) -> None:
    # Placed by the ink's bounding box rather than ``anchor=``: the bitmap fallback font takes no anchors.
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    x = at[0] - ((right - left) / 2 if centre_x else 0) - left
    y = at[1] - ((bottom - top) / 2 if centre_y else 0) - top
    draw.text((x, y), text, fill=_INK, font=font)


def save_dmd2_debug_grid(columns: Mapping[str, torch.Tensor], path: str | os.PathLike, **kwargs) -> Path:
    """Render the grid (:func:`render_dmd2_debug_grid`, same keyword arguments) and save it as PNG at ``path``.

    Parent directories are created. Returns ``path`` as a ``Path``.
    """
    image = render_dmd2_debug_grid(columns, **kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    logger.debug("saved DMD2 debug grid %s (%dx%d)", path, image.width, image.height)
    return path
