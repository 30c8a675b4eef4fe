"""The ``flux2`` family on a tiny random ``Flux2KleinPipeline`` (tests.support.tiny_pipelines, nothing downloaded).

Unit checks against the stock pipeline (prompt encoding, the VAE latent, the flow shift it samples with), the
preflight refusal of CFG for a step-distilled klein, and one DMD2 phase-2 run through ``train_diffusion.main`` on 2
CPU ranks (prompt cache, real latents from ``encode_images`` for the GAN head, EMA, checkpoints, export) whose
export the stock ``Flux2KleinPipeline`` samples as miles does; its resume from the first commit is run in the same
fixture. The sample size is 32 × 64 pixels (``_miles_sample_size``): latents ``(16, 2, 4)``, 8 image tokens.
"""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from miles.models import get_model_family
from miles.models.flux2 import Flux2Family, patchify, unpatchify
from miles.models.sampling_schedule import SCHEDULE_KEYS, stock_sampling_kwargs
from miles.models.stock_defaults import write_sample_size
from miles.utils.sampling import FlowNoiseSchedule, denoise
from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.recipes import tiny_recipe_argv
from tests.support.tiny_pipelines import write_tiny_flux2_klein

PROMPTS = ["a red square", "a blue circle", "two green dots", "a yellow line"]
SIZE = (32, 64)
LATENT = (16, 2, 4)
GAN = ["train/dmd2_gan_grad_abs_mean", "train/critic-gan_disc_loss", "train/critic-gan_logit_real"]


def _pipeline(folder, distilled=False):
    path = write_tiny_flux2_klein(folder, distilled=distilled)
    write_sample_size(path, SIZE)
    return path


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    return _pipeline(tmp_path_factory.mktemp("flux2") / "klein")


def test_the_family_reads_the_pipeline(klein):
    family = get_model_family(klein)
    assert isinstance(family, Flux2Family)
    assert family.latent_shape(klein) == LATENT and family.image_shape(klein) == (*SIZE, 3)
    assert family.max_guidance_scale(klein) is None and family.text_tokens(klein) == 512
    signature = family.compatibility_signature(klein)
    assert signature["latent shape"] == LATENT and signature["text-encoder width (joint_attention_dim)"] == 24


def test_prompts_encode_as_the_stock_pipeline_does(klein):
    from diffusers import Flux2KleinPipeline

    family = get_model_family(klein)
    cond = family.encode_prompts(family.load_text_encoder(klein), ["a cat", "two dogs on a hill", ""])
    stock, text_ids = Flux2KleinPipeline.from_pretrained(klein).encode_prompt(
        ["a cat", "two dogs on a hill", ""], device="cpu"
    )
    assert set(cond) == {"encoder_hidden_states"} and cond["encoder_hidden_states"].shape == (3, 512, 24)
    assert torch.equal(cond["encoder_hidden_states"], stock.float()) and text_ids.shape == (3, 512, 4)
    alone = family.encode_prompts(family.load_text_encoder(klein), ["two dogs on a hill"])
    torch.testing.assert_close(alone["encoder_hidden_states"][0], cond["encoder_hidden_states"][1])


