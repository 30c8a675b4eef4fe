"""Wan 2.2 A14B's two experts on a tiny two-expert ``WanPipeline`` (``write_tiny_wan(..., boundary_ratio=0.875)``:
``transformer`` for timesteps ≥ 875, ``transformer_2`` below; nothing downloaded).

The frozen teacher scores each sample with the expert the stock pipeline runs at its timestep (value parity with
``WanPipeline.__call__``'s own forwards, also for a batch that mixes both experts, and sharded over 2 gloo ranks
whose batches need different experts); the planner counts both experts; a DMD2 run on 2 CPU ranks for 2 rollouts
trains one student network whose export the stock ``WanPipeline`` opens as a one-network pipeline and samples as
miles does. Clips are 5 frames of 16 × 32 pixels: latents ``(4, 2, 2, 4)``.
"""

import json
import math

import pytest
import torch
import torch.multiprocessing as mp

from miles.backends.fsdp_utils.model import load_frozen_denoiser
from miles.driver.memory_plan import GroupSpec, LoraSpec, PlanSetting, plan_group, second_expert_config
from miles.models import get_model_family
from miles.models.experts import ExpertSwitch, load_teacher
from miles.models.memory import transformer_config
from miles.models.sampling_schedule import SCHEDULE_KEYS, stock_sampling_kwargs
from miles.models.stock_defaults import write_sample_size
from miles.utils.sampling import FlowNoiseSchedule, denoise
from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.process_group import rank_scores_with_sharded_experts
from tests.support.tiny_pipelines.wan import A14B_BOUNDARY_RATIO, write_tiny_wan
from tests.support.trainer import free_port

PROMPTS = ["a red square", "a blue circle", "two green dots", "a yellow line"]
SIZE = (5, 16, 32)
LATENT = (4, 2, 2, 4)


def _pipeline(folder):
    path = write_tiny_wan(folder, boundary_ratio=A14B_BOUNDARY_RATIO)
    write_sample_size(path, SIZE)
    return path


@pytest.fixture(scope="module")
def wan2(tmp_path_factory):
    return _pipeline(tmp_path_factory.mktemp("wan2") / "wan2")


