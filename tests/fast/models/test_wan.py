"""The ``wan`` family on a tiny random ``WanPipeline`` (Wan 2.1 T2V layout; tests.support.tiny_pipelines, nothing
downloaded).

Unit checks against the stock pipeline (prompt encoding, the normalised video latent, the export's scheduler grid)
and one DMD2 phase-2 run through ``train_diffusion.main`` on 2 CPU ranks (prompt cache, real video latents for the
GAN head's 3-D token grid, EMA, checkpoints, export) whose export the stock ``WanPipeline`` samples as miles does;
its resume from the first commit is run in the same fixture. Clips are 5 frames of 16 × 32 pixels
(``_miles_sample_size``): latents ``(4, 2, 2, 4)``, a 2 × 1 × 2 token grid.
"""

import json
import math

import pytest
import torch

from miles.models import get_model_family
from miles.models.sampling_schedule import SCHEDULE_KEYS, stock_sampling_kwargs, terminal_scheduler_config
from miles.models.stock_defaults import write_sample_size
from miles.models.wan import WanFamily
from miles.rollout.offline_files import save_tensors
from miles.utils.sampling import FlowNoiseSchedule, denoise
from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.recipes import tiny_recipe_argv
from tests.support.tiny_pipelines import write_tiny_wan

PROMPTS = ["a red square", "a blue circle", "two green dots", "a yellow line"]
SIZE = (5, 16, 32)
LATENT = (4, 2, 2, 4)
GAN = ["train/dmd2_gan_grad_abs_mean", "train/critic-gan_disc_loss", "train/critic-gan_logit_real"]


def _pipeline(folder):
    path = write_tiny_wan(folder)
    write_sample_size(path, SIZE)
    return path


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return _pipeline(tmp_path_factory.mktemp("wan") / "wan")


def test_the_family_reads_the_pipeline(wan):
    family = get_model_family(wan)
    assert isinstance(family, WanFamily)
    assert family.latent_shape(wan) == LATENT and family.image_shape(wan) == (*SIZE, 3)
    assert family.flow_shift(wan) == 3.0 and family.max_guidance_scale(wan) is None
    assert family.compatibility_signature(wan)["patch size (patch_size)"] == [1, 2, 2]
    assert family.expert_boundary(wan) is None  # one expert (two: tests/fast/models/test_wan_experts.py)


def test_prompts_encode_as_the_stock_pipeline_does(wan):
    from diffusers import WanPipeline

    family = get_model_family(wan)
    prompts = ["a cat", "two  dogs on a hill ", ""]
    cond = family.encode_prompts(family.load_text_encoder(wan), prompts)
    stock, _ = WanPipeline.from_pretrained(wan).encode_prompt(
        prompts, do_classifier_free_guidance=False, max_sequence_length=512, device="cpu"
    )
    hidden = cond["encoder_hidden_states"]
    assert set(cond) == {"encoder_hidden_states"} and hidden.shape == (3, 512, 16)
    # two pipeline objects over the same weights differ by float rounding in UMT5's attention (7e-7 seen)
    torch.testing.assert_close(hidden, stock.float(), rtol=0, atol=1e-5)
    assert hidden[0, 20:].abs().sum() == 0 and hidden[0, 0].abs().sum() > 0  # zero past the prompt's tokens


