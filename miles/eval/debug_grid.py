"""The DMD2 debug image: for a few fixed samples, the student's input, the three x̂0 estimates and the gradient.

DMD2's authors answer a collapsing run with "look at x_i, the student's, the teacher's and the fake score's x̂0
and the gradient" (tianweiy/DMD2 issue #33); this draws exactly that, one row per sample, one column per entry of
``columns`` in order, e.g. ``{"x_i": ..., "x0 student": ..., "x0 teacher": ..., "x0 critic": ..., "g": ...}``.

Layout (output pixels; ``cell = max H · scale × max W · scale`` over the columns as drawn)::

    ┌ title band (with titles=True and a title) ─────────────────────────────────────────────┐
    │        ┌ header band: column names (only with titles=True) ──────────────────────────┐ │
    │ label  │ sp │ cell │ sp │ cell │ sp │ ... │ sp │ cell │ ±scale │ sp │   sample 0     │ │
    │ label  │ sp │ cell │ sp │ cell │ sp │ ... │ sp │ cell │ ±scale │ sp │   sample 1 ... │ │
    └ legend band: −max ▮▮▮ +max colour bar, the scale rule, the non-finite colour ─────────┘

The row labels and the legend band appear with ``titles=True`` only (the legend when a signed column is drawn).

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
  covers all its frames. :func:`render_dmd2_debug_frames` draws the same columns as one grid per frame (an
  animation, :func:`save_dmd2_debug_video`).
* Every column is brought to the common cell size by nearest-neighbour upscaling (pixel blocks, no smoothing), so
  a gradient in latent resolution lines up with VAE-decoded images; integer ratios are exact pixel repeats.
"""

import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib import colormaps
from PIL import Image, ImageDraw, ImageFont

