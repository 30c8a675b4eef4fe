"""The ``qwen_image_edit`` family on a tiny offline ``QwenImageEditPipeline`` (``tests.support.tiny_pipelines``;
saved without a processor, so prompts are encoded text only: the tiny pipeline module says why) at 32 × 32.

The reference latents are the stock pipeline's ``prepare_latents`` image latents, the velocity is the stock
transformer call of ``QwenImageEditPipeline.__call__`` (the reference's tokens after the target's, both shapes in
``img_shapes``, the target's tokens of the output), and the guided velocity's unconditional branch sees the same
reference.
"""

import json

import numpy as np
import pytest
import torch

from miles.models import ImageConditioned, get_model_family, supports
from miles.models.packed_dit import pack_latents, unpack_latents
from miles.models.qwen_image_edit import CONDITION_KEY, QwenImageEditFamily, reference_size
from miles.models.stock_defaults import write_sample_size
from miles.utils.misc import make_generator
from tests.support.tiny_pipelines import write_tiny_qwen_image_edit

SIZE = 32
PROMPTS = ["make it red", "add a hat"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    path = write_tiny_qwen_image_edit(tmp_path_factory.mktemp("qwen_image_edit") / "pipeline")
    write_sample_size(path, (SIZE, SIZE))
    return path


@pytest.fixture(scope="module")
def stock(pipeline):
    from diffusers import QwenImageEditPipeline

    pipe = QwenImageEditPipeline.from_pretrained(pipeline, processor=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _references(count: int, height: int = 24, width: int = 36) -> list[torch.Tensor]:
    """uint8 (H, W, 3) references of a 3:2 aspect ratio: the stock pipeline resizes them to 1248 × 832."""
    generator = make_generator("test_qwen_image_edit", "references", count)
    return [torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8) for _ in range(count)]


def test_the_family_reads_the_edit_pipeline_and_declares_its_reference(pipeline):
    family = get_model_family(pipeline)
    assert isinstance(family, QwenImageEditFamily) and family.name == "qwen_image_edit"
    assert supports(family, ImageConditioned) and family.latent_shape(pipeline) == (4, 4, 4)
    # diffusers' calculate_dimensions(1024²): about a megapixel, multiples of 32, the aspect ratio kept
    assert reference_size(36, 24) == (1248, 832) and reference_size(32, 32) == (1024, 1024)


def test_reference_latents_are_the_stock_pipelines_image_latents(pipeline, stock):
    from PIL import Image

    family = get_model_family(pipeline)
    [reference] = _references(1)
    ours = family.reference_latents([reference])
    assert ours.shape == (1, 4, 104, 156)  # 832 / 8, 1248 / 8
    # QwenImageEditPipeline.__call__ step 3 and prepare_latents: resize, preprocess, VAE mode, normalise, pack
    pil = Image.fromarray(reference.numpy())
    image = stock.image_processor.resize(pil, 832, 1248)
    pixels = stock.image_processor.preprocess(image, 832, 1248).unsqueeze(2)
    _, image_latents = stock.prepare_latents(pixels, 1, 4, SIZE, SIZE, torch.float32, "cpu", None, None)
    torch.testing.assert_close(pack_latents(ours), image_latents, rtol=0, atol=1e-5)


def test_the_velocity_is_the_stock_edit_transformer_call(pipeline, stock):
    family = get_model_family(pipeline)
    encoder = family.load_text_encoder(pipeline)
    cond = family.encode_conditioned(encoder, PROMPTS, _references(2))
    assert set(cond) == {"encoder_hidden_states", "encoder_hidden_states_mask", CONDITION_KEY}
    assert cond[CONDITION_KEY].shape == (2, 4, 104, 156)
    latents = torch.randn(2, 4, 4, 4, generator=make_generator("test_qwen_image_edit", "latents"))
    timestep = torch.tensor([750.0, 250.0])
    denoiser = family.load_denoiser(pipeline)
    with torch.no_grad():
        ours = family.predict_velocity(denoiser, latents, timestep, cond)

        # the stock call: text as the pipeline's encode_prompt gives it (no processor: QwenImagePipeline's text
        # encoding, the batch's own padding), the target's packed tokens, then the reference's
        states, mask = family.prompt_cond(encoder, PROMPTS).values()
        length = int(mask.sum(dim=1).max())
        out = stock.transformer(
            hidden_states=torch.cat([pack_latents(latents), pack_latents(cond[CONDITION_KEY])], dim=1),
            timestep=timestep / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask[:, :length] if not mask[:, :length].all() else None,
            encoder_hidden_states=states[:, :length],
            img_shapes=[[(1, 2, 2), (1, 52, 78)]] * 2,
            return_dict=False,
        )[0]
    stock_v = unpack_latents(out[:, :4], 4, 4)
    torch.testing.assert_close(ours, stock_v, rtol=0, atol=1e-5)
    # the reference matters: another reference changes the velocity
    other = dict(cond, **{CONDITION_KEY: torch.zeros_like(cond[CONDITION_KEY])})
    with torch.no_grad():
        assert not torch.allclose(family.predict_velocity(denoiser, latents, timestep, other), ours, atol=1e-4)


def test_the_unconditional_branch_sees_the_samples_reference(pipeline):
    family = get_model_family(pipeline)
    encoder = family.load_text_encoder(pipeline)
    cond = family.encode_conditioned(encoder, PROMPTS, _references(2))
    negative = family.encode_prompts(encoder, [" ", " "])
    assert CONDITION_KEY not in negative
    denoiser = family.load_denoiser(pipeline)
    latents = torch.randn(2, 4, 4, 4, generator=make_generator("test_qwen_image_edit", "cfg"))
    timestep = torch.tensor([500.0, 500.0])

    def predict(x, t, c):
        return family.predict_velocity(denoiser, x, t, c)

    with torch.no_grad():
        guided = family.guided_velocity(predict, latents, timestep, cond, negative, 3.0, norm_rescale=False)
        v_cond = predict(latents, timestep, cond)
        v_uncond = predict(latents, timestep, {**negative, CONDITION_KEY: cond[CONDITION_KEY]})
    torch.testing.assert_close(guided, v_uncond + 3.0 * (v_cond - v_uncond), rtol=0, atol=1e-5)


def test_a_record_without_a_reference_is_one_line_naming_the_flag(pipeline):
    from miles.config import DataSpec, EngineSpec
    from miles.rollout.conditioning import PromptConditioner

    family = get_model_family(pipeline)
    spec = EngineSpec(family=type(family), pipeline=str(pipeline), converter=None, data=DataSpec(prompt_data=None))
    conditioner = PromptConditioner(spec, family, pipeline)
    with pytest.raises(ValueError, match="record has none under --condition-image-key 'condition_image'"):
        conditioner.cond(["make it red"], [{"prompt": "make it red"}])
    image = _references(1)[0].numpy()
    cond = conditioner.cond(["make it red"], [{"prompt": "make it red", "condition_image": image.tolist()}])
    expected = family.encode_conditioned(conditioner.encoder, ["make it red"], [torch.from_numpy(image)])
    assert set(cond) == set(expected)
    for key in cond:
        torch.testing.assert_close(cond[key], expected[key], rtol=0, atol=0)
    assert json.loads((pipeline / "model_index.json").read_text())["processor"] == [None, None]
    assert np.asarray(image).dtype == np.uint8
