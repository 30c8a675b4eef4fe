"""The DMD2 debug grid: exact layout, nearest-neighbour cells, the signed colormap's ends and middle per row, VAE
decoding through the sd3 family's real (tiny) AutoencoderKL, and errors that name the column."""

import numpy as np
import pytest
import torch
from matplotlib import colormaps
from PIL import Image

from miles.eval.debug_grid import COLORMAP, NON_FINITE_RGB, render_dmd2_debug_grid, save_dmd2_debug_grid
from miles.eval.digits.data import load_split
from miles.utils.misc import make_generator

N, SCALE, SPACING = 8, 3, 2
CMAP = colormaps[COLORMAP]
MIDDLE, RED_END, BLUE_END = (tuple(int(v) for v in CMAP(x, bytes=True)[:3]) for x in (0.5, 1.0, 0.0))


@pytest.fixture(scope="module")
def digits():
    """8 real digits as the student's x̂0 would be: float (8, 1, 8, 8) in [-1, 1]."""
    images, _ = load_split("heldout")
    return torch.as_tensor(images[:N], dtype=torch.float32).unsqueeze(1) / 127.5 - 1.0


def _randn(shape, *ids):
    return torch.randn(shape, generator=make_generator("test_debug_grid", *ids))


def _cell(grid: np.ndarray, row: int, column: int, cell: int) -> np.ndarray:
    """The pixels of one cell of a ``titles=False`` grid with square cells of ``cell`` pixels."""
    top, left = SPACING + row * (cell + SPACING), SPACING + column * (cell + SPACING)
    return grid[top : top + cell, left : left + cell]


def _blocks(cell: np.ndarray, block: int) -> np.ndarray:
    """Assert ``cell`` is made of ``block × block`` squares of one colour each; return one pixel per square."""
    small = cell[::block, ::block]
    np.testing.assert_array_equal(cell, small.repeat(block, axis=0).repeat(block, axis=1))
    return small


def test_layout_and_nearest_neighbour_image_cells(digits):
    noise = _randn(digits.shape, "noise")
    columns = {"x_i": 0.5 * digits + 0.5 * noise, "x0 student": digits, "g": _randn(digits.shape, "g")}
    grid = np.asarray(render_dmd2_debug_grid(columns, scale=SCALE, titles=False, spacing=SPACING))
    cell = 8 * SCALE
    assert grid.shape == (SPACING + N * (cell + SPACING), SPACING + 3 * (cell + SPACING), 3)

    expected = np.floor((digits.clamp(-1, 1).double().numpy() + 1) * 127.5 + 0.5).astype(np.uint8)[:, 0]
    for row in range(N):
        small = _blocks(_cell(grid, row, 1, cell), SCALE)
        np.testing.assert_array_equal(small, np.repeat(expected[row][..., None], 3, axis=-1))  # grey → RGB
        _blocks(_cell(grid, row, 0, cell), SCALE)
        _blocks(_cell(grid, row, 2, cell), SCALE)
    # The spacing between cells is background, not image.
    assert (grid[:SPACING] == grid[0, 0]).all() and (grid[:, SPACING + cell : 2 * SPACING + cell] == grid[0, 0]).all()


def test_signed_colours_are_symmetric_per_row():
    g = torch.zeros(3, 2, 2, 2)
    # Row 0: zero everywhere. Row 1: +2 and -2 (mean over the 2 channels), -1 and 0. Row 2: a tiny scale.
    g[1, :, 0, 0] = torch.tensor([3.0, 1.0])  # channel mean +2 = the row's max |g|
    g[1, :, 0, 1] = -2.0
    g[1, :, 1, 0] = -1.0
    g[2, 0, 0, 0], g[2, 1, 0, 0] = 2e-6, 0.0  # mean +1e-6: the red end of its own row
    g[2, :, 1, 1] = -1e-6
    grid = np.asarray(render_dmd2_debug_grid({"g": g}, scale=1, titles=False, spacing=SPACING))
    rows = [_cell(grid, row, 0, 2) for row in range(3)]

    assert (rows[0] == MIDDLE).all()
    assert min(MIDDLE) > 230 and max(MIDDLE) - min(MIDDLE) < 12  # a near-white neutral
    assert tuple(rows[1][0, 0]) == RED_END and RED_END[0] > RED_END[2] + 60
    assert tuple(rows[1][0, 1]) == BLUE_END and BLUE_END[2] > BLUE_END[0] + 60
    assert tuple(rows[1][1, 0]) == tuple(int(v) for v in CMAP(0.25, bytes=True)[:3])
    assert tuple(rows[1][1, 1]) == MIDDLE
    assert tuple(rows[2][0, 0]) == RED_END and tuple(rows[2][1, 1]) == BLUE_END


