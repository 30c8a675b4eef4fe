"""The ``flux`` family on the tiny offline ``FluxPipeline`` (``tests.support.tiny_pipelines``) at 32 × 32: FLUX.1-dev's
layout (guidance-distilled, dynamic shift) and schnell's (no guidance input, shift 1).

Prompts, latents, the embedded guidance and the flow shift are checked against the stock pipeline; one DMD2 phase-2
run on dev (2 CPU ranks, 2 rollouts, GAN head on real latents from ``encode_images``, EMA, prompt cache, resume)
trains a student whose export the stock ``FluxPipeline`` samples as miles does (``tests.support.family_e2e``); a
schnell export is checked without training, and preflight refuses to guide a schnell teacher.
"""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from miles.backends.fsdp_utils.converters import LoraAdapter
from miles.models import get_model_family
from miles.models.base import DENOISER
from miles.models.flux import TEXT_TOKENS, FluxFamily
from miles.models.lora import ADAPTER_NAME, AdaptersDisabled, LoraSettings, adapter_parameters
from miles.models.packed_dit import unpack_latents
from miles.models.sampling_schedule import stock_sampling_kwargs, write_sampling_schedule
from miles.models.stock_defaults import write_sample_size
from miles.utils.sampling import FlowNoiseSchedule, denoise
from tests.support import family_e2e
from tests.support.driver import run_main
from tests.support.family_e2e import LATENT, PROMPTS, SIZE
from tests.support.tiny_pipelines import write_tiny_flux
from tests.support.tiny_pipelines.flux import T5_HIDDEN

TEACHER_GUIDANCE = 3.5  # FLUX.1-dev's guidance_scale default, FastGen's recipe value


def _tiny_flux(folder, variant: str):
    path = write_tiny_flux(folder, variant=variant)
    write_sample_size(path, (SIZE, SIZE))
    return path


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux")
    return {variant: _tiny_flux(root / variant, variant) for variant in ("dev", "schnell")}


