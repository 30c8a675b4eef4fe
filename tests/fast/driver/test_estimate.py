"""The time estimate of ``--dry-run`` (``miles.driver.estimate``): its forward count is the trainer's forward, each
phase is that count times the phase's forwards and backwards per rank, it names the GPU it assumes and gives no
seconds for a float32 run; every family that declares a memory layout gets one (the tiny FLUX.1 and Wan pipelines
here), with the memory plan beside it, and the planner knows no family."""

import logging

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from miles.driver.arguments import parse_args
from miles.driver.estimate import ASSUMED_MFU, PEAK_TFLOPS, estimate_rollout, log_estimate
from miles.driver.plan import log_plan, work_per_rank
from miles.models import get_model_family
from tests.support.trainer import make_pipeline


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


def _argv(pipeline, *extra) -> list[str]:
    return ["--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
            "--prompt-data", "unused.jsonl", "--num-rollout", "10", "--rollout-batch-size", "8",
            "--actor-num-gpus-per-node", "2", "--micro-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2",
            "--dmd2-teacher-guidance-scale", "3", *extra]  # fmt: skip


def test_the_meta_device_count_is_the_trainers_forward(pipeline):
    family = get_model_family(pipeline)
    tokens = family.text_config(pipeline)["max_length"]
    flops, params = family.flops_per_sample(pipeline)
    assert family.tokens_per_sample(pipeline) == (16, tokens)  # 8 × 8 pixels in patches of 2 × 2
    model = family.load_denoiser(pipeline)
    config = model.config
    cond = {
        "encoder_hidden_states": torch.randn(1, tokens, config.joint_attention_dim),
        "pooled_projections": torch.randn(1, config.pooled_projection_dim),
    }
    # The math attention kernel is counted by its matmuls; the CPU's fused kernel is not counted at all.
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        family.predict_velocity(model, torch.randn(1, *family.latent_shape(pipeline)), torch.full((1,), 500.0), cond)
    assert flops == counter.get_total_flops() > 0
    assert params == sum(p.numel() for p in model.parameters())


def test_each_phase_is_its_forwards_and_backwards_times_the_forward(pipeline):
    args = parse_args(_argv(pipeline, "--train-dtype", "bfloat16"))
    found = estimate_rollout(args)
    expected = [
        (phase.forwards + 2 * phase.backwards) * phase.batch * found.forward_flops for _, phase in work_per_rank(args)
    ]
    assert [flops for _, _, flops in found.phases] == expected
    # No CUDA device here: an H100 is assumed, and named (test_a_float32_run below).
    assert (found.mfu, found.device, found.peak_tflops) == (ASSUMED_MFU, "H100", PEAK_TFLOPS["H100"])
    assert found.seconds == pytest.approx(sum(expected) / (found.mfu * found.peak_tflops * 1e12))
    # Gradient checkpointing recomputes one forward per backward.
    checkpointed = estimate_rollout(
        parse_args(_argv(pipeline, "--train-dtype", "bfloat16", "--gradient-checkpointing"))
    )
    assert [flops for _, _, flops in checkpointed.phases] == [
        (phase.forwards + 3 * phase.backwards) * phase.batch * found.forward_flops for _, phase in work_per_rank(args)
    ]


def test_a_float32_run_gets_its_flops_and_no_bf16_seconds_and_the_gpu_is_named(pipeline, caplog):
    args = parse_args(_argv(pipeline))  # --train-dtype float32, the default
    found = estimate_rollout(args)
    assert found.compute_dtype == torch.float32 and found.peak_tflops is None and found.seconds is None
    assert found.flops == estimate_rollout(parse_args(_argv(pipeline, "--train-dtype", "bfloat16"))).flops
    with caplog.at_level(logging.INFO, logger="miles.driver.estimate"):
        log_estimate(args, 10)
    text = caplog.text
    assert "float32 compute: no seconds, the peaks are dense bf16 figures" in text
    assert "the GPU would be H100 (assumed: no known CUDA device here; --gpu-type names another)" in text
    assert " s\n" not in text and "TFLOP for 10 rollouts" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="miles.driver.estimate"):
        log_estimate(parse_args(_argv(pipeline, "--train-dtype", "bfloat16")), 10)
    assert "dense bf16 peak, GPU H100 (assumed: no known CUDA device here; --gpu-type names another)" in caplog.text


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_the_dry_run_of_a_stock_familys_tiny_pipeline_prints_a_memory_plan_and_a_time_estimate(tmp_path, caplog, name):
    """Wan had no plan and FLUX.1's estimate printed an internal error; each family now says its own layout."""
    from miles.models.stock_defaults import write_sample_size
    from tests.support.tiny_pipelines import write_tiny_flux, write_tiny_wan

    if name == "wan":
        path, size, tokens = write_tiny_wan(tmp_path / name), (5, 32, 32), "8 image + 512 text tokens"
    else:
        path, size, tokens = write_tiny_flux(tmp_path / name), (32, 32), "4 image + 512 text tokens"
    write_sample_size(path, size)
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat"}\n')
    argv = _argv(path, "--prompt-data", str(tmp_path / "p.jsonl"), "--train-dtype", "bfloat16", "--dry-run")
    argv[argv.index("--dmd2-teacher-guidance-scale") + 1] = "1"
    with caplog.at_level(logging.INFO):
        log_plan(parse_args(argv))
    text = caplog.text
    assert f"memory per GPU, DP rank 0 of 2: bfloat16 compute, {tokens} per sample" in text
    assert "memory plan: not available" not in text and "time estimate: none" not in text
    assert "GFLOP per sample (" in text and f"{tokens}); at an assumed 30% MFU" in text
    assert "about" in text and "s per rollout" in text


def test_the_gpu_the_estimate_assumes_is_a_flag(pipeline, caplog):
    # Issue 34 item 5: the estimate names the GPU it assumes, and --gpu-type chooses it (a login node has none).
    args = parse_args(_argv(pipeline, "--train-dtype", "bfloat16", "--gpu-type", "A100"))
    found = estimate_rollout(args)
    assert (found.device, found.peak_tflops) == ("A100", PEAK_TFLOPS["A100"])
    h100 = estimate_rollout(parse_args(_argv(pipeline, "--train-dtype", "bfloat16", "--gpu-type", "H100")))
    assert found.seconds == pytest.approx(h100.seconds * PEAK_TFLOPS["H100"] / PEAK_TFLOPS["A100"])
    with caplog.at_level(logging.INFO, logger="miles.driver.estimate"):
        log_estimate(args, 10)
    assert "of the A100's 312 TFLOP/s dense bf16 peak, GPU A100 (--gpu-type)" in caplog.text
