"""Generated images as uint8 pixels: the one conversion every evaluation module uses before drawing or scoring."""

from typing import Any

import numpy as np

__all__ = ["to_uint8_images"]


def to_uint8_images(images: Any) -> np.ndarray:
    """Convert generated images or pixel-space latents to uint8 pixel images, channels last.

    Accepted inputs (numpy arrays or torch tensors; torch tensors are detached and moved to the CPU):

    * uint8 ``[N, H, W]`` or ``[N, H, W, C]``: pixel images 0..255, returned unchanged (as numpy).
    * floating ``[N, C, H, W]``: pixels scaled to ``[-1, 1]``, channels first (a pixel-space family's latents such
      as the digits family's, or decoded images in the VAE's output range). Converted with
      ``uint8 = floor((x + 1) · 127.5 + 0.5)`` (round half up) after clipping to ``[-1, 1]``, and moved to channels
      last: ``[N, H, W]`` when C = 1, else ``[N, H, W, C]``.

    Raises:
        ValueError: for any other dtype or rank (e.g. float pixel images in 0..255: convert them to uint8 first).
    """
    if hasattr(images, "detach"):
        images = images.detach().cpu().numpy()
    array = np.asarray(images)
    if array.dtype == np.uint8:
        if array.ndim not in (3, 4):
            raise ValueError(f"uint8 images must have shape [N, H, W] or [N, H, W, C], got {list(array.shape)}")
        return array
    if np.issubdtype(array.dtype, np.floating):
        if array.ndim != 4:
            raise ValueError(
                f"float input must be latents [N, C, H, W] in [-1, 1], got shape {list(array.shape)}; "
                "pass pixel images as uint8 [N, H, W] or [N, H, W, C] instead"
            )
        pixels = np.floor((np.clip(array.astype(np.float64), -1.0, 1.0) + 1.0) * 127.5 + 0.5).astype(np.uint8)
        pixels = np.moveaxis(pixels, 1, -1)
        return pixels[..., 0] if pixels.shape[-1] == 1 else pixels
    raise ValueError(f"images of dtype {array.dtype} are not supported; pass uint8 pixels or float latents in [-1, 1]")