def test_images_round_trip_through_the_patched_normalised_latent(klein):
    from diffusers import Flux2KleinPipeline

    family = get_model_family(klein)
    images = torch.randint(0, 256, (2, *SIZE, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    latents = family.images_to_latents(images)
    assert latents.shape == (2, *LATENT)
    pipe = Flux2KleinPipeline.from_pretrained(klein)
    pixels = images.float().div(255).mul(2).sub(1).permute(0, 3, 1, 2)
    torch.testing.assert_close(latents, pipe._encode_vae_image(pixels, generator=None), rtol=0, atol=1e-6)
    vae_latents = family.to_vae_latents(latents)
    assert torch.equal(patchify(unpatchify(latents)), latents) and vae_latents.shape == (2, 4, 4, 8)
    decoded = family.latents_to_images(latents)
    assert decoded.shape == (2, *SIZE, 3) and decoded.dtype == torch.uint8


def test_the_flow_shift_is_the_stock_pipelines_dynamic_shift_at_the_sample_size(klein):
    """The stock call at 50 steps (its default) builds miles' grid at the family's shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    shift = get_model_family(klein).flow_shift(klein)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(klein / "scheduler")
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 50, 50), mu=compute_empirical_mu(8, 50))
    torch.testing.assert_close(scheduler.sigmas, FlowNoiseSchedule(50, shift).sigmas.float(), rtol=0, atol=1e-6)
    assert 4.9 < shift < 5.0  # 8 tokens at 50 steps: mu ≈ 1.596
    four = get_model_family(klein).flow_shift(klein, num_steps=4)  # the distilled klein's 4 steps: mu ≈ 1.88
    assert four == pytest.approx(math.exp(compute_empirical_mu(8, 4)), rel=1e-12) and four > shift


def test_the_two_family_flow_shifts_say_which_step_count_made_each(klein):
    # Issue 34 item 7: klein's shift depends on the step count, so the student's grid (4 steps) and the trainer's
    # 1000-point grid (the stock call's 50) get two values; the dry run's lines said the same words for both.
    from tests.support.arguments import parsed_with_defaults

    argv = ["--hf-checkpoint", str(klein), "--prompt-data", "/data/p.jsonl", "--num-rollout", "3",
            "--rollout-batch-size", "4", "--diffusion-num-steps", "4"]  # fmt: skip
    args = parsed_with_defaults(argv)
    family = get_model_family(klein)
    assert args.diffusion_flow_shift == family.flow_shift(klein, num_steps=4) != args.fsdp_flow_shift
    assert args.fsdp_flow_shift == family.flow_shift(klein)
    engine, trainer = args.flow_shift_origin["--diffusion-flow-shift"], args.flow_shift_origin["--fsdp-flow-shift"]
    assert engine.endswith("for the student's 4 steps; the shift depends on the step count)"), engine
    assert trainer.endswith(
        "for the stock call's default step count, the teacher's; the student's grid takes its own)"
    )


def test_preflight_refuses_teacher_cfg_for_a_step_distilled_klein(tmp_path, capsys):
    distilled = _pipeline(tmp_path / "distilled", distilled=True)
    assert get_model_family(distilled).max_guidance_scale(distilled) == 1.0
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "a cat"}) + "\n")
    argv = ["--loss-type", "dmd2", "--hf-checkpoint", str(distilled), "--teacher-load", str(distilled),
            "--prompt-data", str(data), "--rollout-batch-size", "4", "--num-rollout", "1",
            "--micro-batch-size", "1", "--dmd2-critic-steps-per-rollout", "2", "--dmd2-teacher-guidance-scale", "2", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        run_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--dmd2-teacher-guidance-scale 2 does not fit --teacher-load" in err and "up to 1" in err


def _write_images(folder) -> None:
    folder.mkdir()
    generator = np.random.default_rng(0)
    for index in range(4):
        Image.fromarray(generator.integers(0, 256, (*SIZE, 3), dtype=np.uint8)).save(folder / f"real{index}.png")


def _argv(root, out, export=None):
    """examples/flux2_klein/run_dmd2.sh's phase-2 command on the tiny pipeline (``tests.support.recipes``) at 2 steps
    (the stock-pipeline check below draws 2 re-noises): its guidance, GAN head, EMA, learning rates as shipped."""
    return tiny_recipe_argv(
        "flux2_klein", pipeline=root / "klein", prompts=root / "cache" / "prompts.jsonl",
        negative=root / "cache" / "negative.safetensors", real=root / "real" / "data.jsonl", out=out,
        save=root / "ckpt", export=export, num_steps=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_cluster):
    from miles.rollout import encode_images, prompt_cache

    root = tmp_path_factory.mktemp("flux2_dmd2")
    _pipeline(root / "klein")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert prompt_cache.main([str(root / "klein"), str(root / "prompts.jsonl"), str(root / "cache")]) == 0
    _write_images(root / "images")
    argv = [str(root / "klein"), str(root / "images"), str(root / "real"), "--prompt", PROMPTS[0]]
    assert encode_images.main(argv) == 0
    run_main(_argv(root, root / "full", export=root / "student"))
    full = read_metrics(root / "full")
    (root / "ckpt" / "latest").write_text("0\n")  # as if the run had died during rollout 1
    run_main([*_argv(root, root / "resumed"), "--load", str(root / "ckpt")])
    return {"root": root, "export": root / "student", "full": full, "resumed": read_metrics(root / "resumed")}


def test_the_critic_trains_its_head_on_real_latents_and_the_student_takes_both_gradients(run):
    actor = [r for r in run["full"] if "train/loss" in r]
    critic = [r for r in run["full"] if "train/critic-loss" in r]
    assert [r["rollout_id"] for r in actor] == [0, 1] and [r["rollout_id"] for r in critic] == [0, 0, 1, 1]
    assert all(r["train/dmd2_grad_abs_mean"] > 0 and r["train/dmd2_gan_grad_abs_mean"] > 0 for r in actor)
    assert all(0.5 < r["train/critic-gan_disc_loss"] < 3.0 and math.isfinite(r["train/critic-loss"]) for r in critic)
    # the trainer's recomputed x0 equals the engine's (same weights, same packed tokens and position ids)
    assert all(r["train/x0_max_abs_diff"] < 1e-4 for r in actor)
    real = json.loads((run["root"] / "real" / "encode_images.json").read_text())
    assert tuple(real["latent_shape"]) == LATENT and real["family"] == "flux2"


def test_resume_from_the_first_commit_repeats_the_second_rollout_exactly(run):
    for key in ["train/loss", "train/critic-loss", *GAN]:
        full = [r[key] for r in run["full"] if key in r and r["rollout_id"] == 1]
        again = [r[key] for r in run["resumed"] if key in r and r["rollout_id"] == 1]
        assert full and again == full, key


def test_the_stock_pipeline_samples_the_export_as_miles_does(run):
    """The export (EMA weights, a static LCM scheduler at the student's shift, ``is_distilled``) opened by
    ``Flux2KleinPipeline``: the same noise gives the same latents as miles' 2-step DMD2 sampler. The LCM re-noise
    comes from torch's global RNG in the stock call (tests/fast/models/test_sd3_stock_export.py), drawn on the
    packed tokens: the same seed in miles' latent layout would be another noise (5.5 apart)."""
    from diffusers import Flux2KleinPipeline

    export = run["export"]
    index = json.loads((export / "model_index.json").read_text())
    assert index["scheduler"] == ["diffusers", "FlowMatchLCMScheduler"] and index["is_distilled"] is True
    call = stock_sampling_kwargs(export)
    # the size it was trained at: the stock call's own default is 1024²
    assert call == {"num_inference_steps": 2, "guidance_scale": 1.0, "height": SIZE[0], "width": SIZE[1]}
    pipe = Flux2KleinPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        stock = pipe(prompt=PROMPTS, generator=torch.Generator().manual_seed(7), output_type="latent", **call).images
    family = get_model_family(export)
    noise = torch.randn(len(PROMPTS), *LATENT, generator=torch.Generator().manual_seed(7))
    renoise = torch.Generator().manual_seed(11)
    # the stock LCM step draws its re-noise in the token layout (B, h·w, 4·C) of the packed latents
    tokens = [torch.randn(len(PROMPTS), 8, 16, generator=renoise) for _ in range(2)]
    draws = [draw.permute(0, 2, 1).reshape(len(PROMPTS), *LATENT) for draw in tokens]
    cond = family.encode_prompts(family.load_text_encoder(export), PROMPTS)
    ours = denoise(
        family, family.load_denoiser(export), noise, cond, FlowNoiseSchedule(2, _export_shift(export)),
        fresh_noise=lambda k: draws[k], record=False,
    ).final  # fmt: skip
    assert stock.shape == (len(PROMPTS), 4, 4, 8)
    torch.testing.assert_close(stock, family.to_vae_latents(ours), rtol=0, atol=1e-5)
    from diffusers import Flux2Transformer2DModel

    trained = Flux2Transformer2DModel.from_pretrained(export / "transformer").state_dict()
    initial = Flux2Transformer2DModel.from_pretrained(run["root"] / "klein" / "transformer").state_dict()
    assert any(not torch.equal(trained[key], initial[key]) for key in initial)


def _export_shift(export) -> float:
    """The flow shift the student trained and was exported at: the family's default (the klein recipe sets none)."""
    config = json.loads((export / "scheduler" / "scheduler_config.json").read_text())
    return float(config[SCHEDULE_KEYS["shift"]])
