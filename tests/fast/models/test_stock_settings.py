"""Every family at its stock settings (issue 30, item 13), checked against diffusers 0.42.1 on the tiny pipelines.

(a) ``stock_sampling_kwargs`` carries the size a student was trained at, so the stock pipeline samples an export as
miles does without being told the size; (b) ``--dmd2-teacher-guidance-scale`` defaults to the stock pipeline's own
default (read from the installed pipeline class's signature), shown in the dry run; (c) the Qwen-Image teacher's
CFG carries the stock sampler's per-token norm rescale; (d) a FLUX.1-dev teacher (embedded guidance) makes no one
encode a negative prompt; (e) the sd3 flow shift is its scheduler config's; (f) the negative prompt defaults to the
stock one (Qwen-Image ``" "``) and the rank that encodes it says which. No Ray: argument parsing, the families and
the stock pipelines in this process.
"""

import inspect
import json
import logging
import shutil
from functools import partial

import pytest
import torch

from miles.driver.plan import log_plan, work_per_rank
from miles.models import get_model_family
from miles.models.packed_dit import unpack_latents
from miles.models.sampling_schedule import stock_sampling_kwargs, write_sampling_schedule
from miles.models.stock_defaults import write_sample_size
from miles.utils.sampling import FlowNoiseSchedule, denoise
from tests.support.arguments import parsed_with_defaults, validated
from tests.support.sd3_t5 import tiny_sd3_t5_pipeline
from tests.support.tiny_pipelines import write_tiny_flux, write_tiny_flux2_klein, write_tiny_qwen_image, write_tiny_wan
from tests.support.trainer import make_pipeline

PROMPTS = ["a red square", "two green dots"]
# sizes none of the stock pipelines samples by default (theirs: SD3 the transformer's, 1024², 81 × 480 × 832)
SIZES = {"qwen_image": (32, 32), "flux": (32, 32), "flux2": (32, 64), "wan": (5, 16, 32)}
# the stock pipeline class and the call keyword of its guidance scale, per family
STOCK = {
    "sd3": ("StableDiffusion3Pipeline", "guidance_scale"),
    "qwen_image": ("QwenImagePipeline", "true_cfg_scale"),
    "flux": ("FluxPipeline", "guidance_scale"),
    "flux2": ("Flux2KleinPipeline", "guidance_scale"),
    "wan": ("WanPipeline", "guidance_scale"),
}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    root = tmp_path_factory.mktemp("stock_settings")
    paths = {
        "sd3": tiny_sd3_t5_pipeline(root / "sd3"),
        "qwen_image": write_tiny_qwen_image(root / "qwen_image"),
        "flux": write_tiny_flux(root / "flux", variant="dev"),
        "flux_schnell": write_tiny_flux(root / "flux_schnell", variant="schnell"),
        "flux2": write_tiny_flux2_klein(root / "flux2"),
        "flux2_distilled": write_tiny_flux2_klein(root / "flux2_distilled", distilled=True),
        "wan": write_tiny_wan(root / "wan"),
        "digits": make_pipeline(root / "digits"),
    }
    for name, path in paths.items():
        size = SIZES.get(name.split("_distilled")[0].split("_schnell")[0])
        if size is not None:
            write_sample_size(path, size)
    return paths


def _dmd2(pipeline, *extra: str) -> list[str]:
    return [
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "1", "--rollout-batch-size", "4",
        "--dmd2-critic-steps-per-rollout", "2", *extra,
    ]  # fmt: skip


# ---- (a) the stock call samples an export at the size it was trained at ----


def _tokens_to_latents(shape):
    """The re-noise the LCM step draws in the packed token layout, as miles' latents of ``shape`` ``(B, C, H, W)``."""
    return lambda draw: unpack_latents(draw, shape[2], shape[3])


