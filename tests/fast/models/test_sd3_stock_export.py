"""A DMD2 student of the sd3 family, exported by ``--save-hf``, samples with stock diffusers exactly as with miles.

The tiny SD3 pipeline carries CLIP×2 and T5 (``tests.support.sd3_t5``). Two DMD2 runs through
``train_diffusion.main`` (1 DP rank, 4 prompts, K = 2 critic steps, teacher CFG 2) train a 4-step and a 1-step
student for 2 rollouts each; each export is loaded with ``StableDiffusion3Pipeline.from_pretrained`` and sampled
with the call ``stock_sampling_kwargs`` returns, and the same prompts are sampled by ``miles.utils.sampling.denoise``
on the exported transformer from the same noise.

Noise: the stock pipeline draws its initial latents from its ``generator`` and, because it does not pass that
generator to ``scheduler.step``, the LCM re-noise from torch's global RNG, one ``(B, C, H, W)`` draw per step (the
last one is multiplied by σ = 0). The miles side is handed exactly these tensors (``noise=``, ``fresh_noise=``), so
the comparison pins the whole multi-step rule, not just its first step.
"""

import json
import shutil

import pytest
import torch

from miles.models import get_model_family
from miles.models.sampling_schedule import stock_sampling_kwargs, write_sampling_schedule
from miles.models.sd3 import SD3Family
from miles.utils.sampling import FlowNoiseSchedule, denoise
from tests.support.driver import run_main
from tests.support.sd3_t5 import CLIP_TOKENS, JOINT_DIM, tiny_sd3_t5_pipeline

PROMPTS = ["a red square", "a blue circle", "two green dots", "a yellow line"]
T5_TOKENS = 256  # StableDiffusion3Pipeline's max_sequence_length, which the sd3 family encodes with
LATENT = (len(PROMPTS), 4, 8, 8)


def _train(pipeline, data, out, export, num_steps: int) -> None:
    """``train_diffusion.main`` in this process, on the session's Ray cluster; pytest's signal handlers are put
    back afterwards (the driver installs its own)."""

    argv = [
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", str(data), "--actor-num-gpus-per-node", "1", "--num-cpus-per-rank", "1",
        "--rollout-batch-size", "4", "--micro-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2",
        "--dmd2-teacher-guidance-scale", "2", "--diffusion-num-steps", str(num_steps), "--num-rollout", "2",
        "--lr", "1e-3", "--critic-lr", "1e-3", "--output-dir", str(out), "--save-hf", str(export),
    ]  # fmt: skip
    run_main(argv)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("sd3_stock")
    pipeline = tiny_sd3_t5_pipeline(root / "sd3")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    teacher_files = ("model_index.json", "scheduler/scheduler_config.json")
    before = {name: (pipeline / name).read_bytes() for name in teacher_files}
    exports = {}
    for num_steps in (4, 1):
        exports[num_steps] = root / f"student-{num_steps}step"
        _train(pipeline, data, root / f"run-{num_steps}step", exports[num_steps], num_steps)
    after = {name: (pipeline / name).read_bytes() for name in teacher_files}
    return {"pipeline": pipeline, "exports": exports, "teacher_unchanged": before == after}


def _stock_latents(export, init_seed: int, renoise_seed: int, **kwargs) -> torch.Tensor:
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    call = {**stock_sampling_kwargs(export), **kwargs}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(renoise_seed)  # the LCM scheduler's re-noise comes from the global RNG
        out = pipe(PROMPTS, generator=torch.Generator().manual_seed(init_seed), output_type="latent", **call)
    return out.images


def _miles_latents(export, init_seed: int, renoise_seed: int, schedule: FlowNoiseSchedule, step_rule: str):
    family = get_model_family(export)
    cond = family.encode_prompts(family.load_text_encoder(export), PROMPTS)
    noise = torch.randn(LATENT, generator=torch.Generator().manual_seed(init_seed))
    renoise = torch.Generator().manual_seed(renoise_seed)
    draws = [torch.randn(LATENT, generator=renoise) for _ in range(schedule.num_steps)]  # one per stock step
    result = denoise(
        family,
        family.load_denoiser(export),
        noise,
        cond,
        schedule,
        step_rule=step_rule,
        fresh_noise=lambda k: draws[k],
        record=False,
    )
    return result.final


