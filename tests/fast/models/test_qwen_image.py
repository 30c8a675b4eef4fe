"""The ``qwen_image`` family on the tiny offline ``QwenImagePipeline`` (``tests.support.tiny_pipelines``) at 32 × 32.

Prompts, latents and the flow shift are checked against the stock pipeline's own code; one DMD2 phase-2 run (2 CPU
ranks, 2 rollouts, GAN head on real latents from ``encode_images``, EMA, prompt cache, resume) trains a student whose
export the stock ``QwenImagePipeline`` samples as miles does (``tests.support.family_e2e``).
"""

import json
import math

import numpy as np
import pytest
import torch

from miles.models import get_model_family
from miles.models.packed_dit import pack_latents, unpack_latents
from miles.models.qwen_image import TEXT_TOKENS, QwenImageFamily
from miles.models.sampling_schedule import stock_sampling_kwargs
from miles.utils.sampling import FlowNoiseSchedule
from tests.support import family_e2e
from tests.support.family_e2e import LATENT, PROMPTS, SIZE
from tests.support.tiny_pipelines import write_tiny_qwen_image
from tests.support.tiny_pipelines.qwen_image import SCHEDULER_CONFIG, TEXT_HIDDEN

TEACHER_GUIDANCE = 4.0  # examples/qwen_image/run_dmd2.sh's --dmd2-teacher-guidance-scale, which the fixture trains


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    path = write_tiny_qwen_image(tmp_path_factory.mktemp("qwen_image") / "pipeline")
    from miles.models.stock_defaults import write_sample_size

    write_sample_size(path, (SIZE, SIZE))
    return path


@pytest.fixture(scope="module")
def stock(pipeline):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(pipeline)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_family_reads_the_pipeline_and_its_sample_size(pipeline, stock):
    family = get_model_family(pipeline)
    assert isinstance(family, QwenImageFamily)
    assert family.latent_shape(pipeline) == LATENT[1:] and family.image_shape(pipeline) == (SIZE, SIZE, 3)
    assert family.text_tokens(pipeline) == TEXT_TOKENS
    assert family.compatibility_signature(pipeline)["text-encoder width (joint_attention_dim)"] == TEXT_HIDDEN
    assert len(family.blocks(stock.transformer)) == 2


def test_prompts_are_encoded_as_the_stock_pipeline_encodes_them(pipeline, stock):
    family = get_model_family(pipeline)
    cond = family.encode_prompts(family.load_text_encoder(pipeline), PROMPTS)
    states, mask = stock.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
    length = states.shape[1]
    assert cond["encoder_hidden_states"].shape == (4, TEXT_TOKENS, TEXT_HIDDEN)
    # the batch's own encoding (same weights, same batch), then zeros; its 0/1 mask, then zeros
    assert torch.equal(cond["encoder_hidden_states"][:, :length], states)
    assert not cond["encoder_hidden_states"][:, length:].any()
    assert torch.equal(cond["encoder_hidden_states_mask"][:, :length], mask.float())
    assert not cond["encoder_hidden_states_mask"][:, length:].any()
    assert mask.sum(dim=1).tolist() != [length] * 4  # the prompts differ in length: the mask matters
    # one prompt alone is its batch row, to rounding
    alone = family.encode_prompts(family.load_text_encoder(pipeline), PROMPTS[1:2])
    torch.testing.assert_close(alone["encoder_hidden_states"][0], cond["encoder_hidden_states"][1], atol=1e-5, rtol=0)