def test_clips_round_trip_through_the_normalised_latent(wan):
    family = get_model_family(wan)
    clips = torch.randint(0, 256, (2, *SIZE, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    latents = family.images_to_latents(clips)
    assert latents.shape == (2, *LATENT)
    vae = family.vae
    pixels = clips.float().div(255).mul(2).sub(1).permute(0, 4, 1, 2, 3)
    raw = vae.encode(pixels).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(latents * std + mean, raw, rtol=0, atol=1e-5)  # the pipeline's decode-side inverse
    decoded = family.latents_to_images(latents)
    assert decoded.shape == (2, *SIZE, 3) and decoded.dtype == torch.uint8


@pytest.mark.parametrize("num_steps, shift", [(2, 3.0), (4, 5.0), (1, 3.0)])
def test_the_export_scheduler_builds_the_students_grid_from_set_timesteps(num_steps, shift):
    from diffusers import FlowMatchLCMScheduler

    config = terminal_scheduler_config(num_steps=num_steps, shift=shift, step_rule="dmd2")
    scheduler = FlowMatchLCMScheduler.from_config(config)
    scheduler.set_timesteps(num_steps)  # as WanPipeline calls it: no sigmas, no mu
    miles = FlowNoiseSchedule(num_steps, shift)
    torch.testing.assert_close(scheduler.sigmas, miles.sigmas.float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(scheduler.timesteps, miles.timesteps.float(), rtol=0, atol=1e-4)
    assert terminal_scheduler_config(num_steps=2, shift=3.0, step_rule="dmd2", timesteps=[1000.0, 500.0]) is None


def _write_real_latents(root, family, pipeline) -> None:
    """Real clips as latent records (the GAN head's real data)."""
    (root / "real").mkdir()
    clips = torch.randint(0, 256, (4, *SIZE, 3), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    latents = family.images_to_latents(clips)
    lines = []
    for index, latent in enumerate(latents):
        save_tensors(root / "real" / f"clip{index}.safetensors", {"latent": latent})
        lines.append(json.dumps({"prompt": PROMPTS[index], "latent": f"clip{index}.safetensors"}) + "\n")
    (root / "real" / "data.jsonl").write_text("".join(lines))


def _argv(root, out, export=None):
    """examples/wan/run_dmd2.sh's phase-2 command on the tiny pipeline (``tests.support.recipes``) at 2 steps
    (the stock-pipeline check below draws 2 re-noises): its guidance, GAN head, EMA, learning rates as shipped."""
    return tiny_recipe_argv(
        "wan", pipeline=root / "wan", prompts=root / "cache" / "prompts.jsonl",
        negative=root / "cache" / "negative.safetensors", real=root / "real" / "data.jsonl", out=out,
        save=root / "ckpt", export=export, num_steps=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_cluster):
    from miles.rollout import prompt_cache

    root = tmp_path_factory.mktemp("wan_dmd2")
    pipeline = _pipeline(root / "wan")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert prompt_cache.main([str(pipeline), str(root / "prompts.jsonl"), str(root / "cache")]) == 0
    _write_real_latents(root, get_model_family(pipeline), pipeline)
    run_main(_argv(root, root / "full", export=root / "student"))
    full = read_metrics(root / "full")
    (root / "ckpt" / "latest").write_text("0\n")  # as if the run had died during rollout 1
    run_main([*_argv(root, root / "resumed"), "--load", str(root / "ckpt")])
    return {"root": root, "export": root / "student", "full": full, "resumed": read_metrics(root / "resumed")}


def test_the_critic_trains_its_head_on_real_video_latents_and_the_student_takes_both_gradients(run):
    actor = [r for r in run["full"] if "train/loss" in r]
    critic = [r for r in run["full"] if "train/critic-loss" in r]
    assert [r["rollout_id"] for r in actor] == [0, 1] and [r["rollout_id"] for r in critic] == [0, 0, 1, 1]
    assert all(r["train/dmd2_grad_abs_mean"] > 0 and r["train/dmd2_gan_grad_abs_mean"] > 0 for r in actor)
    assert all(0.5 < r["train/critic-gan_disc_loss"] < 3.0 and math.isfinite(r["train/critic-loss"]) for r in critic)
    assert all(r["train/x0_max_abs_diff"] < 1e-4 for r in actor)


def test_resume_from_the_first_commit_repeats_the_second_rollout_exactly(run):
    for key in ["train/loss", "train/critic-loss", *GAN]:
        full = [r[key] for r in run["full"] if key in r and r["rollout_id"] == 1]
        again = [r[key] for r in run["resumed"] if key in r and r["rollout_id"] == 1]
        assert full and again == full, key


def test_the_stock_pipeline_samples_the_export_as_miles_does(run):
    """The export (EMA weights, an LCM scheduler whose ``shift`` and ``shift_terminal`` rebuild the 2-step grid)
    opened by ``WanPipeline``: the same noise gives the same latents as miles' DMD2 sampler. The LCM re-noise comes
    from torch's global RNG in the stock call (tests/fast/models/test_sd3_stock_export.py)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    export = run["export"]
    config = json.loads((export / "scheduler" / "scheduler_config.json").read_text())
    assert config["_class_name"] == "FlowMatchLCMScheduler" and config["_miles_flow_shift"] == 5.0  # the recipe's
    call = stock_sampling_kwargs(export)
    # the clip size it was trained at: the stock call's own default is 81 × 480 × 832
    frames, height, width = SIZE
    assert call == {
        "num_inference_steps": 2, "guidance_scale": 1.0, "num_frames": frames, "height": height, "width": width,
    }  # fmt: skip
    pipe = WanPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        stock = pipe(prompt=PROMPTS, generator=torch.Generator().manual_seed(7), output_type="latent", **call).frames
    family = get_model_family(export)
    noise = torch.randn(len(PROMPTS), *LATENT, generator=torch.Generator().manual_seed(7))
    renoise = torch.Generator().manual_seed(11)
    draws = [torch.randn(len(PROMPTS), *LATENT, generator=renoise) for _ in range(2)]
    cond = family.encode_prompts(family.load_text_encoder(export), PROMPTS)
    ours = denoise(
        family, family.load_denoiser(export), noise, cond, FlowNoiseSchedule(2, _export_shift(export)),
        fresh_noise=lambda k: draws[k], record=False,
    ).final  # fmt: skip
    assert stock.shape == (len(PROMPTS), *LATENT)
    torch.testing.assert_close(stock, ours, rtol=0, atol=1e-5)
    trained = WanTransformer3DModel.from_pretrained(export / "transformer").state_dict()
    initial = WanTransformer3DModel.from_pretrained(run["root"] / "wan" / "transformer").state_dict()
    assert any(not torch.equal(trained[key], initial[key]) for key in initial)


def _export_shift(export) -> float:
    """The flow shift the student trained and was exported at: the recipe's --diffusion-flow-shift 5."""
    config = json.loads((export / "scheduler" / "scheduler_config.json").read_text())
    return float(config[SCHEDULE_KEYS["shift"]])