@pytest.fixture(scope="module")
def stock_forwards(wan2):
    """Every forward of a 6-step stock ``WanPipeline`` call without CFG, as ``(expert, inputs, output)``."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(wan2)
    pipe.set_progress_bar_config(disable=True)
    calls = []
    for name in ("transformer", "transformer_2"):

        def record(module, args, kwargs, output, name=name):
            inputs = {key: kwargs[key].clone() for key in ("hidden_states", "timestep", "encoder_hidden_states")}
            calls.append((name, inputs, output[0].clone()))

        getattr(pipe, name).register_forward_hook(record, with_kwargs=True)
    pipe(PROMPTS[:2], num_inference_steps=6, guidance_scale=1.0, output_type="latent", num_frames=SIZE[0],
         height=SIZE[1], width=SIZE[2], generator=torch.Generator().manual_seed(0))  # fmt: skip
    return calls


def test_the_family_reads_the_boundary_and_the_switch_takes_the_stock_pipelines_side(wan2, tmp_path):
    family = get_model_family(wan2)
    assert family.expert_boundary(wan2) == 875.0 and family.latent_shape(wan2) == LATENT
    switch = load_frozen_denoiser(family, str(wan2), None, torch.device("cpu"), torch.float32)
    assert isinstance(switch, ExpertSwitch) and switch.boundary == 875.0
    # WanPipeline.__call__: `t >= boundary_timestep` runs transformer; per token, the clip's largest timestep
    assert switch.first_expert_rows(torch.tensor([875.0, 874.99, 1000.0, 0.0])).tolist() == [True, False, True, False]
    assert switch.first_expert_rows(torch.tensor([[0.0, 900.0], [0.0, 800.0]])).tolist() == [True, False]
    index = json.loads((wan2 / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": None}))
    with pytest.raises(ValueError, match="boundary_ratio None"):
        family.expert_boundary(tmp_path)


def test_the_teacher_equals_the_stock_pipelines_expert_at_every_step_and_in_a_mixed_batch(wan2, stock_forwards):
    family = get_model_family(wan2)
    teacher = load_frozen_denoiser(family, str(wan2), None, torch.device("cpu"), torch.float32)
    experts = [name for name, _, _ in stock_forwards]
    steps = [float(inputs["timestep"][0]) for _, inputs, _ in stock_forwards]
    # the 6-step call at flow shift 3 runs both experts, switching where the timestep drops below 875
    assert experts == ["transformer" if t >= 875.0 else "transformer_2" for t in steps]
    assert set(experts) == {"transformer", "transformer_2"}

    def velocity(latents, timestep, cond):
        with torch.no_grad():
            return family.predict_velocity(teacher, latents, timestep, {"encoder_hidden_states": cond})

    for _, inputs, output in stock_forwards:
        ours = velocity(inputs["hidden_states"], inputs["timestep"].float(), inputs["encoder_hidden_states"])
        torch.testing.assert_close(ours, output.float(), rtol=0, atol=1e-6)
    # all steps in one batch: each sample through its own expert
    mixed = velocity(
        torch.cat([inputs["hidden_states"] for _, inputs, _ in stock_forwards]),
        torch.cat([inputs["timestep"].float() for _, inputs, _ in stock_forwards]),
        torch.cat([inputs["encoder_hidden_states"] for _, inputs, _ in stock_forwards]),
    )
    torch.testing.assert_close(
        mixed, torch.cat([output.float() for _, _, output in stock_forwards]), rtol=0, atol=1e-6
    )
    # the offline tools' whole teacher (the regression pairs' ODE) is the same pair of experts
    whole = load_teacher(family, wan2)
    assert isinstance(whole, ExpertSwitch) and whole.boundary == 875.0
    for _, inputs, output in stock_forwards[:: len(stock_forwards) - 1]:  # the first and the last step
        cond = {"encoder_hidden_states": inputs["encoder_hidden_states"]}
        with torch.no_grad():
            v = family.predict_velocity(whole, inputs["hidden_states"], inputs["timestep"].float(), cond)
        torch.testing.assert_close(v, output.float(), rtol=0, atol=1e-6)


def test_sharded_experts_score_ranks_that_need_different_experts(wan2, stock_forwards, tmp_path):
    """Rank 0's batch needs only ``transformer``, rank 1's both; each rank's velocity equals the unsharded one."""
    family = get_model_family(wan2)
    teacher = load_frozen_denoiser(family, str(wan2), None, torch.device("cpu"), torch.float32)
    high = [inputs for name, inputs, _ in stock_forwards if name == "transformer"][0]
    low = [inputs for name, inputs, _ in stock_forwards if name == "transformer_2"][-1]
    cases = []
    for parts in ([high], [low, high]):
        latents = torch.cat([p["hidden_states"][:1] for p in parts])
        timestep = torch.cat([p["timestep"][:1].float() for p in parts])
        cond = {"encoder_hidden_states": torch.cat([p["encoder_hidden_states"][:1] for p in parts])}
        with torch.no_grad():
            expected = family.predict_velocity(teacher, latents, timestep, cond)
        cases.append({"latents": latents, "timestep": timestep, "cond": cond, "expected": expected})
    torch.save(cases, tmp_path / "cases.pt")
    mp.get_context("forkserver").set_forkserver_preload(["tests.support.process_group"])
    args = (free_port(), str(wan2), str(tmp_path / "cases.pt"))
    mp.start_processes(rank_scores_with_sharded_experts, args=args, nprocs=2, join=True, start_method="forkserver")


def test_the_memory_plan_counts_both_teacher_experts(wan2):
    family = get_model_family(wan2)
    config = transformer_config(wan2)
    second = second_expert_config(family, str(wan2))
    assert second == json.loads((wan2 / "transformer_2" / "config.json").read_text())
    setting = PlanSetting(dp_size=2, compute_dtype=torch.bfloat16, image_tokens=8, text_tokens=512, family=family)
    one = plan_group(GroupSpec(role="critic", config=config, teacher=config), setting)
    two = plan_group(GroupSpec(role="critic", config=config, teacher=config, teacher_2=second), setting)
    assert two.frozen_numel == 2 * one.frozen_numel and two.frozen > one.frozen
    # the inference phase gathers both experts whole beside the critic (ZeRO-2-like default)
    assert two.gathered_inference - one.gathered_inference == one.frozen_numel * 2
    # a LoRA critic on a two-expert teacher holds its base and both experts (the teacher is never its base)
    lora = plan_group(
        GroupSpec(role="critic", config=config, teacher=config, teacher_2=second, lora=LoraSpec(2)), setting
    )
    assert lora.frozen_numel == 3 * one.frozen_numel
    assert second_expert_config(family, str(write_tiny_wan(wan2.parent / "one"))) is None