@pytest.fixture(scope="module")
def dev(pipelines):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(pipelines["dev"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_family_reads_both_variants(pipelines, dev):
    for path in pipelines.values():
        family = get_model_family(path)
        assert isinstance(family, FluxFamily) and family.latent_shape(path) == LATENT[1:]
        assert family.text_tokens(path) == TEXT_TOKENS
        assert family.compatibility_signature(path)["T5 width (joint_attention_dim)"] == T5_HIDDEN
    assert len(get_model_family(pipelines["dev"]).blocks(dev.transformer)) == 2  # 1 double + 1 single


def test_prompts_are_encoded_as_the_stock_pipeline_encodes_them(pipelines, dev):
    family = get_model_family(pipelines["dev"])
    cond = family.encode_prompts(family.load_text_encoder(pipelines["dev"]), PROMPTS)
    with torch.no_grad():  # as the pipeline's __call__ runs it (grad mode picks other kernels: 1e-5 apart)
        states, pooled, text_ids = dev.encode_prompt(PROMPTS, prompt_2=None, device="cpu", max_sequence_length=512)
    assert states.shape == (4, TEXT_TOKENS, T5_HIDDEN) and not text_ids.any()
    assert torch.equal(cond["encoder_hidden_states"], states) and torch.equal(cond["pooled_projections"], pooled)


def test_the_teacher_is_guided_through_its_guidance_input_as_the_stock_pipeline_guides(pipelines, dev):
    """One Euler step from σ = 1 (x − v at timestep 1000) of the stock call at guidance_scale 3.5 is miles'
    EmbeddedGuidance at 3.5; 1 is another sample (the input matters)."""
    path = pipelines["dev"]
    family = get_model_family(path)
    cond = family.encode_prompts(family.load_text_encoder(path), PROMPTS)
    noise = torch.randn(LATENT, generator=torch.Generator().manual_seed(2))

    def ours(scale):
        return denoise(family, dev.transformer, noise, cond, FlowNoiseSchedule(1, 1.0), guidance_scale=scale,
                       step_rule="euler", record=False).final  # fmt: skip

    tokens = dev(
        PROMPTS,
        num_inference_steps=1,
        guidance_scale=TEACHER_GUIDANCE,
        height=SIZE,
        width=SIZE,
        generator=torch.Generator().manual_seed(2),
        output_type="latent",
    ).images
    stock = unpack_latents(tokens, LATENT[2], LATENT[3])
    torch.testing.assert_close(ours(TEACHER_GUIDANCE), stock, atol=1e-5, rtol=0)
    assert not torch.allclose(ours(1.0), stock, atol=1e-3)
    # without a guidance input the forward runs at the student's 1 (what the engine passes at scale 1)
    timestep = torch.full((4,), 1000.0)
    torch.testing.assert_close(
        family.predict_velocity(dev.transformer, noise, timestep, cond),
        family.guided_velocity(
            lambda *a: family.predict_velocity(dev.transformer, *a), noise, timestep, cond, None, 1.0
        ),
        atol=0,
        rtol=0,
    )


def test_a_lora_critics_teacher_is_its_base_through_the_family(pipelines):
    """The teacher of a LoRA critic on the teacher's weights is the base with the adapters off; the flux forward reads
    the transformer's config (``guidance_embeds``), which that view once lacked (an AttributeError at scoring)."""
    path = pipelines["dev"]
    family = get_model_family(path)
    base = family.load_denoiser(path)
    torch.manual_seed(0)
    lora = family.load_denoiser(path)
    LoraAdapter(LoraSettings(rank=4, alpha=4.0, target_modules=("to_q",), dropout=0.0), torch.float32).convert(
        DENOISER, lora
    )
    with torch.no_grad():
        for _, param in adapter_parameters(lora, ADAPTER_NAME):
            param.normal_(std=0.1, generator=torch.Generator().manual_seed(1))
        noise = torch.randn(LATENT, generator=torch.Generator().manual_seed(3))
        cond = family.encode_prompts(family.load_text_encoder(path), PROMPTS)
        timestep = torch.full((LATENT[0],), 750.0)
        expected = family.predict_velocity(base, noise, timestep, cond)
        assert torch.equal(family.predict_velocity(AdaptersDisabled(lora), noise, timestep, cond), expected)
        assert not torch.equal(family.predict_velocity(lora, noise, timestep, cond), expected)


def test_latents_decode_as_the_stock_pipeline_decodes_and_encode_as_its_img2img(pipelines, dev):
    from diffusers import FluxImg2ImgPipeline
    from diffusers.utils.torch_utils import randn_tensor

    family = get_model_family(pipelines["dev"])
    call = {"num_inference_steps": 1, "height": SIZE, "width": SIZE}
    packed = dev(PROMPTS[:2], generator=torch.Generator().manual_seed(0), output_type="latent", **call).images
    pixels = dev(PROMPTS[:2], generator=torch.Generator().manual_seed(0), output_type="np", **call).images
    decoded = family.latents_to_images(unpack_latents(packed, LATENT[2], LATENT[3]))
    assert decoded.shape == (2, SIZE, SIZE, 3) and decoded.dtype == torch.uint8 and np.isfinite(pixels).all()
    assert np.abs(decoded.numpy().astype(int) - np.round(pixels * 255).astype(int)).max() <= 1

    # encoding: img2img draws a posterior sample, (mean + std·ε − shift) · scaling; miles takes the mode
    latents = family.images_to_latents(decoded)
    image = decoded.float().permute(0, 3, 1, 2) / 255 * 2 - 1
    sampled = FluxImg2ImgPipeline(**dev.components)._encode_vae_image(image, torch.Generator().manual_seed(5))
    posterior = dev.vae.encode(image).latent_dist
    noise = randn_tensor(posterior.mean.shape, generator=torch.Generator().manual_seed(5))
    scaling = dev.vae.config.scaling_factor
    torch.testing.assert_close(sampled, latents + posterior.std * noise * scaling, atol=1e-5, rtol=1e-5)


def test_the_flow_shift_is_devs_dynamic_shift_and_schnells_static_one(pipelines):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    dev_path = pipelines["dev"]
    assert get_model_family(dev_path).flow_shift(dev_path) == pytest.approx(
        math.exp(calculate_shift(4, 256, 4096, 0.5, 1.15)), rel=1e-12
    )
    assert get_model_family(pipelines["schnell"]).flow_shift(pipelines["schnell"]) == 1.0


def test_a_schnell_export_samples_in_the_stock_pipeline_as_in_miles(pipelines, tmp_path):
    """No guidance input on either side; shift 1 (schnell's own), 2 steps, the plain grid 1, 0.5."""
    from diffusers import FluxPipeline

    export = tmp_path / "schnell"
    shutil.copytree(pipelines["schnell"], export)
    family = get_model_family(export)
    write_sampling_schedule(
        export,
        num_steps=2,
        shift=1.0,
        step_rule="dmd2",
        stock_scheduler=True,
        stock_config=family.stock_scheduler_config,
    )
    assert stock_sampling_kwargs(export) == {
        "num_inference_steps": 2,
        "guidance_scale": 1.0,
        "height": 32,
        "width": 32,
    }
    stock = family_e2e.stock_latents(FluxPipeline, export, init_seed=1, renoise_seed=2)
    torch.testing.assert_close(
        stock, family_e2e.miles_latents(export, 1, 2, FlowNoiseSchedule(2, 1.0)), atol=1e-5, rtol=0
    )


def test_preflight_refuses_to_guide_a_schnell_teacher(pipelines, tmp_path, capsys):
    path = str(pipelines["schnell"])
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "a cat"}) + "\n")
    argv = [
        "--loss-type", "dmd2", "--hf-checkpoint", path, "--teacher-load", path, "--prompt-data", str(data),
        "--rollout-batch-size", "2", "--dmd2-critic-steps-per-rollout", "1", "--dmd2-teacher-guidance-scale", "3.5", "--num-rollout", "1",
        "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        run_main(argv)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("train_diffusion.py: error: --dmd2-teacher-guidance-scale 3.5 does not fit --teacher-load")
    assert "the flux pipeline takes guidance up to 1" in line


# ---- DMD2 end to end on dev, the export sampled by the stock pipeline ----


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("flux_dmd2")
    inputs = family_e2e.write_inputs(root, lambda folder: write_tiny_flux(folder, variant="dev"))
    return {**family_e2e.train_and_resume(root, inputs, "flux_dev"), **inputs}


def test_dmd2_trains_the_critic_with_its_head_and_the_student_with_both_gradients(trained):
    family_e2e.check_phase2_records(trained["records"])


def test_resume_from_rollout_0_repeats_rollout_1_exactly(trained):
    full, resumed = family_e2e.figures(trained["records"], 1), family_e2e.figures(trained["resumed"], 1)
    assert set(full) == set(family_e2e.EXACT_KEYS) and resumed == full


def test_the_stock_pipeline_samples_the_dev_export_as_miles_does(trained):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    export = trained["export"]
    shift = get_model_family(export).flow_shift(export)
    config = json.loads((export / "scheduler" / "scheduler_config.json").read_text())
    assert config["_class_name"] == "FlowMatchLCMScheduler" and config["shift"] == shift
    assert not config["use_dynamic_shifting"] and config["_miles_distilled_guidance_scale"] == TEACHER_GUIDANCE
    # the student's guidance input is 1, the value its rollouts and its training forwards ran at
    assert stock_sampling_kwargs(export) == {
        "num_inference_steps": 4,
        "guidance_scale": 1.0,
        "height": 32,
        "width": 32,
    }
    stock = family_e2e.stock_latents(FluxPipeline, export, init_seed=7, renoise_seed=11)
    ours = family_e2e.miles_latents(export, 7, 11, FlowNoiseSchedule(4, shift))
    assert stock.shape == LATENT and torch.isfinite(stock).all()
    torch.testing.assert_close(stock, ours, atol=1e-5, rtol=0)
    family_e2e.check_lora_export(FluxTransformer2DModel, export, trained["pipeline"])
