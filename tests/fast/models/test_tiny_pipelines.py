"""The tiny stock pipelines of tests.support.tiny_pipelines open with their stock diffusers class and sample.

For Qwen-Image, FLUX.1-dev, FLUX.1-schnell, FLUX.2-klein and Wan: the builder writes the directory offline, the stock
``XxxPipeline.from_pretrained`` opens it, and two 2-step samples at 32 × 32 (Wan: 5 frames) from the same generator
seed are equal. Each call takes the family's guidance path: Qwen-Image's true CFG with a negative prompt, FLUX.1-dev's
embedded guidance, schnell without guidance, klein-base's CFG against the empty prompt, Wan's CFG. A builder is a
function of its seed: the same seed writes the same files, another seed other weights.
"""

import filecmp
from pathlib import Path

import pytest
import torch

from tests.support.tiny_pipelines import write_tiny_flux, write_tiny_flux2_klein, write_tiny_qwen_image, write_tiny_wan
from tests.support.tiny_pipelines.vocab import QWEN_IMAGE_TEMPLATE_PREFIX

PROMPT = "a red square on a blue field"
# name: (builder, its keyword arguments, stock pipeline class, call keyword arguments, output shape)
CASES = {
    "qwen_image": (
        write_tiny_qwen_image,
        {},
        "QwenImagePipeline",
        {"negative_prompt": " ", "true_cfg_scale": 4.0},
        (1, 3, 32, 32),
    ),
    "flux_dev": (
        write_tiny_flux,
        {"variant": "dev"},
        "FluxPipeline",
        {"guidance_scale": 3.5, "max_sequence_length": 64},
        (1, 3, 32, 32),
    ),
    "flux_schnell": (
        write_tiny_flux,
        {"variant": "schnell"},
        "FluxPipeline",
        {"guidance_scale": 0.0, "max_sequence_length": 64},
        (1, 3, 32, 32),
    ),
    "flux2_klein": (
        write_tiny_flux2_klein,
        {},
        "Flux2KleinPipeline",
        {"guidance_scale": 4.0, "max_sequence_length": 64},
        (1, 3, 32, 32),
    ),
    "wan": (
        write_tiny_wan,
        {},
        "WanPipeline",
        {"guidance_scale": 5.0, "num_frames": 5, "max_sequence_length": 32},
        (1, 5, 3, 32, 32),  # (batch, frames, channels, height, width)
    ),
}


def _sample(pipe, call: dict, seed: int) -> torch.Tensor:
    out = pipe(
        prompt=PROMPT,
        height=32,
        width=32,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
        **call,
    )
    return out.frames if hasattr(out, "frames") else out.images


@pytest.mark.parametrize("name", list(CASES))
def test_stock_pipeline_opens_and_samples_deterministically(name, tmp_path):
    import diffusers

    builder, kwargs, class_name, call, shape = CASES[name]
    folder = builder(tmp_path / name, seed=0, **kwargs)
    pipe = getattr(diffusers, class_name).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    first = _sample(pipe, call, seed=7)
    again = _sample(pipe, call, seed=7)
    assert first.shape == shape and first.dtype == torch.float32
    assert torch.isfinite(first).all() and first.min() >= 0 and first.max() <= 1
    assert first.std() > 0  # a picture, not a constant
    assert torch.equal(first, again)


def test_qwen_image_template_header_is_the_drop_index(tmp_path):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(write_tiny_qwen_image(tmp_path / "qwen", seed=0))
    header = pipe.tokenizer(QWEN_IMAGE_TEMPLATE_PREFIX).input_ids
    # QwenImagePipeline drops this many leading hidden states: exactly the system + user header
    assert len(header) == pipe.prompt_template_encode_start_idx == 34
    assert pipe.prompt_template_encode.startswith(QWEN_IMAGE_TEMPLATE_PREFIX)


def _files(folder: Path) -> list[Path]:
    return sorted(path.relative_to(folder) for path in folder.rglob("*") if path.is_file())


@pytest.mark.parametrize("name", ["qwen_image", "flux_dev", "flux2_klein", "wan"])
def test_builder_is_a_function_of_the_seed(name, tmp_path):
    builder, kwargs, *_ = CASES[name]
    first, again, other = (
        builder(tmp_path / tag, seed=seed, **kwargs) for tag, seed in [("a", 0), ("b", 0), ("c", 1)]
    )
    files = _files(first)
    assert files == _files(again) == _files(other)
    assert all(filecmp.cmp(first / file, again / file, shallow=False) for file in files)
    weights = [file for file in files if file.suffix == ".safetensors"]
    assert len(weights) >= 3  # transformer, VAE, text encoder(s)
    assert not any(filecmp.cmp(first / file, other / file, shallow=False) for file in weights)
