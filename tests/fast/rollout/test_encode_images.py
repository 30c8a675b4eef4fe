"""``python -m miles.rollout.encode_images`` on the tiny SD3 + T5 pipeline (pixel size 16: sample size 8, VAE factor
2), with crops of scikit-learn's two sample photos (real JPEGs) saved as png, jpg and webp."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from sklearn.datasets import load_sample_images

from miles.driver.arguments import parse_args
from miles.models import get_model_family
from miles.rollout.data_source import load_record_latent
from miles.rollout.encode_images import encode_image_folder, fit_image, main
from tests.support.sd3_t5 import PIXEL_SIZE, tiny_sd3_t5_pipeline

SHAPE = (PIXEL_SIZE, PIXEL_SIZE, 3)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return tiny_sd3_t5_pipeline(tmp_path_factory.mktemp("sd3"))


@pytest.fixture()
def folder(tmp_path):
    """Four photos of other sizes and formats; captions from a sidecar, the captions file and --prompt."""
    china, flower = load_sample_images().images  # (427, 640, 3) uint8 each
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(china[100:140, 200:264]).save(images / "wide.png")  # 64×40: resize to 26×16, crop
    Image.fromarray(flower[50:98, 300:330]).save(images / "tall.jpg", quality=95)  # 30×48
    Image.fromarray(flower[200:216, 200:216]).save(images / "exact.webp", lossless=True)  # 16×16: no resize
    Image.fromarray(china[:300, :300]).save(images / "big.png")
    (images / "wide.txt").write_text("a pagoda behind trees\n")
    (images / "notes.md").write_text("not an image")
    captions = tmp_path / "captions.jsonl"
    captions.write_text(
        json.dumps({"file_name": "tall.jpg", "prompt": "a pink flower"})
        + "\n"
        + json.dumps({"file_name": "exact.webp", "prompt": "petals"})
        + "\n"
    )
    return images, captions


def _by_hand(path) -> np.ndarray:
    """Resize the shorter side to 16 px (Lanczos), centre-crop 16 × 16: the command's fitting, written out."""
    image = Image.open(path).convert("RGB")
    w, h = image.size
    scale = PIXEL_SIZE / min(w, h)
    size = (round(w * scale), round(h * scale))
    if size != (w, h):
        image = image.resize(size, Image.Resampling.LANCZOS)
    left, top = (size[0] - PIXEL_SIZE) // 2, (size[1] - PIXEL_SIZE) // 2
    return np.asarray(image.crop((left, top, left + PIXEL_SIZE, top + PIXEL_SIZE)))


def test_latents_are_the_vae_latents_of_the_fitted_images(pipeline, folder, tmp_path):
    images, captions = folder
    out = tmp_path / "out"
    manifest = encode_image_folder(pipeline, images, out, captions=captions, prompt="a photo")
    family = get_model_family(pipeline)
    assert family.image_shape(pipeline) == SHAPE and manifest["latent_shape"] == [4, 8, 8]
    records = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    names = ["big.png", "exact.webp", "tall.jpg", "wide.png"]  # sorted by name
    assert [r["file_name"] for r in records] == names and manifest["count"] == 4
    assert [r["prompt"] for r in records] == ["a photo", "petals", "a pink flower", "a pagoda behind trees"]
    assert all(r["latent"] == f"latents/{name.rsplit('.', 1)[0]}.safetensors" for r, name in zip(records, names))

    pixels = [fit_image(images / name, SHAPE) for name in names]
    for name, fitted in zip(names, pixels):
        assert fitted.shape == SHAPE and np.array_equal(fitted, _by_hand(images / name)), name
    assert np.array_equal(pixels[1], np.asarray(Image.open(images / "exact.webp").convert("RGB")))
    expected = family.images_to_latents(torch.from_numpy(np.stack(pixels)))  # one batch, as the command ran
    args = parse_args(
        ["--train-only", "--loss-type", "sft_loss", "--hf-checkpoint", str(pipeline)]
        + ["--prompt-data", str(out / "data.jsonl"), "--num-rollout", "1", "--rollout-batch-size", "4"]
    )
    for row, record in enumerate(records):
        stored = load_file(str(out / record["latent"]))
        assert list(stored) == ["latent"] and stored["latent"].dtype == torch.float32
        assert torch.equal(stored["latent"], expected[row])
        latent = load_record_latent(args, family, record, out, expected_shape=(4, 8, 8), where="test")
        assert torch.equal(latent, expected[row])
    # the sd3 latent is the VAE posterior mode with the pipeline's shift and scaling factors (0.1, 1.5); a batch of
    # one runs other conv kernels than the batch of four, hence the 1e-5
    with torch.no_grad():
        x = torch.from_numpy(pixels[0]).permute(2, 0, 1)[None].float() / 255 * 2 - 1
        mode = family.vae.encode(x).latent_dist.mode()
    torch.testing.assert_close(expected[:1], (mode - 0.1) * 1.5, rtol=0, atol=1e-5)