def _layout(name: str, latent: tuple[int, ...]):
    """``(re-noise shape the stock LCM step draws, its map to miles' latents, the stock output's map from miles')``."""
    batch = len(PROMPTS)
    if name in ("qwen_image", "flux"):
        channels, height, width = latent
        packed = (batch, height * width // 4, channels * 4)
        return packed, _tokens_to_latents((batch, *latent)), lambda family, x: x
    if name == "flux2":
        channels, height, width = latent
        tokens = (batch, height * width, channels)
        return tokens, lambda d: d.permute(0, 2, 1).reshape(batch, *latent), lambda family, x: family.to_vae_latents(x)
    return (batch, *latent), lambda d: d, lambda family, x: x  # sd3, wan: the latents themselves


def _stock_output(name: str, out, latent: tuple[int, ...]) -> torch.Tensor:
    if name == "wan":
        return out.frames
    if name in ("qwen_image", "flux"):
        return unpack_latents(out.images, latent[1], latent[2])
    return out.images


@pytest.mark.parametrize("name", ["sd3", "qwen_image", "flux", "flux2", "wan"])
def test_the_stock_call_samples_an_export_at_its_trained_size_as_miles_does(pipelines, tmp_path, name):
    """The export of a 2-step DMD2 student (the tiny pipeline's own weights) called with ``stock_sampling_kwargs``
    alone: the same noise gives miles' latents. Before the fix FLUX.2-klein and Wan had no size in the keywords and
    sampled 1024² / 81 × 480 × 832."""
    import diffusers

    export = tmp_path / "export"
    shutil.copytree(pipelines[name], export)
    family = get_model_family(export)
    write_sampling_schedule(
        export,
        num_steps=2,
        shift=3.0,
        step_rule="dmd2",
        stock_scheduler=True,
        stock_config=family.stock_scheduler_config,
    )
    call = stock_sampling_kwargs(export)
    shape = family.image_shape(export)
    size = {"height": shape[-3], "width": shape[-2], **({"num_frames": shape[0]} if len(shape) == 4 else {})}
    assert {key: call[key] for key in size} == size
    if name in SIZES:
        assert tuple(SIZES[name]) == ((call["num_frames"],) if name == "wan" else ()) + (call["height"], call["width"])

    latent = family.latent_shape(export)
    draw_shape, to_latents, to_stock = _layout(name, latent)
    pipe = getattr(diffusers, STOCK[name][0]).from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)  # FlowMatchLCMScheduler's re-noise comes from the global RNG
        out = pipe(prompt=PROMPTS, generator=torch.Generator().manual_seed(7), output_type="latent", **call)
    stock = _stock_output(name, out, latent)

    noise = torch.randn(len(PROMPTS), *latent, generator=torch.Generator().manual_seed(7))
    renoise = torch.Generator().manual_seed(11)
    draws = [to_latents(torch.randn(draw_shape, generator=renoise)) for _ in range(2)]
    cond = family.encode_prompts(family.load_text_encoder(export), PROMPTS)
    ours = denoise(
        family, family.load_denoiser(export), noise, cond, FlowNoiseSchedule(2, 3.0),
        fresh_noise=lambda k: draws[k], record=False,
    ).final  # fmt: skip
    assert torch.isfinite(stock).all()
    torch.testing.assert_close(stock, to_stock(family, ours), rtol=0, atol=1e-5)


# ---- (b) the teacher's guidance scale defaults to the stock pipeline's ----


@pytest.mark.parametrize(
    "name, expected",
    [("sd3", 7.0), ("qwen_image", 4.0), ("flux", 3.5), ("flux2", 4.0), ("wan", 5.0)],
)
def test_the_teacher_scale_defaults_to_the_stock_pipelines_own(pipelines, name, expected):
    import diffusers

    class_name, keyword = STOCK[name]
    stock_default = inspect.signature(getattr(diffusers, class_name).__call__).parameters[keyword].default
    assert stock_default == expected  # diffusers 0.42.1's default is the figure the docs table gives
    args = validated(_dmd2(pipelines[name]))
    assert args.dmd2_teacher_guidance_scale == expected
    assert args.dmd2_teacher_guidance_origin.startswith(
        f"--dmd2-teacher-guidance-scale {expected:g}: the {name} family's stock scale"
    )
    # an explicit flag always wins
    assert validated(_dmd2(pipelines[name], "--dmd2-teacher-guidance-scale", "2")).dmd2_teacher_guidance_scale == 2