def test_non_finite_values_are_marked_and_left_out_of_the_scale(digits):
    g = torch.zeros(1, 1, 2, 2)
    g[0, 0, 0, 0], g[0, 0, 0, 1], g[0, 0, 1, 0] = float("nan"), 0.5, float("inf")
    image = digits[:1].clone()
    image[0, 0, 3, 4] = float("nan")
    grid = np.asarray(render_dmd2_debug_grid({"x0": image, "g": g}, scale=1, titles=False, spacing=SPACING))
    g_cell = grid[SPACING : SPACING + 8, 2 * SPACING + 8 : 2 * SPACING + 16]
    block = 4  # the 2×2 gradient is upscaled to the 8×8 image cell
    small = _blocks(g_cell, block)
    assert tuple(small[0, 0]) == NON_FINITE_RGB and tuple(small[1, 0]) == NON_FINITE_RGB
    assert tuple(small[0, 1]) == RED_END and tuple(small[1, 1]) == MIDDLE  # 0.5 is the finite max
    assert tuple(grid[SPACING + 3, SPACING + 4]) == NON_FINITE_RGB


def test_channels_beyond_rgb():
    latents = torch.zeros(2, 16, 4, 4)
    latents[:, 0], latents[:, 1], latents[:, 2], latents[:, 3:] = 1.0, -1.0, 0.0, 1.0  # first 3 channels drawn
    two = torch.zeros(2, 2, 4, 4)
    two[:, 0], two[:, 1] = 1.0, -0.5  # mean 0.25 → grey 159
    grid = np.asarray(render_dmd2_debug_grid({"z": latents, "two": two}, scale=1, titles=False, spacing=SPACING))
    assert tuple(_cell(grid, 0, 0, 4)[0, 0]) == (255, 0, 128)
    assert tuple(_cell(grid, 1, 1, 4)[2, 2]) == (159, 159, 159)


def test_vae_decoded_columns_beside_a_latent_gradient(tmp_path):
    from diffusers import AutoencoderKL

    from miles.models.sd3 import SD3Family

    torch.manual_seed(0)  # weight init only; the assertions compare against the same decoder's own output
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=2,
        sample_size=8,
        scaling_factor=1.5,
        shift_factor=0.1,
    )
    vae.save_pretrained(tmp_path / "pipe" / "vae")
    family = SD3Family(tmp_path / "pipe")
    latents = _randn((4, 4, 4, 4), "latents")  # (N, C, 4, 4) → decoded (N, 8, 8, 3)
    g = _randn((4, 4, 4, 4), "g")
    decoded = family.latents_to_images(latents).numpy()
    assert decoded.shape == (4, 8, 8, 3)

    grid = np.asarray(
        render_dmd2_debug_grid(
            {"x0 student": latents, "g": g}, decode=family.latents_to_images, scale=2, titles=False, spacing=SPACING
        )
    )
    cell = 16  # the decoded 8×8 at scale 2; g's 4×4 latents are upscaled 4× to line up
    assert grid.shape == (SPACING + 4 * (cell + SPACING), SPACING + 2 * (cell + SPACING), 3)
    for row in range(4):
        np.testing.assert_array_equal(_blocks(_cell(grid, row, 0, cell), 2), decoded[row])
        small = _blocks(_cell(grid, row, 1, cell), 4)
        mean = g[row].mean(dim=0).double().numpy()
        expected = CMAP((mean / np.abs(mean).max() + 1) / 2, bytes=True)[..., :3]
        np.testing.assert_array_equal(small, expected)

    with pytest.raises(ValueError, match="column 'x0 student': decode returned"):
        render_dmd2_debug_grid({"x0 student": latents}, decode=lambda z: family.latents_to_images(z).float())


def test_titles_and_save(tmp_path, digits):
    columns = {"x_i": digits, "x0 student": digits, "x0 teacher": digits, "x0 critic": digits}
    columns["g"] = _randn(digits.shape, "g") * 1e-3
    bare = render_dmd2_debug_grid(columns, titles=False)
    titled = render_dmd2_debug_grid(columns)
    assert titled.mode == "RGB" and titled.height > bare.height and titled.width > bare.width
    header = np.asarray(titled)[: titled.height - bare.height]
    assert (header.sum(axis=-1) < 200).any()  # dark ink: the column names

    path = save_dmd2_debug_grid(columns, tmp_path / "eval" / "debug_rollout_3.png")
    assert path == tmp_path / "eval" / "debug_rollout_3.png"
    with Image.open(path) as saved:
        assert saved.format == "PNG"
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(titled))


