"""PNG digit grids (the labelled grid, rows "0".."9"): layout, exact nearest-neighbour content, row labels, title."""

import numpy as np
import pytest
import torch
from PIL import Image

from miles.eval.digits.data import load_split
from miles.eval.digits.grids import render_digit_grid, save_digit_grid

SCALE, SPACING, LABEL_W, PER_ROW = 6, 2, 20, 4
CELL = 8 * SCALE


def _cell_origin(row, column, title_h=0):
    x0 = SPACING + LABEL_W + SPACING + column * (CELL + SPACING)
    y0 = title_h + SPACING + row * (CELL + SPACING)
    return x0, y0


@pytest.fixture(scope="module")
def digits():
    """30 real digits, 3 per class, in shuffled order (so rows must be gathered by label)."""
    images, labels = load_split("heldout")
    picks = np.concatenate([np.flatnonzero(labels == c)[:3] for c in range(10)])
    order = np.random.default_rng(0).permutation(picks)
    return images[order], labels[order]


def test_grid_layout_and_content(tmp_path, digits):
    images, labels = digits
    path = save_digit_grid(
        images,
        labels,
        tmp_path / "sub" / "grid.png",
        per_row=PER_ROW,
        scale=SCALE,
        spacing=SPACING,
        label_width=LABEL_W,
    )
    assert path == str(tmp_path / "sub" / "grid.png")
    grid_image = Image.open(path)
    assert grid_image.mode == "L"
    assert grid_image.size == (
        SPACING + LABEL_W + SPACING + PER_ROW * (CELL + SPACING),
        SPACING + 10 * (CELL + SPACING),
    )
    grid = np.asarray(grid_image)

    for digit in range(10):
        members = np.flatnonzero(labels == digit)
        for column, index in enumerate(members):
            x0, y0 = _cell_origin(digit, column)
            expected = np.kron(images[index], np.ones((SCALE, SCALE), dtype=np.uint8))
            assert np.array_equal(grid[y0 : y0 + CELL, x0 : x0 + CELL], expected), (digit, column)
        x0, y0 = _cell_origin(digit, 3)  # only 3 images per class: the 4th cell stays background
        assert np.all(grid[y0 : y0 + CELL, x0 : x0 + CELL] == 255)
        label_column = grid[y0 : y0 + CELL, SPACING : SPACING + LABEL_W]
        assert np.count_nonzero(label_column < 128) > 5, f"row label {digit} not drawn"
    # Spacing between rows and between cells is background.
    assert np.all(grid[SPACING + CELL : 2 * SPACING + CELL, 2 * SPACING + LABEL_W :] == 255)
    x_gap = _cell_origin(0, 0)[0] + CELL
    assert np.all(grid[:, x_gap : x_gap + SPACING] == 255)


def test_row_labels_differ(digits):
    images, labels = digits
    grid = np.asarray(
        render_digit_grid(images, labels, per_row=PER_ROW, scale=SCALE, spacing=SPACING, label_width=LABEL_W)
    )
    crops = [
        grid[_cell_origin(d, 0)[1] : _cell_origin(d, 0)[1] + CELL, SPACING : SPACING + LABEL_W] for d in range(10)
    ]
    assert len({crop.tobytes() for crop in crops}) == 10  # ten distinct glyphs, not one repeated mark


def test_title_band_per_row_and_latents(digits):
    images, labels = digits
    latents = torch.from_numpy(images.astype(np.float32)[:, None] / 127.5 - 1.0)
    plain = render_digit_grid(images, labels, per_row=2, scale=SCALE, spacing=SPACING, label_width=LABEL_W)
    titled = render_digit_grid(
        latents, labels, per_row=2, scale=SCALE, spacing=SPACING, label_width=LABEL_W, title="student 4 steps, CFG 3"
    )
    title_h = titled.height - plain.height
    assert title_h > 0
    titled_arr = np.asarray(titled)
    assert np.count_nonzero(titled_arr[:title_h] < 128) > 20  # title text drawn
    # Below the band, the latent-input grid equals the pixel-input grid (exact conversion), cropped to its width.
    assert np.array_equal(titled_arr[title_h:, : plain.width], np.asarray(plain))
    # per_row=2: the third image of each class is dropped.
    assert plain.width == SPACING + LABEL_W + SPACING + 2 * (CELL + SPACING)


def test_rgb_and_errors(tmp_path):
    rgb = np.zeros((10, 8, 8, 3), dtype=np.uint8)
    rgb[..., 0] = 200
    image = render_digit_grid(rgb, np.arange(10), per_row=1, scale=2, spacing=1, label_width=12)
    assert image.mode == "RGB"
    arr = np.asarray(image)
    assert arr[1, 1 + 12 + 1].tolist() == [200, 0, 0]
    with pytest.raises(ValueError, match="0..9"):
        render_digit_grid(rgb, np.arange(1, 11))
    with pytest.raises(ValueError, match="10 images but 9 labels"):
        render_digit_grid(rgb, np.arange(9))
    with pytest.raises(ValueError, match="1 or 3 channels"):
        render_digit_grid(np.zeros((2, 8, 8, 2), dtype=np.uint8), [0, 1])