def test_the_tiny_pipeline_encodes_clip_and_t5_tokens(tmp_path):
    path = tiny_sd3_t5_pipeline(tmp_path)
    family = get_model_family(path)
    assert isinstance(family, SD3Family)
    cond = family.encode_prompts(family.load_text_encoder(path), ["a cat", "two dogs on a hill"])
    assert cond["encoder_hidden_states"].shape == (2, CLIP_TOKENS + T5_TOKENS, JOINT_DIM)
    assert cond["pooled_projections"].shape == (2, 32)
    t5 = cond["encoder_hidden_states"][:, CLIP_TOKENS:]
    # real T5 states (not the zeros SD3 puts in T5's place without text_encoder_3), different per prompt
    assert t5.abs().sum(dim=-1).gt(0).all() and not torch.equal(t5[0], t5[1])


def test_the_export_names_the_lcm_scheduler_with_the_students_grid(trained):
    export = trained["exports"][4]
    model_index = json.loads((export / "model_index.json").read_text())
    assert model_index["scheduler"] == ["diffusers", "FlowMatchLCMScheduler"]
    config = json.loads((export / "scheduler" / "scheduler_config.json").read_text())
    assert config["_class_name"] == "FlowMatchLCMScheduler" and config["shift"] == 3.0
    assert config["_miles_num_inference_steps"] == 4 and config["_miles_step_rule"] == "dmd2"
    assert config["_miles_distilled_guidance_scale"] == 2.0 and "stochastic_sampling" not in config
    # the size it was trained at (the transformer's sample_size times the VAE's factor: 8 · 2)
    assert stock_sampling_kwargs(export) == {
        "num_inference_steps": 4,
        "guidance_scale": 1.0,
        "height": 16,
        "width": 16,
    }
    # the teacher keeps its Euler scheduler: the export replaced its hard-linked copies instead of writing into them
    assert trained["teacher_unchanged"]
    teacher = json.loads((trained["pipeline"] / "model_index.json").read_text())
    assert teacher["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]

    from diffusers import StableDiffusion3Pipeline

    scheduler = StableDiffusion3Pipeline.from_pretrained(export).scheduler
    scheduler.set_timesteps(4, mu=config["base_shift"])  # what the pipeline's call does at any resolution
    miles = FlowNoiseSchedule(4, 3.0)
    assert torch.equal(scheduler.sigmas, miles.sigmas.float())  # 1, 0.9, 0.75, 0.5, 0
    torch.testing.assert_close(scheduler.timesteps, miles.timesteps.float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("num_steps", [4, 1])
def test_stock_diffusers_samples_the_student_as_miles_does(trained, num_steps):
    export = trained["exports"][num_steps]
    stock = _stock_latents(export, init_seed=7, renoise_seed=11)
    ours = _miles_latents(export, 7, 11, FlowNoiseSchedule(num_steps, 3.0), "dmd2")
    assert stock.shape == LATENT and torch.isfinite(stock).all()
    if num_steps == 1:
        # one step from σ = 1: x0 = x − v at timestep 1000, the same floats on both sides
        assert torch.equal(stock, ours)
    else:
        # diffusers rounds the timesteps σ·1000 in float32, miles in float64 (at most 6e-5 apart)
        torch.testing.assert_close(stock, ours, rtol=0, atol=1e-5)
        # the re-noise matters: another global seed gives another sample
        assert not torch.allclose(_stock_latents(export, 7, 12), stock, atol=1e-3)


def test_another_step_count_samples_with_a_plain_lcm_scheduler_and_sigmas(trained):
    """The documented way to sample S' ≠ S steps: the static scheduler shifts the passed linspace(1, 1/S', S')."""
    from diffusers import FlowMatchLCMScheduler, StableDiffusion3Pipeline

    export = trained["exports"][4]
    pipe = StableDiffusion3Pipeline.from_pretrained(export)
    pipe.scheduler = FlowMatchLCMScheduler(shift=3.0)
    pipe.set_progress_bar_config(disable=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        stock = pipe(
            PROMPTS,
            sigmas=[1.0, 0.5],
            guidance_scale=1.0,
            generator=torch.Generator().manual_seed(1),
            output_type="latent",
        ).images
    torch.testing.assert_close(
        stock, _miles_latents(export, 1, 2, FlowNoiseSchedule(2, 3.0), "dmd2"), rtol=0, atol=1e-5
    )


def test_the_student_changed_in_training(trained):
    from diffusers import SD3Transformer2DModel

    trained_weights = SD3Transformer2DModel.from_pretrained(trained["exports"][4] / "transformer").state_dict()
    initial = SD3Transformer2DModel.from_pretrained(trained["pipeline"] / "transformer").state_dict()
    assert not torch.equal(trained_weights["proj_out.weight"], initial["proj_out.weight"])


def test_an_euler_student_keeps_the_euler_scheduler_on_its_own_grid(trained, tmp_path):
    export = tmp_path / "euler"
    shutil.copytree(trained["exports"][4], export)
    write_sampling_schedule(export, num_steps=3, shift=3.0, step_rule="euler", stock_scheduler=True)
    assert json.loads((export / "model_index.json").read_text())["scheduler"] == [
        "diffusers",
        "FlowMatchEulerDiscreteScheduler",
    ]
    stock = _stock_latents(export, init_seed=3, renoise_seed=0)
    ours = _miles_latents(export, 3, 0, FlowNoiseSchedule(3, 3.0), "euler")
    torch.testing.assert_close(stock, ours, rtol=0, atol=1e-5)


def test_explicit_timesteps_sample_through_sigmas(trained, tmp_path):
    export = tmp_path / "explicit"
    shutil.copytree(trained["exports"][4], export)
    timesteps = [1000.0, 800.0, 350.0]
    write_sampling_schedule(
        export, num_steps=3, shift=3.0, step_rule="dmd2", timesteps=timesteps, stock_scheduler=True
    )
    assert stock_sampling_kwargs(export) == {
        "sigmas": [1.0, 0.8, 0.35],
        "guidance_scale": 1.0,
        "height": 16,
        "width": 16,
    }
    stock = _stock_latents(export, init_seed=5, renoise_seed=6)
    ours = _miles_latents(export, 5, 6, FlowNoiseSchedule(3, 3.0, timesteps=timesteps), "dmd2")
    torch.testing.assert_close(stock, ours, rtol=0, atol=1e-5)


def test_stock_kwargs_refuse_a_teacher_and_an_export_without_the_stock_scheduler(trained, tmp_path):
    with pytest.raises(ValueError, match="holds no student schedule"):
        stock_sampling_kwargs(trained["pipeline"])
    old = tmp_path / "old"
    shutil.copytree(trained["pipeline"], old)
    write_sampling_schedule(old, num_steps=4, shift=3.0, step_rule="dmd2")  # private keys only, as before
    with pytest.raises(ValueError, match="FlowMatchEulerDiscreteScheduler config, but the student's 'dmd2' rule"):
        stock_sampling_kwargs(old)


def test_the_digits_family_keeps_its_euler_scheduler_and_loads(tmp_path):
    from miles.models.digits import DigitsFamily, init_digits_pipeline
    from miles.models.digits_pipeline import DigitsPipeline

    path = init_digits_pipeline(tmp_path / "digits", num_layers=1, num_attention_heads=2, attention_head_dim=8)
    write_sampling_schedule(
        path, num_steps=4, shift=3.0, step_rule="dmd2", stock_scheduler=DigitsFamily.stock_scheduler
    )
    pipe = DigitsPipeline.from_pretrained(path)
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert pipe.sampling_defaults["num_inference_steps"] == 4 and pipe.sampling_defaults["step_rule"] == "dmd2"