@pytest.mark.parametrize("name", ["flux_schnell", "flux2_distilled", "digits"])
def test_a_teacher_without_stock_guidance_keeps_scale_1(pipelines, name):
    """schnell and a step-distilled klein run no guidance (preflight refuses more than 1); digits keeps the scale
    its recipe's figures were measured at."""
    args = validated(_dmd2(pipelines[name]))
    assert args.dmd2_teacher_guidance_scale == 1.0 and args.encode_negative_prompt is False
    assert "none (scale 1)" in args.dmd2_teacher_guidance_origin


def test_the_dry_run_prints_the_teachers_scale_form_and_negative_prompt(pipelines, caplog):
    with caplog.at_level(logging.INFO, logger="miles.driver.plan"):
        log_plan(validated(_dmd2(pipelines["flux"])))
        log_plan(validated(_dmd2(pipelines["qwen_image"])))
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("teacher guidance")]
    assert lines == [
        "teacher guidance: --dmd2-teacher-guidance-scale 3.5: the flux family's stock scale (its pipeline's default); "
        "embedded: the scale is the teacher's guidance input, one forward, no negative prompt",
        "teacher guidance: --dmd2-teacher-guidance-scale 4: the qwen_image family's stock scale (its pipeline's "
        "default); true CFG u + w·(c − u) over two branches, with the stock per-token norm rescale "
        "(--dmd2-teacher-cfg-norm-rescale: the qwen_image family's), against the negative prompt ' ' (the "
        "qwen_image family's (its stock pipeline's default))",
    ]


# ---- (c) the Qwen-Image teacher's CFG means what the stock true_cfg_scale means ----


