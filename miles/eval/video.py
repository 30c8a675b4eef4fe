"""Video output of a video family's evaluation: animated GIFs that wandb shows as ``wandb.Video``.

A video family's samples are uint8 ``(N, F, H, W, C)``; the eval grid and the DMD2 debug grid draw each sample's
frames side by side as a PNG strip (:func:`miles.eval.grids.save_image_grid`,
:func:`miles.eval.debug_grid.render_dmd2_debug_grid`), and beside it this module writes the same layout as an animation:
frame ``f`` of the GIF is the grid of every sample's frame ``f``. GIF is written with Pillow (a dependency already),
so no codec is needed on the training machines; wandb takes the file as it is (``wandb.Video(path)``), and
:meth:`miles.utils.tracking.MetricsTracker.log` sends a ``.gif`` as a video.
"""

import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image

from miles.utils.tracking import VIDEO_MEDIA_SUFFIXES

__all__ = ["DEFAULT_FPS", "VIDEO_SUFFIXES", "save_animation", "save_video_grid"]

logger = logging.getLogger(__name__)

# Wan's own frame rate (WanPipeline's export_to_video(fps=16) in diffusers' examples; Wan 2.1 samples at 16 fps)
DEFAULT_FPS = 16
# Media files the tracker sends to wandb as wandb.Video rather than wandb.Image
VIDEO_SUFFIXES = VIDEO_MEDIA_SUFFIXES


def save_animation(frames: list[Image.Image] | np.ndarray, path: str | os.PathLike, *, fps: int = DEFAULT_FPS) -> Path:
    """Save frames as a looping animated GIF (parents created).

    Args:
        frames: PIL images, or uint8 ``(F, H, W, 3)`` / ``(F, H, W, 1)`` / ``(F, H, W)``. PIL frames of different
            sizes are padded at the right and bottom with the first frame's corner colour to the largest size.
        fps: frames per second (≥ 1); GIF keeps the frame time in hundredths of a second, ``round(100 / fps)``
            of them, so 16 fps plays at 16.7 fps and 8 fps at 8.3.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: for no frames or ``fps`` below 1.
    """
    if fps < 1 or len(frames) == 0:
        raise ValueError(f"save_animation needs frames and fps >= 1, got {len(frames)} frames, {fps=}")
    if isinstance(frames, np.ndarray):
        array = frames[..., 0] if frames.ndim == 4 and frames.shape[-1] == 1 else frames
        frames = [Image.fromarray(np.ascontiguousarray(frame.astype(np.uint8))) for frame in array]
    width = max(frame.width for frame in frames)
    height = max(frame.height for frame in frames)
    if any(frame.size != (width, height) for frame in frames):
        background = frames[0].getpixel((0, 0))
        padded = []
        for frame in frames:
            canvas = Image.new(frame.mode, (width, height), background)
            canvas.paste(frame, (0, 0))
            padded.append(canvas)
        frames = padded
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # disposal 1 keeps each frame whole; optimize=False keeps every frame's pixels as given (the palette is per frame)
    frames[0].save(
        path,
        format="GIF",
        save_all=True,
        append_images=frames[1:],
        duration=10 * max(1, round(100 / fps)),  # GIF keeps hundredths of a second
        loop=0,
        disposal=1,
        optimize=False,
    )
    logger.debug("saved animation %s (%d frames, %dx%d)", path, len(frames), width, height)
    return path


def save_video_grid(
    videos, path: str | os.PathLike, *, per_row: int = 10, scale: int | None = None, fps: int = DEFAULT_FPS
) -> Path:
    """Tile videos as :func:`miles.eval.grids.save_image_grid` tiles images, one tiled grid per frame, and save the
    frames as an animated GIF: frame ``f`` is every sample's frame ``f``, in input order, ``per_row`` to a row.

    Args:
        videos: uint8 ``(N, F, H, W, C)`` (C = 1 or 3), a video family's decoded samples (a tensor or an array).
        per_row: samples per row (≥ 1).
        scale: nearest-neighbour upscaling factor; default the frame-strip PNG's (``max(1, 48 // (F·W))``), so a
            frame is drawn at the size it has in the strip.
        fps: as :func:`save_animation`.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: for anything but 5 axes, no videos, or ``per_row`` below 1.
    """
    from miles.eval.grids import tile_images

    pixels = np.asarray(videos.numpy() if hasattr(videos, "numpy") else videos)
    if pixels.ndim != 5:
        raise ValueError(f"save_video_grid needs uint8 videos (N, F, H, W, C), got shape {pixels.shape}")
    scale = scale or max(1, 48 // (pixels.shape[1] * pixels.shape[3]))
    frames = [tile_images(pixels[:, f], per_row=per_row, scale=scale) for f in range(pixels.shape[1])]
    return save_animation(np.stack(frames), path, fps=fps)