def test_the_velocity_on_padded_prompts_is_the_stock_forward_on_the_batch(pipeline, stock):
    """Padding to 512 changes nothing: the family cuts the batch to its longest prompt, as the pipeline pads."""
    family = get_model_family(pipeline)
    cond = family.encode_prompts(family.load_text_encoder(pipeline), PROMPTS)
    states, mask = stock.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
    latents = torch.randn(LATENT, generator=torch.Generator().manual_seed(3))
    timestep = torch.tensor([900.0, 700.0, 300.0, 20.0])
    ours = family.predict_velocity(stock.transformer, latents, timestep, cond)
    with torch.no_grad():
        theirs = stock.transformer(
            hidden_states=pack_latents(latents),
            timestep=timestep / 1000,
            encoder_hidden_states=states,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, LATENT[2] // 2, LATENT[3] // 2)]] * 4,
            return_dict=False,
        )[0]
    torch.testing.assert_close(ours, unpack_latents(theirs, LATENT[2], LATENT[3]), atol=1e-6, rtol=0)


def test_the_unused_parameters_are_exactly_those_without_a_gradient(pipeline):
    family = get_model_family(pipeline)
    denoiser = family.load_denoiser(pipeline).train().requires_grad_(True)
    cond = family.encode_prompts(family.load_text_encoder(pipeline), PROMPTS)
    latents = torch.randn(LATENT, generator=torch.Generator().manual_seed(4))
    family.predict_velocity(denoiser, latents, torch.full((4,), 500.0), cond).square().sum().backward()
    no_grad = [name for name, param in denoiser.named_parameters() if param.grad is None]
    assert (
        family.unused_parameters(denoiser) == no_grad and len(no_grad) == 6
    )  # to_add_out, txt_mlp (2 layers): weight, bias


def test_latents_decode_as_the_stock_pipeline_decodes_and_encode_as_its_img2img(pipeline, stock):
    from diffusers import QwenImageImg2ImgPipeline
    from diffusers.utils.torch_utils import randn_tensor

    family = get_model_family(pipeline)
    # 2 steps: at 1 the stock shift_terminal stretch divides by zero (NaN latents)
    call = {"num_inference_steps": 2, "height": SIZE, "width": SIZE}
    packed = stock(PROMPTS[:2], generator=torch.Generator().manual_seed(0), output_type="latent", **call).images
    pixels = stock(PROMPTS[:2], generator=torch.Generator().manual_seed(0), output_type="np", **call).images
    decoded = family.latents_to_images(unpack_latents(packed, LATENT[2], LATENT[3]))
    assert decoded.shape == (2, SIZE, SIZE, 3) and decoded.dtype == torch.uint8 and np.isfinite(pixels).all()
    assert np.abs(decoded.numpy().astype(int) - np.round(pixels * 255).astype(int)).max() <= 1

    # encoding: img2img draws a posterior sample, (mean + std·ε − latents_mean) / latents_std; miles takes the mode
    latents = family.images_to_latents(decoded)
    assert latents.shape == (2, *LATENT[1:])
    img2img = QwenImageImg2ImgPipeline(**stock.components)
    image = (decoded.float() / 255 * 2 - 1).permute(0, 3, 1, 2).unsqueeze(2)
    sampled = img2img._encode_vae_image(image, generator=torch.Generator().manual_seed(5))[:, :, 0]
    posterior = stock.vae.encode(image).latent_dist
    noise = randn_tensor(posterior.mean.shape, generator=torch.Generator().manual_seed(5))
    std = torch.tensor(stock.vae.config.latents_std).view(1, -1, 1, 1)
    torch.testing.assert_close(sampled, latents + (posterior.std * noise)[:, :, 0] / std, atol=1e-5, rtol=1e-5)


def test_the_flow_shift_is_the_pipelines_dynamic_shift_at_its_token_count(pipeline, tmp_path):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    def expected(tokens):
        return math.exp(calculate_shift(tokens, 256, 8192, 0.5, 0.9))

    family = get_model_family(pipeline)
    assert family.flow_shift(pipeline) == pytest.approx(expected(4), rel=1e-12)  # 32 × 32: 2 × 2 tokens
    default = tmp_path / "default"  # no sample size: the pipeline's 1024 × 1024, 4096 tokens
    default.mkdir()
    for name in ("model_index.json", "scheduler", "transformer"):
        (default / name).symlink_to(pipeline / name)
    index = json.loads((pipeline / "model_index.json").read_text())
    del index["_miles_sample_size"]
    (default / "model_index.json").unlink()
    (default / "model_index.json").write_text(json.dumps(index))
    assert family.latent_shape(default) == (4, 128, 128)
    assert family.flow_shift(default) == pytest.approx(expected(4096), rel=1e-12) == pytest.approx(2.0, abs=0.005)
    assert SCHEDULER_CONFIG["shift_terminal"] == 0.02  # the terminal stretch a static shift leaves out (docs)