def _argv(root, out):
    wan = str(root / "wan2")
    return [
        "--loss-type", "dmd2", "--hf-checkpoint", wan, "--teacher-load", wan,
        "--prompt-data", str(root / "cache" / "prompts.jsonl"),
        "--negative-cond", str(root / "cache" / "negative.safetensors"),
        "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "4", "--micro-batch-size", "1",
        "--dmd2-critic-steps-per-rollout", "1", "--dmd2-teacher-guidance-scale", "2",
        "--diffusion-num-steps", "2", "--num-rollout", "2", "--lr", "1e-3", "--critic-lr", "1e-3",
        "--output-dir", str(out), "--save-hf", str(root / "student"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_cluster):
    from miles.rollout import prompt_cache

    root = tmp_path_factory.mktemp("wan2_dmd2")
    pipeline = _pipeline(root / "wan2")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert prompt_cache.main([str(pipeline), str(root / "prompts.jsonl"), str(root / "cache")]) == 0
    run_main(_argv(root, root / "full"))
    return {"root": root, "export": root / "student", "records": read_metrics(root / "full")}


def test_dmd2_trains_one_student_against_the_two_expert_teacher(run):
    actor = [r for r in run["records"] if "train/loss" in r]
    critic = [r for r in run["records"] if "train/critic-loss" in r]
    assert [r["rollout_id"] for r in actor] == [0, 1] and [r["rollout_id"] for r in critic] == [0, 1]
    assert all(r["train/dmd2_grad_abs_mean"] > 0 and r["train/x0_max_abs_diff"] < 1e-4 for r in actor)
    assert all(math.isfinite(r["train/critic-loss"]) for r in critic)


def test_the_stock_pipeline_samples_the_one_network_export_as_miles_does(run):
    from diffusers import WanPipeline, WanTransformer3DModel

    export, source = run["export"], run["root"] / "wan2"
    index = json.loads((export / "model_index.json").read_text())
    assert index["transformer_2"] == [None, None] and index["boundary_ratio"] is None
    assert not (export / "transformer_2").exists()
    # the source keeps its two experts (the export's files start as hard links to them)
    assert json.loads((source / "model_index.json").read_text())["boundary_ratio"] == A14B_BOUNDARY_RATIO
    pipe = WanPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer_2 is None and pipe.config.boundary_ratio is None
    call = stock_sampling_kwargs(export)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)  # FlowMatchLCMScheduler's re-noise comes from the global RNG in the stock call
        stock = pipe(prompt=PROMPTS, generator=torch.Generator().manual_seed(7), output_type="latent", **call).frames
    family = get_model_family(export)
    assert family.expert_boundary(export) is None
    noise = torch.randn(len(PROMPTS), *LATENT, generator=torch.Generator().manual_seed(7))
    renoise = torch.Generator().manual_seed(11)
    draws = [torch.randn(len(PROMPTS), *LATENT, generator=renoise) for _ in range(2)]
    cond = family.encode_prompts(family.load_text_encoder(export), PROMPTS)
    shift = float(json.loads((export / "scheduler" / "scheduler_config.json").read_text())[SCHEDULE_KEYS["shift"]])
    ours = denoise(
        family, family.load_denoiser(export), noise, cond, FlowNoiseSchedule(2, shift),
        fresh_noise=lambda k: draws[k], record=False,
    ).final  # fmt: skip
    torch.testing.assert_close(stock, ours, rtol=0, atol=1e-5)
    trained = WanTransformer3DModel.from_pretrained(export / "transformer").state_dict()
    initial = WanTransformer3DModel.from_pretrained(source / "transformer").state_dict()
    assert any(not torch.equal(trained[key], initial[key]) for key in initial)


def test_teacher_loras_are_refused_for_a_two_expert_teacher(wan2, tmp_path):
    """``--teacher-lora`` fuses into ``transformer/`` alone: a two-expert teacher would keep an unfused expert."""
    from argparse import Namespace

    from miles.models.teacher_lora import apply_teacher_loras

    args = Namespace(teacher_lora=["style"], teacher_load=str(wan2), diffusion_model_family=None, output_dir=tmp_path)
    with pytest.raises(ValueError, match="has two experts"):
        apply_teacher_loras(args)
    assert not any(tmp_path.iterdir())
