"""``python -m miles.rollout.encode_images`` on clips: a tiny random ``WanPipeline`` (5 frames of 16 × 32 pixels,
latents ``(4, 2, 2, 4)``) reads video files that the test writes itself with PyAV (lossless FFV1 in Matroska, so
the decoded frames are the written ones bit for bit; and an H.264 MP4, the common lossy format), nothing
downloaded."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from miles.models import get_model_family
from miles.models.stock_defaults import write_sample_size
from miles.rollout.encode_images import encode_image_folder, fit_video, main
from tests.support.tiny_pipelines import write_tiny_wan

av = pytest.importorskip("av", reason="PyAV is the video decoder of miles[video] (in the test extra)")

SIZE = (5, 16, 32)  # frames, height, width


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    path = write_tiny_wan(tmp_path_factory.mktemp("wan") / "wan")
    write_sample_size(path, SIZE)
    return path


def _write_video(path, frames: np.ndarray, codec: str = "ffv1", pix_fmt: str = "bgr0") -> None:
    """uint8 ``(F, H, W, 3)`` RGB frames → a video file at 8 fps."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=8)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = pix_fmt
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def _clip(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def test_clips_encode_to_the_vae_latents_of_their_first_frames(wan, tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    exact = _clip(0, 5, 16, 32)
    longer = _clip(1, 7, 16, 32)  # 7 frames: the first 5 are taken
    wide = _clip(2, 5, 16, 64)  # 64 wide: no resize (16 high covers), the middle 32 columns kept
    _write_video(clips / "a.mkv", exact)
    _write_video(clips / "b.mkv", longer)
    _write_video(clips / "c.mkv", wide)
    (clips / "a.txt").write_text("a clip\n")

    np.testing.assert_array_equal(fit_video(clips / "b.mkv", (*SIZE, 3)), longer[:5])
    np.testing.assert_array_equal(fit_video(clips / "c.mkv", (*SIZE, 3)), wide[:, :, 16:48])
    manifest = encode_image_folder(wan, clips, tmp_path / "out", prompt="a video", batch_size=2)
    assert manifest["image_shape"] == [*SIZE, 3] and manifest["latent_shape"] == [4, 2, 2, 4]
    assert manifest["count"] == 3 and manifest["family"] == "wan"

    records = [json.loads(line) for line in (tmp_path / "out" / "data.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["a clip", "a video", "a video"]
    family = get_model_family(wan)
    expected = family.images_to_latents(torch.from_numpy(np.stack([exact, longer[:5], wide[:, :, 16:48]])))
    # batches of 2 here, one of 3 there: the convolutions round differently by batch size
    for record, latent in zip(records, expected):
        torch.testing.assert_close(
            load_file(tmp_path / "out" / record["latent"])["latent"], latent.float(), rtol=0, atol=1e-5
        )


def test_an_mp4_decodes_close_to_what_was_written(wan, tmp_path):
    # A smooth clip: H.264 in yuv420p is lossy, close on gradients (a noise clip would lose most of its detail).
    ramp = np.linspace(0, 255, 32, dtype=np.float64)
    frames = np.stack([np.stack([np.roll(ramp, 3 * f)[None].repeat(16, 0)] * 3, -1) for f in range(5)])
    frames = frames.astype(np.uint8)
    _write_video(tmp_path / "clip.mp4", frames, codec="libx264", pix_fmt="yuv420p")
    decoded = fit_video(tmp_path / "clip.mp4", (*SIZE, 3))
    assert decoded.shape == (5, 16, 32, 3) and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(int) - frames).mean() < 12


def _error(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_short_small_and_wrong_kind_files_fail_with_one_line(wan, tmp_path, capsys):
    clips = tmp_path / "clips"
    clips.mkdir()
    _write_video(clips / "short.mkv", _clip(0, 3, 16, 32))
    assert "short.mkv has 3 frames, the pipeline's clips have 5" in _error(
        capsys, wan, clips, tmp_path / "o", "--prompt", "x"
    )
    (clips / "short.mkv").unlink()
    _write_video(clips / "small.mkv", _clip(0, 5, 8, 32))
    assert "small.mkv is 32×8 px, smaller than the pipeline's 32×16" in _error(
        capsys, wan, clips, tmp_path / "o", "--prompt", "x"
    )
    (clips / "small.mkv").unlink()
    (clips / "still.png").write_bytes(b"")
    assert "still.png is a still image, but a video family encodes clips" in _error(capsys, wan, clips, tmp_path / "o")
    (clips / "still.png").unlink()
    (clips / "broken.mp4").write_bytes(b"not a video")
    assert "broken.mp4 is not a readable video" in _error(capsys, wan, clips, tmp_path / "o", "--prompt", "x")
    assert not (tmp_path / "o" / "data.jsonl").exists()
