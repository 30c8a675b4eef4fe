"""Generic PNG grids: a labelled grid with a caller's own row names, and the unlabelled tiles of save_image_grid."""

import numpy as np
import pytest
import torch
from PIL import Image

from miles.eval.grids import render_labelled_grid, save_image_grid, save_labelled_grid

SCALE, SPACING, LABEL_W = 3, 2, 30
ROW_NAMES = ["cat", "dog", "bird"]


def _images(n, seed, shape=(6, 5)):
    return np.random.default_rng(seed).integers(0, 200, size=(n, *shape), dtype=np.uint8)


def test_labelled_grid_gathers_each_class_into_its_named_row(tmp_path):
    images = _images(7, seed=0)
    labels = np.array([2, 0, 2, 1, 0, 2, 2])
    path = save_labelled_grid(
        images, labels, ROW_NAMES, tmp_path / "a" / "grid.png", per_row=3, scale=SCALE, spacing=SPACING, label_width=30
    )
    grid = np.asarray(Image.open(path))
    cell_h, cell_w = 6 * SCALE, 5 * SCALE
    assert grid.shape == (SPACING + 3 * (cell_h + SPACING), SPACING + LABEL_W + SPACING + 3 * (cell_w + SPACING))
    for row in range(3):
        y0 = SPACING + row * (cell_h + SPACING)
        members = np.flatnonzero(labels == row)
        for column in range(3):
            x0 = SPACING + LABEL_W + SPACING + column * (cell_w + SPACING)
            cell = grid[y0 : y0 + cell_h, x0 : x0 + cell_w]
            if column < len(members):
                assert np.array_equal(cell, np.kron(images[members[column]], np.ones((SCALE, SCALE), np.uint8)))
            else:
                assert np.all(cell == 255)  # fewer images than cells: blank
        assert np.count_nonzero(grid[y0 : y0 + cell_h, SPACING : SPACING + LABEL_W] < 128) > 5, ROW_NAMES[row]
    # "bird" has four images and per_row=3: the fourth (index 6) is not drawn anywhere.
    assert not any(
        np.array_equal(grid[y : y + cell_h, x : x + cell_w], np.kron(images[6], np.ones((SCALE, SCALE), np.uint8)))
        for y in range(grid.shape[0] - cell_h + 1)
        for x in range(grid.shape[1] - cell_w + 1)
    )


def test_labelled_grid_label_column_fits_long_row_names():
    images = _images(2, seed=1, shape=(8, 8))
    names = ["a much longer row name", "b"]
    image = render_labelled_grid(images, [0, 1], names, per_row=1, scale=2, spacing=1)
    # The default label column (max(12, cell_w // 2) = 12 here) widens to the longest name.
    assert image.width > 1 + 12 + 1 + 16 + 1
    short = render_labelled_grid(images, [0, 1], ["a", "b"], per_row=1, scale=2, spacing=1)
    assert short.width == 1 + 12 + 1 + 16 + 1


def test_labelled_grid_errors():
    images = _images(3, seed=2)
    with pytest.raises(ValueError, match="0..2"):
        render_labelled_grid(images, [0, 1, 3], ROW_NAMES)
    with pytest.raises(ValueError, match="at least one row name"):
        render_labelled_grid(images, [0, 0, 0], [])
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        render_labelled_grid(images, [0, 1], ROW_NAMES)


def test_save_image_grid_tiles_in_input_order(tmp_path):
    images = _images(5, seed=3, shape=(4, 4, 3))
    grid = np.asarray(Image.open(save_image_grid(images, tmp_path / "tiles.png", per_row=3, scale=2, spacing=1)))
    assert grid.shape == (1 + 2 * 9, 1 + 3 * 9, 3)
    for i in range(5):
        top, left = 1 + (i // 3) * 9, 1 + (i % 3) * 9
        assert np.array_equal(grid[top : top + 8, left : left + 8], images[i].repeat(2, axis=0).repeat(2, axis=1))
    assert np.all(grid[10:18, 19:27] == 255)  # the sixth cell is empty


def test_save_image_grid_pixel_layout(tmp_path):
    gen = torch.Generator().manual_seed(0)
    rgb = torch.randint(0, 256, (5, 3, 4, 3), dtype=torch.uint8, generator=gen)  # 5 images of 3x4, RGB
    path = save_image_grid(rgb, tmp_path / "nested" / "grid.png", per_row=2, scale=3, spacing=1)
    assert path == str(tmp_path / "nested" / "grid.png")
    grid = np.asarray(Image.open(path))
    cell_h, cell_w = 9, 12
    assert grid.shape == (1 + 3 * (cell_h + 1), 1 + 2 * (cell_w + 1), 3)
    background = np.ones(grid.shape[:2], dtype=bool)
    for i in range(5):
        top, left = 1 + (i // 2) * (cell_h + 1), 1 + (i % 2) * (cell_w + 1)
        upscaled = rgb[i].numpy().repeat(3, axis=0).repeat(3, axis=1)
        assert np.array_equal(grid[top : top + cell_h, left : left + cell_w], upscaled), i
        background[top : top + cell_h, left : left + cell_w] = False
    # Spacing and the empty sixth cell are white.
    assert (grid[background] == 255).all()

    # Grayscale [N, H, W] gives a mode-"L" PNG; the default scale makes 8-pixel digits 48 pixels wide.
    gray = np.arange(2 * 8 * 8, dtype=np.uint8).reshape(2, 8, 8)
    image = Image.open(save_image_grid(gray, tmp_path / "gray.png"))
    assert image.mode == "L" and image.size == (4 + 2 * 52, 4 + 52)
    assert np.array_equal(np.asarray(image)[4:52, 56:104], np.kron(gray[1], np.ones((6, 6), dtype=np.uint8)))
    with pytest.raises(ValueError, match="0 images"):
        save_image_grid(np.zeros((0, 8, 8), dtype=np.uint8), tmp_path / "empty.png")
    with pytest.raises(ValueError, match="per_row=0"):
        save_image_grid(gray, tmp_path / "bad.png", per_row=0)
