"""``miles.models.diffusers_family.DiffusersFamily``: the one copy of loading, prompts, the VAE, the feature tap and
the memory layout that every stock family (sd3, flux, qwen_image, flux2, wan) inherits, on the tiny pipelines of
``tests/support`` (real diffusers components, random weights).

- the pixel rule is ``VaeImageProcessor.postprocess``'s, and both orders the families used before (clamp then
  round, round then clamp) give the same uint8;
- every family's VAE is frozen, in eval mode, float32, and its images / latents code is the base's;
- the memory layout's tokens per sample are the tokens the blocks see, and the FLOPs counted on the meta device are
  the FLOPs of the real forward on the family's own cond.
"""

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from miles.models import DiffusersFamily, MemoryLayout, PixelCodec, TokenFeatures, get_model_family, supports
from miles.models.diffusers_family import pixels_to_uint8
from miles.models.stock_defaults import write_sample_size

# Small sample sizes: 4 image tokens per frame (Wan: 2 latent frames of 2 × 2 tokens).
SIZES = {"qwen_image": (32, 32), "flux": (32, 32), "flux2": (32, 32), "wan": (5, 32, 32)}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    from tests.support.sd3 import tiny_sd3_pipeline
    from tests.support.tiny_pipelines import (
        write_tiny_flux,
        write_tiny_flux2_klein,
        write_tiny_qwen_image,
        write_tiny_wan,
    )

    root = tmp_path_factory.mktemp("stock")
    paths = {
        "qwen_image": write_tiny_qwen_image(root / "qwen_image"),
        "flux": write_tiny_flux(root / "flux", variant="dev"),
        "flux2": write_tiny_flux2_klein(root / "flux2"),
        "wan": write_tiny_wan(root / "wan"),
    }
    for name, size in SIZES.items():
        write_sample_size(paths[name], size)
    paths["sd3"] = tiny_sd3_pipeline(root / "sd3")[1]
    return paths


def test_the_pixel_rule_is_the_stock_postprocess_whichever_order_the_clamp_took():
    """diffusers' ``VaeImageProcessor.postprocess`` then ``numpy_to_pil``: clamp ``x/2 + 1/2`` to [0, 1], then round
    ``· 255``. FLUX and Qwen-Image clamped before rounding, SD3, FLUX.2, Wan and digits after: the same uint8."""
    from diffusers.image_processor import VaeImageProcessor

    gen = torch.Generator().manual_seed(0)
    values = torch.cat([
        torch.rand(200_000, generator=gen) * 3 - 1.5,  # in and out of range
        (torch.arange(-2, 258) + 0.5) / 127.5 - 1,  # the half-way points between two uint8 levels, and beyond
        torch.tensor([-1.0, 1.0, 0.0, -0.0, 1e-8, -1e-8, 1 - 2**-24, -1 + 2**-24, 1e30, -1e30]),
    ])  # fmt: skip
    values = torch.cat([values, torch.zeros(-len(values) % 6)])
    pixels = values.view(-1, 3, 1, 2)  # (B, C, H, W)
    ours = pixels_to_uint8(pixels)
    processor = VaeImageProcessor()
    stock = np.stack([np.asarray(image) for image in processor.numpy_to_pil(processor.postprocess(pixels, "np"))])
    assert np.array_equal(ours.numpy(), stock)
    clamp_then_round = ((pixels.clamp(-1, 1) + 1) / 2 * 255).round()
    round_then_clamp = ((pixels + 1) / 2 * 255).round().clamp(0, 255)
    for old in (clamp_then_round, round_then_clamp):
        assert torch.equal(ours, old.to(torch.uint8).movedim(1, -1))


@pytest.mark.parametrize("name", ["sd3", "qwen_image", "flux", "flux2", "wan"])
def test_every_family_has_one_frozen_vae_and_the_bases_codec(pipelines, name):
    family = get_model_family(pipelines[name])
    assert family.name == name and isinstance(family, DiffusersFamily)
    assert supports(family, PixelCodec) and supports(family, TokenFeatures) and supports(family, MemoryLayout)
    # one copy: the pixels <-> latents code is the base's (FLUX.2 declares its normalisation only)
    for method in ("images_to_latents", "latents_to_images", "latents_to_pixels"):
        assert getattr(type(family), method) is getattr(DiffusersFamily, method)
    vae = family.vae
    assert not vae.training and not any(param.requires_grad for param in vae.parameters())
    assert {param.dtype for param in vae.parameters()} == {torch.float32}
    shape = family.image_shape(pipelines[name])
    images = torch.randint(0, 256, (2, *shape), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    latents = family.images_to_latents(images)
    assert latents.shape == (2, *family.latent_shape(pipelines[name])) and latents.dtype == torch.float32
    decoded = family.latents_to_images(latents)
    assert decoded.shape == images.shape and decoded.dtype == torch.uint8
    torch.testing.assert_close(family.normalize_latents(family.denormalize_latents(latents)), latents)


@pytest.mark.parametrize("name", ["sd3", "qwen_image", "flux", "flux2", "wan"])
def test_the_memory_layout_counts_the_tokens_and_flops_of_the_real_forward(pipelines, name):
    """The planner's tokens per sample are what a middle block outputs (image) and what the cond holds (text); the
    FLOPs counted on the meta device are those of the real forward on the family's own encoded prompt."""
    path = pipelines[name]
    family = get_model_family(path)
    image_tokens, text_tokens = family.tokens_per_sample(path)
    denoiser = family.load_denoiser(path)
    cond = family.encode_prompts(family.load_text_encoder(path), ["a cat on a hill"])
    assert cond["encoder_hidden_states"].shape[1] == text_tokens
    if "encoder_hidden_states_mask" in cond:
        # Qwen-Image's forward cuts the text to the batch's longest prompt; the count takes the 512-token bound.
        cond["encoder_hidden_states_mask"] = torch.ones_like(cond["encoder_hidden_states_mask"])
    block = family.blocks(denoiser)[0]
    seen = []
    handle = block.register_forward_hook(lambda module, args, output: seen.append(family.image_tokens(output)))
    latents = torch.randn(1, *family.latent_shape(path), generator=torch.Generator().manual_seed(2))
    # The math attention kernel is counted by its matmuls; the CPU's fused kernel is not counted at all.
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        family.predict_velocity(denoiser, latents, torch.full((1,), 500.0), cond)
    handle.remove()
    assert seen[0].shape[1] == image_tokens > 0
    flops, parameters = family.flops_per_sample(path)
    assert flops == counter.get_total_flops() > 0
    assert parameters == sum(param.numel() for param in denoiser.parameters())