__all__ = [
    "render_dmd2_debug_frames",
    "render_dmd2_debug_grid",
    "save_dmd2_debug_grid",
    "save_dmd2_debug_video",
    "COLORMAP",
    "NON_FINITE_RGB",
]

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
    title: str | None = None,
    row_labels: Sequence[str] | None = None,
    legend: bool = True,
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
        titles: draw the header row of column names and each signed row's ``±max |·|``, the ``title``, the
            ``row_labels`` and, when a signed column is drawn, the colour legend below the rows (the colormap from
            ``−max`` through 0 to ``+max``, and the non-finite colour); False draws pixels only.
        spacing: background pixels around and between cells (≥ 0).
        title: a line above the grid (e.g. the rollout and which weights drew the samples); with ``titles``.
        row_labels: N texts (lines split at ``\n``) in a column left of the rows (e.g. the prompt, the stopped step
            and σ); with ``titles``.
        legend: draw the colour legend (with ``titles``, when a signed column is drawn).

    Returns:
        ``PIL.Image`` in mode "RGB". With ``titles=False`` it is exactly
        ``(spacing + len(columns) · (cell_w + spacing)) × (spacing + N · (cell_h + spacing))`` pixels.

    Raises:
        ValueError: naming the column, for a tensor that is not float 4-D or 5-D, a column whose N differs from the
            first column's, or a ``decode`` result that is not uint8 ``(N, H', W', 1 or 3)``; for no columns, N = 0,
            a ``scale`` below 1 / negative ``spacing``, or ``row_labels`` of another length than N.
    """
    if (scale is not None and scale < 1) or spacing < 0:
        raise ValueError(f"scale={scale} must be >= 1 (or None) and spacing={spacing} >= 0")
    tensors = _check_columns(columns)
    rows = len(next(iter(tensors.values())))
    if row_labels is not None and len(row_labels) != rows:
        raise ValueError(f"got {len(row_labels)} row labels for {rows} rows")
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
        row_tops = [header_h + spacing + row * (cell_h + spacing) for row in range(rows)]
        legend = [name for name in drawn if name in signed] if legend else []
        image = _frame(image, font, text_size, spacing, title, row_labels, row_tops, cell_h, legend)
    return image


def _frame(image, font, text_size, spacing, title, row_labels, row_tops, cell_h, legend) -> Image.Image:
    """The grid inside its explanations: the title above, the row labels on the left, the colour legend of the
    signed columns (named in ``legend``) below."""
    line_h = text_size("Ag")[1] + 2
    label_lines = [str(label).split("\n") for label in row_labels or []]
    label_w = max((text_size(line)[0] for lines in label_lines for line in lines), default=0)
    left = label_w + 3 * spacing if label_lines else 0
    top = line_h + 2 * spacing if title else 0
    legend_lines = []
    if legend:
        names = ", ".join(legend)
        legend_lines = [
            f"{names}: mean over channels, each row scaled to its own max |value| (printed right of the cell as ±max)",
            "non-finite values (NaN, inf) in any column",
        ]
    bar_w, bar_h = 160, max(8, line_h - 4)
    legend_h = (bar_h + 3 * line_h + 4 * spacing) if legend else 0
    width = max(
        left + image.width,
        text_size(title)[0] + 2 * spacing if title else 0,
        max((text_size(line)[0] + bar_w // 4 + 3 * spacing for line in legend_lines), default=0),
        bar_w + text_size("+max")[0] + 4 * spacing if legend else 0,
    )
    framed = Image.new("RGB", (width, top + image.height + legend_h), _BACKGROUND)
    framed.paste(image, (left, top))
    draw = ImageDraw.Draw(framed)
    if title:
        _draw_text(draw, title, (spacing, spacing), font)
    for lines, row_top in zip(label_lines, row_tops):
        y = top + row_top + cell_h / 2 - line_h * len(lines) / 2
        for number, line in enumerate(lines):
            _draw_text(draw, line, (spacing, y + number * line_h), font)
    if legend:
        y = top + image.height + spacing
        # The colormap from −max (its blue end) through 0 (its near-white middle) to +max (its red end).
        ramp = colormaps[COLORMAP](np.linspace(0.0, 1.0, bar_w), bytes=True)[:, :3]
        x0 = spacing + text_size("-max")[0] + spacing
        framed.paste(Image.fromarray(np.repeat(ramp[None], bar_h, axis=0)), (x0, y))
        _draw_text(draw, "-max", (spacing, y + bar_h / 2), font, centre_y=True)
        _draw_text(draw, "0", (x0 + bar_w / 2, y + bar_h + 1), font, centre_x=True)
        _draw_text(draw, "+max", (x0 + bar_w + spacing, y + bar_h / 2), font, centre_y=True)
        y += bar_h + line_h + spacing
        _draw_text(draw, legend_lines[0], (spacing, y), font)
        y += line_h
        draw.rectangle((spacing, y + 1, spacing + line_h - 4, y + line_h - 3), fill=NON_FINITE_RGB)
        _draw_text(draw, legend_lines[1], (2 * spacing + line_h - 2, y), font)
    return framed


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


def _frame_of(index: int, frames: int, total: int) -> int:
    """The frame of a column with ``frames`` frames shown at output frame ``index`` of ``total``: a causal video
    VAE's mapping (Wan: latent frame 0 is pixel frame 0, latent frame k ≥ 1 covers pixel frames 4k − 3 … 4k), i.e.
    ``ceil(index · (frames − 1) / (total − 1))``; the frame itself when the counts agree."""
    if frames == total or total == 1:
        return min(index, frames - 1)
    return -(-index * (frames - 1) // (total - 1))


def render_dmd2_debug_frames(
    columns: Mapping[str, torch.Tensor],
    *,
    signed: Collection[str] = frozenset({"g"}),
    decode: Callable[[torch.Tensor], Any] | None = None,
    title: str | None = None,
    **kwargs,
) -> list[Image.Image]:
    """The debug grid of video columns as one grid per frame (the frames of an animation).

    Image columns are decoded once (``decode``: ``(N, C, F', H, W) → uint8 (N, F, H', W', 3 or 1)``), so the
    output has the decoded clip's F frames; a column with fewer frames (the latent-resolution g, or raw latents
    without ``decode``) shows at output frame ``f`` its frame ``ceil(f · (F' − 1) / (F − 1))``, the causal video
    VAE's mapping. Each frame is :func:`render_dmd2_debug_grid` of that frame's 4-D columns (a signed row's scale
    is that frame's), with ``title`` followed by ``frame f of F``.

    Args:
        columns: column name → float ``(N, C, F', H, W)``; as :func:`render_dmd2_debug_grid`.
        signed, decode: as :func:`render_dmd2_debug_grid`.
        title: the line above each frame's grid (``frame f of F`` is added to it).
        kwargs: the other keyword arguments of :func:`render_dmd2_debug_grid` (``scale``, ``titles``,
            ``spacing``, ``row_labels``, ``legend``).

    Returns:
        F RGB PIL images; their sizes may differ by a few pixels (the printed row scales' widths).

    Raises:
        ValueError: for a column that is not 5-D, and as :func:`render_dmd2_debug_grid`.
    """
    tensors = _check_columns(columns)
    for name, tensor in tensors.items():
        if tensor.ndim != 5:
            raise ValueError(f"column {name!r}: a debug video needs (N, C, F, H, W), got {tuple(tensor.shape)}")
    shown: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name in signed or decode is None:
                shown[name] = tensor.float().cpu()
                continue
            images = decode(tensor)
            images = np.asarray(images.detach().cpu().numpy() if hasattr(images, "detach") else images)
            if images.dtype != np.uint8 or images.ndim != 5 or images.shape[-1] not in (1, 3):
                raise ValueError(
                    f"column {name!r}: decode returned {images.dtype} of shape {tuple(images.shape)}, expected uint8 "
                    f"(N, F, H', W', 3 or 1)"
                )
            # uint8 p → p / 127.5 − 1 in [-1, 1], which the grid's pixel rule turns back into p exactly
            shown[name] = torch.from_numpy(images).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
    total = max(tensor.shape[2] for tensor in shown.values())
    frames = []
    for index in range(total):
        frame_columns = {name: t[:, :, _frame_of(index, t.shape[2], total)] for name, t in shown.items()}
        heading = f"{title}; frame {index + 1} of {total}" if title else f"frame {index + 1} of {total}"
        frames.append(render_dmd2_debug_grid(frame_columns, signed=signed, decode=None, title=heading, **kwargs))
    return frames


def save_dmd2_debug_video(
    columns: Mapping[str, torch.Tensor], path: str | os.PathLike, *, fps: int | None = None, **kwargs
) -> Path:
    """Render :func:`render_dmd2_debug_frames` (same keyword arguments) and save the frames as an animated GIF at
    ``path`` (:func:`miles.eval.video.save_animation`; ``fps`` default :data:`miles.eval.video.DEFAULT_FPS`).
    Returns ``path`` as a ``Path``."""
    from miles.eval.video import DEFAULT_FPS, save_animation

    return save_animation(render_dmd2_debug_frames(columns, **kwargs), path, fps=fps or DEFAULT_FPS)