def test_the_qwen_teacher_cfg_is_the_stock_pipelines_norm_rescaled_cfg(pipelines):
    """Two Euler steps of the stock ``QwenImagePipeline`` at ``true_cfg_scale`` 4 against ``" "`` (a static shift-2
    scheduler: σ = 1, 2/3, 0) equal the same steps on the family's ``guided_velocity(..., norm_rescale=True)``; plain
    CFG is another sample."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    path = pipelines["qwen_image"]
    family = get_model_family(path)
    pipe = QwenImagePipeline.from_pretrained(path)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=2.0)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt=PROMPTS, negative_prompt=[" "] * len(PROMPTS), true_cfg_scale=4.0, num_inference_steps=2,
        height=32, width=32, generator=torch.Generator().manual_seed(3), output_type="latent",
    ).images  # fmt: skip
    stock = unpack_latents(out, 4, 4)

    encoder = family.load_text_encoder(path)
    cond = family.encode_prompts(encoder, PROMPTS)
    neg = family.encode_prompts(encoder, [" "] * len(PROMPTS))
    denoiser = family.load_denoiser(path)
    predict = partial(family.predict_velocity, denoiser)
    schedule = FlowNoiseSchedule(2, 2.0)

    def sample(**rescale):
        x = torch.randn(len(PROMPTS), 4, 4, 4, generator=torch.Generator().manual_seed(3))
        for k in range(2):
            timestep = torch.full((len(PROMPTS),), float(schedule.timesteps[k]))
            v = family.guided_velocity(predict, x, timestep, cond, neg, 4.0, **rescale)
            x = x + float(schedule.sigmas[k + 1] - schedule.sigmas[k]) * v
        return x

    with torch.no_grad():
        rescaled, plain = sample(norm_rescale=True), sample()
    torch.testing.assert_close(rescaled, stock, rtol=0, atol=1e-5)
    assert (plain - stock).abs().max() > 1e-2


def test_the_norm_rescale_defaults_on_for_qwen_only_and_is_refused_elsewhere(pipelines):
    from miles.methods import get_method
    from miles.utils.validation import ArgumentValidationError

    assert validated(_dmd2(pipelines["qwen_image"])).dmd2_teacher_cfg_norm_rescale is True
    off = validated(_dmd2(pipelines["qwen_image"], "--no-dmd2-teacher-cfg-norm-rescale"))
    assert off.dmd2_teacher_cfg_norm_rescale is False and "without the stock" in off.dmd2_teacher_guidance_origin
    assert validated(_dmd2(pipelines["sd3"])).dmd2_teacher_cfg_norm_rescale is False
    family = get_model_family(pipelines["sd3"])
    with pytest.raises(ValueError, match="sd3 family's stock sampler has no CFG norm rescale"):
        family.guided_velocity(lambda *a: None, torch.zeros(1), torch.zeros(1), {}, {}, 2.0, norm_rescale=True)
    args = validated(_dmd2(pipelines["sd3"], "--dmd2-teacher-cfg-norm-rescale"))
    with pytest.raises(ArgumentValidationError, match="--dmd2-teacher-cfg-norm-rescale is the Qwen-Image sampler's"):
        get_method(args).check_inputs(args)  # preflight's method check, before Ray


def test_dmd2_scoring_applies_the_rescale_to_the_teacher_only_when_asked(pipelines):
    """The scoring hook on the tiny Qwen-Image teacher and critic: with the setting the teacher's velocity is the
    norm-rescaled one (its x0 = x_σ − σ·v), without it the plain one; the critic is never guided."""
    from miles.backends.fsdp_utils.loss_hub.dmd2 import predict_teacher_and_critic_x0
    from miles.backends.fsdp_utils.loss_hub.dmd2_types import DMD2Pair
    from miles.backends.fsdp_utils.loss_hub.types import TrainContext
    from miles.models.qwen_image import QwenImageFamily
    from tests.support.trainer import dmd2_args

    path = pipelines["qwen_image"]

    class Recording(QwenImageFamily):
        calls: list = []

        def guided_velocity(self, predict, latents, timestep, cond, neg_cond, guidance_scale, **kwargs):
            v = super().guided_velocity(predict, latents, timestep, cond, neg_cond, guidance_scale, **kwargs)
            self.calls.append({"kwargs": kwargs, "latents": latents, "v": v})
            return v

    family = Recording(path)
    encoder = family.load_text_encoder(path)
    cond = family.encode_prompts(encoder, PROMPTS)
    neg = family.encode_prompts(encoder, [" "])
    x0 = torch.randn(len(PROMPTS), 4, 4, 4, generator=torch.Generator().manual_seed(5))
    pairs = [
        DMD2Pair(sample_index=i, x0=x0[i], pos_cond={k: v[i] for k, v in cond.items()},
                 neg_cond={k: v[0] for k, v in neg.items()}, latent=x0[i], sigma=1.0, timestep=1000.0, step_index=0)
        for i in range(len(PROMPTS))
    ]  # fmt: skip
    scores = {}
    for rescale in (True, False):
        args = dmd2_args(
            seed=1, fsdp_flow_shift=3.0, micro_batch_size=2, dmd2_teacher_guidance_scale=4.0,
            dmd2_teacher_cfg_norm_rescale=rescale, dmd2_min_timestep_ratio=0.02, dmd2_max_timestep_ratio=0.98,
        )  # fmt: skip
        ctx = TrainContext(
            args=args, models={"transformer": family.load_denoiser(path)},
            teacher_models={"transformer": family.load_denoiser(path)}, external_data={}, family=family,
            device=torch.device("cpu"), dtype=torch.float32, rollout_id=0,
        )  # fmt: skip
        family.calls.clear()
        scores[rescale] = predict_teacher_and_critic_x0(ctx, pairs)
        (call,) = family.calls
        assert call["kwargs"] == ({"norm_rescale": True} if rescale else {})
        sigma = scores[rescale]["sigma"].float().view(-1, 1, 1, 1)
        torch.testing.assert_close(scores[rescale]["x0_real"], call["latents"] - sigma * call["v"], rtol=0, atol=1e-6)
    torch.testing.assert_close(scores[True]["x0_fake"], scores[False]["x0_fake"], rtol=0, atol=0)
    assert (scores[True]["x0_real"] - scores[False]["x0_real"]).abs().max() > 1e-3


# ---- (d) FLUX.1-dev's embedded guidance encodes no negative prompt ----


def test_an_embedded_guidance_teacher_encodes_no_negative_prompt(pipelines):
    """FLUX.1-dev's scale is its guidance input: no unconditional branch reads a negative cond, so the engine is not
    asked for one (before the fix any scale > 1 asked for it)."""
    explicit = validated(_dmd2(pipelines["flux"], "--dmd2-teacher-guidance-scale", "3.5"))
    assert explicit.encode_negative_prompt is False
    dev = validated(_dmd2(pipelines["flux"]))
    assert dev.dmd2_teacher_guidance_scale == 3.5 and dev.dmd2_teacher_guidance_form == "embedded"
    assert dev.encode_negative_prompt is False
    # one teacher forward per scoring micro-batch, where a true-CFG teacher runs [uncond; cond]
    teacher = dict((phase.phase, phase) for _, phase in work_per_rank(dev))["scoring: teacher"]
    assert teacher.batch == dev.micro_batch_size
    sd3 = validated(_dmd2(pipelines["sd3"]))
    assert sd3.encode_negative_prompt is True and sd3.dmd2_teacher_guidance_form == "true CFG"
    assert dict((phase.phase, phase) for _, phase in work_per_rank(sd3))["scoring: teacher"].batch == 2


# ---- (e) the sd3 flow shift is its scheduler's ----


def test_the_sd3_flow_shift_is_its_scheduler_configs_shift(pipelines, tmp_path):
    path = tmp_path / "sd3"
    shutil.copytree(pipelines["sd3"], path)
    config_path = path / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "shift": 5.0}))
    args = parsed_with_defaults(_dmd2(path))
    assert args.diffusion_flow_shift == args.fsdp_flow_shift == 5.0
    assert args.flow_shift_origin["--fsdp-flow-shift"].startswith("5: the sd3 family's")
    assert parsed_with_defaults(_dmd2(path, "--fsdp-flow-shift", "2")).fsdp_flow_shift == 2.0
    # an SD3 export's dynamic stock scheduler: the student's own k, not e^mu of the config's constant mu
    family = get_model_family(path)
    write_sampling_schedule(
        path,
        num_steps=4,
        shift=4.0,
        step_rule="dmd2",
        stock_scheduler=True,
        stock_config=family.stock_scheduler_config,
    )
    assert json.loads(config_path.read_text())["use_dynamic_shifting"] and family.flow_shift(path) == 4.0


# ---- (f) the negative prompt defaults to the stock one, and the encoding rank says which ----


@pytest.mark.parametrize("name, expected", [("qwen_image", " "), ("sd3", ""), ("flux2", ""), ("wan", "")])
def test_the_negative_prompt_defaults_to_the_stock_pipelines(pipelines, name, expected):
    args = validated(_dmd2(pipelines[name]))
    assert args.negative_prompt == expected and args.encode_negative_prompt is True
    assert args.negative_prompt_origin == f"the {name} family's (its stock pipeline's default)"
    given = validated(_dmd2(pipelines[name], "--negative-prompt", "blurry"))
    assert given.negative_prompt == "blurry" and given.negative_prompt_origin == "set on the command line"


def test_the_rank_that_encodes_the_negative_prompt_logs_it_and_the_cache_defaults_alike(pipelines, tmp_path, caplog):
    from safetensors.torch import load_file

    from miles.rollout.conditioning import PromptConditioner
    from miles.rollout.prompt_cache import main as prompt_cache
    from tests.support.rollout import engine_spec

    path = pipelines["qwen_image"]
    family = get_model_family(path)
    args = validated(_dmd2(path))
    with caplog.at_level(logging.INFO, logger="miles.rollout.conditioning"):
        negative = PromptConditioner(engine_spec(args), family, path).negative()
    assert "encoding the negative prompt ' ': the qwen_image family's (its stock pipeline's default)" in caplog.text
    expected = family.encode_prompts(family.load_text_encoder(path), [" "])
    torch.testing.assert_close(negative, {key: value[0] for key, value in expected.items()}, rtol=0, atol=0)

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    assert prompt_cache([str(path), str(prompts), str(tmp_path / "cache")]) == 0
    assert json.loads((tmp_path / "cache" / "prompt_cache.json").read_text())["negative_prompt"] == " "
    cached = load_file(tmp_path / "cache" / "negative.safetensors")
    torch.testing.assert_close({key: value.float() for key, value in cached.items()}, negative, rtol=0, atol=0)
