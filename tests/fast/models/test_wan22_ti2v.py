"""Wan 2.2 TI2V-5B (``expand_timesteps``) in the ``wan`` family, on a tiny offline pipeline of its layout
(``tests.support.tiny_pipelines.wan22_ti2v``: Wan 2.2's VAE at spatial factor 16), text-to-video: the forward with
a timestep per token is the stock pipeline's transformer call, and DMD2 trains it on 2 CPU ranks end to end, its
export sampled by the stock ``WanPipeline`` as miles samples it. Clips are 5 frames of 32 × 64 pixels: latents
``(4, 2, 2, 4)``, a 2 × 1 × 2 token grid."""

import json
import math

import pytest
import torch

from miles.models import get_model_family
from miles.models.sampling_schedule import SCHEDULE_KEYS, stock_sampling_kwargs
from miles.models.stock_defaults import write_sample_size
from miles.models.wan import WanFamily
from miles.utils.misc import make_generator
from miles.utils.sampling import FlowNoiseSchedule, denoise
from tests.support.tiny_pipelines.wan22_ti2v import write_tiny_wan22_ti2v

PROMPTS = ["a red square", "a blue circle"]
SIZE = (5, 32, 64)
LATENT = (4, 2, 2, 4)


def _pipeline(folder):
    path = write_tiny_wan22_ti2v(folder)
    write_sample_size(path, SIZE)
    return path


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory):
    return _pipeline(tmp_path_factory.mktemp("ti2v") / "ti2v")


def test_the_family_reads_ti2v_and_feeds_a_timestep_per_token_as_the_stock_pipeline(ti2v):
    from diffusers import WanPipeline

    family = get_model_family(ti2v)
    assert isinstance(family, WanFamily) and family._expands_timesteps
    assert family.latent_shape(ti2v) == LATENT and family.flow_shift(ti2v) == 5.0
    clips = torch.randint(
        0, 256, (1, *SIZE, 3), generator=make_generator("test_wan22_ti2v", "clip"), dtype=torch.uint8
    )
    assert family.images_to_latents(clips).shape == (1, *LATENT)  # Wan 2.2's VAE: spatial factor 16

    stock = WanPipeline.from_pretrained(ti2v)
    cond = family.encode_prompts(family.load_text_encoder(ti2v), PROMPTS)
    latents = torch.randn(2, *LATENT, generator=make_generator("test_wan22_ti2v", "latents"))
    t = torch.tensor(800.0)
    with torch.no_grad():
        ours = family.predict_velocity(family.load_denoiser(ti2v), latents, t.expand(2), cond)
        # WanPipeline.__call__ with expand_timesteps, text to video: mask of ones, (mask[0][0][:, ::2, ::2] · t)
        mask = torch.ones(latents.shape)
        timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(2, -1)
        assert timestep.shape == (2, 4)
        v = stock.transformer(
            hidden_states=latents, timestep=timestep, encoder_hidden_states=cond["encoder_hidden_states"],
            return_dict=False,
        )[0]  # fmt: skip
    torch.testing.assert_close(ours, v.float(), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_cluster):
    from miles.rollout import prompt_cache
    from miles.utils.tracking import read_metrics
    from tests.support.driver import run_main

    root = tmp_path_factory.mktemp("ti2v_dmd2")
    pipeline = _pipeline(root / "ti2v")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert prompt_cache.main([str(pipeline), str(root / "prompts.jsonl"), str(root / "cache")]) == 0
    run_main([
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", str(root / "cache" / "prompts.jsonl"),
        "--negative-cond", str(root / "cache" / "negative.safetensors"),
        "--actor-num-gpus-per-node", "2", "--num-cpus-per-rank", "1", "--rollout-batch-size", "2",
        "--micro-batch-size", "1", "--dmd2-critic-steps-per-rollout", "1", "--dmd2-teacher-guidance-scale", "2",
        "--diffusion-num-steps", "2", "--num-rollout", "2", "--lr", "1e-3", "--critic-lr", "1e-3",
        "--output-dir", str(root / "run"), "--save-hf", str(root / "student"),
    ])  # fmt: skip
    return {"root": root, "records": read_metrics(root / "run"), "export": root / "student"}


def test_dmd2_trains_the_ti2v_student_on_two_ranks(run):
    actor = [r for r in run["records"] if "train/loss" in r]
    critic = [r for r in run["records"] if "train/critic-loss" in r]
    assert [r["rollout_id"] for r in actor] == [0, 1] and [r["rollout_id"] for r in critic] == [0, 1]
    assert all(r["train/dmd2_grad_abs_mean"] > 0 for r in actor)
    assert all(r["train/x0_max_abs_diff"] < 1e-4 for r in actor)  # the trainer's per-token timestep is the engine's
    assert all(math.isfinite(v) for r in actor + critic for k, v in r.items() if k.startswith("train/"))


def test_the_stock_pipeline_samples_the_ti2v_export_as_miles_does(run):
    from diffusers import WanPipeline

    export = run["export"]
    assert json.loads((export / "model_index.json").read_text())["expand_timesteps"] is True
    call = stock_sampling_kwargs(export)
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
    shift = float(json.loads((export / "scheduler" / "scheduler_config.json").read_text())[SCHEDULE_KEYS["shift"]])
    ours = denoise(
        family, family.load_denoiser(export), noise, cond, FlowNoiseSchedule(2, shift),
        fresh_noise=lambda k: draws[k], record=False,
    ).final  # fmt: skip
    assert stock.shape == (len(PROMPTS), *LATENT)
    torch.testing.assert_close(stock, ours, rtol=0, atol=1e-5)
