"""uint8 conversion of generated images and pixel-space latents."""

import numpy as np
import pytest
import torch

from miles.eval.images import to_uint8_images


def test_to_uint8_images_conversions():
    pixels = np.arange(2 * 8 * 8, dtype=np.uint8).reshape(2, 8, 8)
    assert to_uint8_images(pixels) is pixels
    latents = torch.from_numpy(pixels.astype(np.float32)[:, None] / 127.5 - 1.0)
    assert np.array_equal(to_uint8_images(latents), pixels)  # exact round trip through [-1, 1]
    clipped = to_uint8_images(np.array([[[[-3.0, 0.0, 2.0]]]]))
    assert clipped.tolist() == [[[0, 128, 255]]]  # (0 + 1) · 127.5 = 127.5 rounds half up
    rgb = to_uint8_images(np.zeros((1, 3, 4, 5), dtype=np.float32))
    assert rgb.shape == (1, 4, 5, 3)
    with pytest.raises(ValueError, match="latents"):
        to_uint8_images(np.zeros((2, 8, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="int64"):
        to_uint8_images(np.zeros((2, 8, 8), dtype=np.int64))