def test_a_title_row_labels_and_the_colour_legend_frame_the_same_grid(digits):
    columns = {"x0 student": digits, "g": _randn(digits.shape, "g")}
    plain = np.asarray(render_dmd2_debug_grid(columns, legend=False))
    labels = [f"digit {row}\nstopped at step 1/4, sigma 0.90" for row in range(N)]
    framed = np.asarray(render_dmd2_debug_grid(columns, title="rollout 3, live weights", row_labels=labels))
    # The grid itself is unchanged, moved right by the label column and down by the title band, the legend below.
    height, width = plain.shape[:2]
    hits = [
        (top, left)
        for top in range(framed.shape[0] - height + 1)
        for left in range(framed.shape[1] - width + 1)
        if np.array_equal(framed[top : top + height, left : left + width], plain)
    ]
    assert len(hits) == 1
    top, left = hits[0]
    assert top > 0 and left > 0
    assert (framed[:top].sum(axis=-1) < 200).any()  # the title's ink
    assert (framed[top : top + height, :left].sum(axis=-1) < 200).any()  # the row labels' ink
    # The legend below the rows: the colormap's two ends and its middle, and the non-finite colour.
    colours = {tuple(int(v) for v in pixel) for pixel in framed[top + height :].reshape(-1, 3)}
    assert {BLUE_END, RED_END, NON_FINITE_RGB} <= colours
    assert any(np.abs(np.array(colour) - np.array(MIDDLE)).max() <= 2 for colour in colours)
    # No legend without a signed column; labels must match the rows.
    unsigned = np.asarray(render_dmd2_debug_grid({"x0 student": digits}, title="t"))
    assert NON_FINITE_RGB not in {tuple(int(v) for v in pixel) for pixel in unsigned.reshape(-1, 3)}
    with pytest.raises(ValueError, match="got 2 row labels for 8 rows"):
        render_dmd2_debug_grid(columns, row_labels=["a", "b"])


def test_the_debug_rows_are_one_per_distinct_eval_prompt():
    from miles.methods.dmd2_debug import debug_records

    # The digits eval file: each digit's prompt 10 times, sorted by digit; the first 8 records are all zeros.
    records = [{"prompt": f"a handwritten digit {d}", "label": d} for d in range(10) for _ in range(10)]
    assert [r["label"] for r in debug_records(records, "prompt")] == list(range(10))
    assert [r["label"] for r in debug_records(records, "prompt", limit=3)] == [0, 1, 2]


def test_errors_name_the_column(digits):
    with pytest.raises(ValueError, match="column 'g' has 7 samples but column 'x_i' has 8"):
        render_dmd2_debug_grid({"x_i": digits, "g": digits[:7]})
    with pytest.raises(ValueError, match=r"column 'x0 teacher': expected a float tensor \(N, C, H, W\)"):
        render_dmd2_debug_grid({"x_i": digits, "x0 teacher": digits[:, 0]})
    with pytest.raises(ValueError, match="column 'x_i': expected a float tensor"):
        render_dmd2_debug_grid({"x_i": digits.to(torch.uint8)})
    with pytest.raises(ValueError, match="at least one column"):
        render_dmd2_debug_grid({})
    with pytest.raises(ValueError, match="scale=0"):
        render_dmd2_debug_grid({"x_i": digits}, scale=0)


def test_a_video_column_is_the_strip_of_its_frames(digits):
    # (N, C, F, H, W): frame f of sample n is digit (n + f) mod N, so the strip is two digits side by side.
    frames = torch.stack([digits, digits.roll(-1, dims=0)], dim=2)
    g = torch.stack([_randn(digits.shape, "g0"), _randn(digits.shape, "g1")], dim=2)
    video = render_dmd2_debug_grid({"x0": frames, "g": g}, signed={"g"}, scale=SCALE, titles=False, spacing=SPACING)
    strips = {
        "x0": torch.cat([digits, digits.roll(-1, dims=0)], dim=-1),
        "g": torch.cat([g[:, :, 0], g[:, :, 1]], dim=-1),
    }
    image = render_dmd2_debug_grid(strips, signed={"g"}, scale=SCALE, titles=False, spacing=SPACING)
    np.testing.assert_array_equal(np.asarray(video), np.asarray(image))
    assert np.asarray(video).shape[1] == SPACING + 2 * (2 * 8 * SCALE + SPACING)  # cells 2 frames wide

    def decode(latents):  # a video codec: (N, C, F, H, W) → uint8 (N, F, H, W, 1)
        return ((latents.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1)

    decoded = render_dmd2_debug_grid({"x0": frames}, decode=decode, scale=SCALE, titles=False, spacing=SPACING)
    by_strip = render_dmd2_debug_grid(
        {"x0": strips["x0"]}, decode=lambda x: decode(x.unsqueeze(2))[:, 0], scale=SCALE, titles=False, spacing=SPACING
    )
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(by_strip))