def test_a_captions_lines_other_keys_go_into_its_images_record(pipeline, folder, tmp_path):
    # An edit family's real data: each target image's record names its reference image for the prompt cache.
    images, _ = folder
    captions = tmp_path / "edits.jsonl"
    lines = [
        {"file_name": "tall.jpg", "prompt": "make it pink", "condition_image": "/refs/tall.png", "latent": "no"},
        {"file_name": "exact.webp", "prompt": "petals"},
    ]
    captions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    encode_image_folder(pipeline, images, out, captions=captions, prompt="a photo")
    records = {r["file_name"]: r for r in map(json.loads, (out / "data.jsonl").read_text().splitlines())}
    # the command's own keys win over a captions key of the same name
    assert records["tall.jpg"] == {"prompt": "make it pink", "latent": "latents/tall.safetensors",
                                   "file_name": "tall.jpg", "condition_image": "/refs/tall.png"}  # fmt: skip
    assert "condition_image" not in records["exact.webp"] and "condition_image" not in records["big.png"]


def _error(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_small_images_and_missing_captions_fail_with_one_line(pipeline, folder, tmp_path, capsys):
    images, captions = folder
    out = tmp_path / "out"
    err = _error(capsys, pipeline, images, out, "--captions", captions)
    assert (
        f"image {images / 'big.png'} has no caption: add big.txt beside it, a line in --captions, or pass --prompt"
        in err
    )
    Image.fromarray(np.zeros((12, 30, 3), np.uint8)).save(images / "small.png")
    err = _error(capsys, pipeline, images, out, "--prompt", "x")
    assert f"image {images / 'small.png'} is 30×12 px, smaller than the pipeline's 16×16" in err
    assert not (out / "data.jsonl").exists()
    (images / "small.png").unlink()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"file_name": "big.png"}\n')
    assert f'{bad}:1 must be {{"file_name": "<image file>", "prompt": "<text>"}}' in _error(
        capsys, pipeline, images, out, "--captions", bad
    )
    assert "holds no .png/.jpg/.jpeg/.webp file" in _error(capsys, pipeline, tmp_path, out, "--prompt", "x")
    assert "pipeline directory" in _error(capsys, tmp_path / "nope", images, out, "--prompt", "x")
    assert main([str(pipeline), str(images), str(out), "--prompt", "x", "--batch-size", "3"]) == 0
    assert "--train-only --prompt-data" in capsys.readouterr().out
    assert len((out / "data.jsonl").read_text().splitlines()) == 4


def test_a_digits_folder_encodes_to_its_pixel_latents(tmp_path):
    from sklearn.datasets import load_digits

    from tests.support.trainer import make_pipeline

    pipeline = make_pipeline(tmp_path / "digits")
    digits = load_digits()
    images = tmp_path / "images"
    images.mkdir()
    pixels = np.floor(digits.images[:3] * (255.0 / 16.0) + 0.5).astype(np.uint8)  # (3, 8, 8) in 0..255
    for i, image in enumerate(pixels):
        Image.fromarray(image).save(images / f"digit{i}.png")
        (images / f"digit{i}.txt").write_text(f"a handwritten digit {digits.target[i]}")
    encode_image_folder(pipeline, images, tmp_path / "out")
    family = get_model_family(pipeline)
    assert family.image_shape(pipeline) == (8, 8, 1)
    expected = family.images_to_latents(torch.from_numpy(pixels))  # (3, 1, 8, 8) in [-1, 1]
    records = [json.loads(line) for line in (tmp_path / "out" / "data.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == [f"a handwritten digit {d}" for d in digits.target[:3]]
    for row, record in enumerate(records):
        assert torch.equal(load_file(str(tmp_path / "out" / record["latent"]))["latent"], expected[row])


def test_a_prompt_cache_written_beside_the_latents_carries_both(pipeline, folder, tmp_path):
    """docs/sd3.md: run the prompt cache on data.jsonl into the same directory; each record then names its latent
    and its cond, both relative to prompts.jsonl."""
    from miles.rollout.conditioning import load_cond_file
    from miles.rollout.prompt_cache import write_prompt_cache

    images, captions = folder
    out = tmp_path / "out"
    encode_image_folder(pipeline, images, out, captions=captions, prompt="a photo")
    write_prompt_cache(pipeline, out / "data.jsonl", out)
    records = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    family = get_model_family(pipeline)
    args = parse_args(
        ["--train-only", "--loss-type", "sft_loss", "--hf-checkpoint", str(pipeline)]
        + ["--prompt-data", str(out / "prompts.jsonl"), "--num-rollout", "1", "--rollout-batch-size", "4"]
    )
    for record in records:
        assert load_record_latent(args, family, record, out, expected_shape=(4, 8, 8)).shape == (4, 8, 8)
        assert set(load_cond_file(out / record["cond"])) == {"encoder_hidden_states", "pooled_projections"}
