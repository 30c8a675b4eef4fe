"""A video family's eval media (:mod:`miles.eval.video`, :func:`miles.eval.debug_grid.render_dmd2_debug_frames`):
the animated eval grid is the PNG grid's tiling of each frame, read back from the GIF pixel for pixel; the debug
video is the debug grid of each frame with the causal VAE's frame mapping; the tracker sends a GIF to wandb as a
video."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from miles.eval.debug_grid import render_dmd2_debug_frames, render_dmd2_debug_grid, save_dmd2_debug_video
from miles.eval.grids import save_image_grid, tile_images
from miles.eval.video import save_animation, save_video_grid
from miles.utils.misc import make_generator
from miles.utils.tracking import MetricsTracker, read_metrics


def _gif_frames(path) -> list[np.ndarray]:
    with Image.open(path) as gif:
        assert gif.format == "GIF"
        return [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(gif)]


def _videos(n: int, frames: int, height: int, width: int) -> np.ndarray:
    """uint8 (N, F, H, W, 3) of 8 grey levels: under GIF's 256-colour palette, so the file keeps them exactly."""
    levels = torch.randint(0, 8, (n, frames, height, width, 1), generator=make_generator("test_video", n, frames))
    return (levels * 32).to(torch.uint8).expand(-1, -1, -1, -1, 3).numpy()


def test_the_animation_is_the_png_grid_of_each_frame(tmp_path):
    videos = _videos(3, 5, 4, 6)
    path = save_video_grid(videos, tmp_path / "eval" / "rollout_1.gif", per_row=2, fps=8)
    frames = _gif_frames(path)
    assert len(frames) == 5
    # default scale: the strip's, 48 // (5 · 6) = 1; 2 per row, 4 px spacing
    for f, frame in enumerate(frames):
        np.testing.assert_array_equal(frame, tile_images(videos[:, f], per_row=2, scale=1))
    assert frames[0].shape == (4 + 2 * (4 + 4), 4 + 2 * (6 + 4), 3)
    with Image.open(path) as gif:
        assert gif.info["duration"] == 120  # 8 fps: 12 hundredths and gif.info["loop"] == 0
    # the PNG frame strip of the same videos: cell i holds its frames side by side
    strip = np.asarray(Image.open(save_image_grid(videos, tmp_path / "strip.png", per_row=2, scale=1)))
    np.testing.assert_array_equal(strip[4:8, 4 : 4 + 30], videos[0].transpose(1, 0, 2, 3).reshape(4, 30, 3))

    with pytest.raises(ValueError, match="N, F, H, W, C"):
        save_video_grid(videos[0], tmp_path / "x.gif")
    with pytest.raises(ValueError, match="fps >= 1"):
        save_animation(videos[0], tmp_path / "x.gif", fps=0)


def test_frames_of_different_sizes_are_padded_to_the_largest():
    small, large = Image.new("RGB", (4, 3), (10, 20, 30)), Image.new("RGB", (6, 5), (200, 0, 0))
    path = save_animation([small, large], Path("/tmp") / f"pad_{id(small)}.gif")
    first, second = _gif_frames(path)
    path.unlink()
    assert first.shape == second.shape == (5, 6, 3)
    assert (first == (10, 20, 30)).all()  # padded with its own corner colour
    assert (second == (200, 0, 0)).all()


def test_the_debug_video_is_the_debug_grid_of_each_frame():
    latents = torch.randn(2, 3, 2, 4, 4, generator=make_generator("test_video", "latents"))  # F' = 2 latent frames
    g = torch.randn(2, 3, 2, 4, 4, generator=make_generator("test_video", "g"))
    decoded = torch.from_numpy(_videos(2, 5, 8, 8))  # a causal VAE's 4·1 + 1 = 5 frames of 8 × 8

    def decode(z):
        assert z.shape == (2, 3, 2, 4, 4)
        return decoded

    columns = {"x0 student": latents, "g": g}
    frames = render_dmd2_debug_frames(columns, signed={"g"}, decode=decode, titles=False, scale=1)
    assert len(frames) == 5
    # pixel frame f shows latent frame ceil(f / 4): 0, 1, 1, 1, 1 (Wan's VAE: latent frame k covers 4k − 3 … 4k)
    for f, latent_frame in enumerate([0, 1, 1, 1, 1]):
        pixels = decoded[:, f].permute(0, 3, 1, 2).float() / 127.5 - 1
        expected = render_dmd2_debug_grid(
            {"x0 student": pixels, "g": g[:, :, latent_frame]}, signed={"g"}, titles=False, scale=1
        )
        np.testing.assert_array_equal(np.asarray(frames[f]), np.asarray(expected))
        # the image column's cells are the decoded frame's pixels exactly (2 px spacing, 8 px cells)
        np.testing.assert_array_equal(np.asarray(frames[f])[2:10, 2:10], decoded[0, f].numpy())

    titled = render_dmd2_debug_frames(columns, signed={"g"}, decode=decode, title="rollout 1")
    assert len(titled) == 5 and titled[0].height > frames[0].height
    with pytest.raises(ValueError, match="column 'x0 student': a debug video needs"):
        render_dmd2_debug_frames({"x0 student": latents[:, :, 0]})


def test_the_debug_video_file_has_one_frame_per_video_frame(tmp_path):
    latents = torch.rand(2, 3, 3, 4, 4, generator=make_generator("test_video", "file")) * 2 - 1
    path = save_dmd2_debug_video({"x_i": latents, "g": latents}, tmp_path / "dmd2_debug_1.gif", signed={"g"})
    assert path == tmp_path / "dmd2_debug_1.gif" and len(_gif_frames(path)) == 3


def test_the_tracker_sends_an_animation_to_wandb_as_a_video(tmp_path, monkeypatch):
    gif = save_video_grid(_videos(2, 3, 4, 4), tmp_path / "rollout_0.gif")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = SimpleNamespace(
        output_dir=str(tmp_path / "wb"), use_wandb=True, wandb_project="miles-test", wandb_mode="offline",
        wandb_run_name=None,
    )  # fmt: skip
    tracker = MetricsTracker(args, job="driver")
    try:
        tracker.log({}, 0, images={"eval/samples_video": gif})
        run_dir = Path(tracker._wandb_run.dir)
    finally:
        tracker.finish()
    assert read_metrics(args.output_dir)[0]["eval/samples_video"] == str(gif)
    assert list((run_dir / "media" / "videos").glob("eval/samples_video_*.gif"))
