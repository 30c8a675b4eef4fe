"""The time estimate of ``--dry-run`` (``miles.driver.estimate``): its forward count is the trainer's forward, and
each phase is that count times the phase's forwards and backwards per rank."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from miles.driver.arguments import parse_args
from miles.driver.estimate import ASSUMED_MFU, PEAK_TFLOPS, estimate_rollout, forward_flops
from miles.driver.plan import work_per_rank
from miles.models import get_model_family
from tests.support.trainer import make_pipeline


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


def test_the_meta_device_count_is_the_trainers_forward(pipeline):
    family = get_model_family(pipeline)
    tokens = family.text_config(pipeline)["max_length"]
    flops, params = forward_flops(pipeline, family.latent_shape(pipeline), tokens)
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
    argv = ["--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
            "--prompt-data", "unused.jsonl", "--num-rollout", "10", "--rollout-batch-size", "8",
            "--actor-num-gpus-per-node", "2", "--micro-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2",
            "--dmd2-teacher-guidance-scale", "3"]  # fmt: skip
    args = parse_args(argv)
    found = estimate_rollout(args)
    expected = [
        (phase.forwards + 2 * phase.backwards) * phase.batch * found.forward_flops for _, phase in work_per_rank(args)
    ]
    assert [flops for _, _, flops in found.phases] == expected
    assert (found.mfu, found.peak_tflops) == (ASSUMED_MFU, PEAK_TFLOPS["H100"]) or torch.cuda.is_available()
    assert found.seconds == pytest.approx(sum(expected) / (found.mfu * found.peak_tflops * 1e12))
    # Gradient checkpointing recomputes one forward per backward.
    checkpointed = estimate_rollout(parse_args([*argv, "--gradient-checkpointing"]))
    assert [flops for _, _, flops in checkpointed.phases] == [
        (phase.forwards + 3 * phase.backwards) * phase.batch * found.forward_flops for _, phase in work_per_rank(args)
    ]