def test_unset_flow_shift_flags_take_the_familys_shift_and_say_so(pipeline):
    from tests.support.arguments import BASE, parsed_with_defaults

    argv = ["--hf-checkpoint", str(pipeline), *BASE[2:], "--rollout-batch-size", "4"]
    shift = get_model_family(pipeline).flow_shift(pipeline)
    args = parsed_with_defaults(argv)
    assert args.diffusion_flow_shift == args.fsdp_flow_shift == shift
    assert args.flow_shift_origin["--diffusion-flow-shift"].startswith(f"{shift:g}: the qwen_image family's")
    given = parsed_with_defaults([*argv, "--diffusion-flow-shift", "4"])
    assert given.diffusion_flow_shift == 4.0 and given.fsdp_flow_shift == shift
    assert given.flow_shift_origin["--diffusion-flow-shift"] == "4: set on the command line"
    # a pipeline that cannot be read here (a dry run for a cluster's paths) keeps the old default
    elsewhere = parsed_with_defaults([*BASE, "--rollout-batch-size", "4"])
    assert elsewhere.diffusion_flow_shift == elsewhere.fsdp_flow_shift == 3.0


# ---- DMD2 end to end, the export sampled by the stock pipeline ----


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("qwen_image_dmd2")
    inputs = family_e2e.write_inputs(root, write_tiny_qwen_image, negative_prompt=" ")  # the model card's
    return {**family_e2e.train_and_resume(root, inputs, "qwen_image"), **inputs}


def test_dmd2_trains_the_critic_with_its_head_and_the_student_with_both_gradients(trained):
    family_e2e.check_phase2_records(trained["records"])


def test_resume_from_rollout_0_repeats_rollout_1_exactly(trained):
    full, resumed = family_e2e.figures(trained["records"], 1), family_e2e.figures(trained["resumed"], 1)
    assert set(full) == set(family_e2e.EXACT_KEYS) and resumed == full


def test_the_export_carries_a_static_scheduler_at_the_familys_shift(trained):
    export = trained["export"]
    shift = get_model_family(trained["pipeline"]).flow_shift(trained["pipeline"])
    config = json.loads((export / "scheduler" / "scheduler_config.json").read_text())
    assert config["_class_name"] == "FlowMatchLCMScheduler" and config["shift"] == shift
    assert not config["use_dynamic_shifting"] and config["shift_terminal"] is None
    assert config["_miles_distilled_guidance_scale"] == TEACHER_GUIDANCE
    assert stock_sampling_kwargs(export) == {
        "num_inference_steps": 4,
        "true_cfg_scale": 1.0,
        "height": SIZE,
        "width": SIZE,
    }


def test_the_stock_pipeline_samples_the_export_as_miles_does(trained):
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    export = trained["export"]
    schedule = FlowNoiseSchedule(4, get_model_family(export).flow_shift(export))
    stock = family_e2e.stock_latents(QwenImagePipeline, export, init_seed=7, renoise_seed=11)
    ours = family_e2e.miles_latents(export, 7, 11, schedule)
    assert stock.shape == LATENT and torch.isfinite(stock).all()
    torch.testing.assert_close(stock, ours, atol=1e-5, rtol=0)
    assert not torch.allclose(family_e2e.stock_latents(QwenImagePipeline, export, 7, 12), stock, atol=1e-3)
    family_e2e.check_lora_export(QwenImageTransformer2DModel, export, trained["pipeline"])
