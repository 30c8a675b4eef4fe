"""The memory planner (``miles.driver.memory_plan``): exact bytes against real modules and a real AdamW (full
weights and a peft LoRA), FSDP2 shards at 2 ranks, the fit decision, and the ``--dry-run`` table. The agreement
with the bytes a real run logs is checked where the suite already runs DMD2 (test_dmd2_e2e.py, test_dmd2_gan_e2e.py
and the tiny GPU check); a bad ``--gpu-memory-gb`` is a case of test_bad_inputs.py."""

import logging

import torch

from miles.driver.memory_plan import HEADROOM, GroupMemory, GroupSpec, LoraSpec, PlanSetting, plan_group, plan_run
from miles.models.lora import add_lora_adapter
from miles.models.memory import ActivationEstimate
from miles.models.precision import cast_buffers
from tests.support.trainer import make_pipeline

TINY_SD3 = {
    "_class_name": "SD3Transformer2DModel", "sample_size": 8, "patch_size": 2, "in_channels": 4, "out_channels": 4,
    "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 3, "joint_attention_dim": 32,
    "caption_projection_dim": 24, "pooled_projection_dim": 32, "pos_embed_max_size": 8,
}  # fmt: skip
SETTING = PlanSetting(dp_size=1, compute_dtype=torch.bfloat16, image_tokens=16, text_tokens=8)


def _real(config: dict) -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel.from_config(config)


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _adamw_state_bytes(model: torch.nn.Module) -> int:
    """The bytes of a real AdamW's state after one step on ``model``'s trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    return sum(value.numel() * value.element_size() for state in optimizer.state.values() for value in state.values())


def test_full_weights_count_the_real_modules_bytes_exactly():
    plan = plan_group(GroupSpec("critic", TINY_SD3, teacher=TINY_SD3, ema=True), SETTING)
    critic, teacher = _real(TINY_SD3), _real(TINY_SD3).to(torch.bfloat16)
    assert plan.parameters == plan.gradients == plan.ema == _nbytes(critic.parameters())  # float32 master
    assert plan.frozen == _nbytes(teacher.parameters())  # the teacher in the compute dtype
    assert plan.optimizer == _adamw_state_bytes(critic)  # two moments and a step count per tensor
    assert plan.trainable_numel == plan.frozen_numel == sum(p.numel() for p in critic.parameters())
    # the position-embedding buffer, whole on every rank, in the compute dtype in the critic too (as the trainer
    # stores it: miles.models.precision.cast_buffers)
    cast_buffers(critic, torch.bfloat16)
    assert plan.buffers == _nbytes(critic.buffers()) + _nbytes(teacher.buffers()) > 0


def test_a_lora_group_holds_one_base_in_the_compute_dtype_and_trains_only_its_adapter():
    spec = GroupSpec("critic", TINY_SD3, teacher=TINY_SD3, lora=LoraSpec(rank=4))
    plan = plan_group(spec, SETTING)
    model = add_lora_adapter(_real(TINY_SD3), "critic", 4)
    adapter = [p for p in model.parameters() if p.requires_grad]
    base = [p for p in model.parameters() if not p.requires_grad]
    assert plan.parameters == plan.gradients == _nbytes(adapter) > 0
    assert plan.frozen == sum(p.numel() for p in base) * 2  # one bf16 base, no second teacher
    assert plan.optimizer == _adamw_state_bytes(model)
    full = plan_group(GroupSpec("critic", TINY_SD3, teacher=TINY_SD3), SETTING)
    assert plan.parameters < full.parameters and plan.frozen == full.frozen


def test_two_ranks_hold_the_torch_chunk_shards_of_every_parameter():
    model = _real(TINY_SD3)
    per_rank = [
        plan_group(GroupSpec("actor", TINY_SD3), PlanSetting(2, torch.float32, 16, 8, rank=rank)) for rank in (0, 1)
    ]
    for rank, plan in enumerate(per_rank):
        chunks = [torch.chunk(p, 2, dim=0) for p in model.parameters()]
        assert plan.parameters == sum(c[rank].numel() * 4 for c in chunks if rank < len(c))
    assert per_rank[0].parameters + per_rank[1].parameters == _nbytes(model.parameters())
    whole = plan_group(GroupSpec("actor", TINY_SD3), PlanSetting(1, torch.float32, 16, 8))
    # Sharded, the optimizer state halves but the window gathers the whole model and its unsharded gradients.
    assert per_rank[0].optimizer < whole.optimizer and per_rank[0].gathered_train == 2 * whole.parameters


def test_zero3_gathers_less_than_the_whole_model_and_checkpointing_keeps_fewer_activations():
    deeper = {**TINY_SD3, "num_layers": 4}  # with two blocks, "two at a time" is the whole model
    spec = GroupSpec("critic", deeper, teacher=deeper)
    zero2 = plan_group(spec, PlanSetting(2, torch.bfloat16, 16, 8))
    zero3 = plan_group(spec, PlanSetting(2, torch.bfloat16, 16, 8, reshard_every_microbatch=True))
    assert 0 < zero3.gathered_train < zero2.gathered_train
    assert 0 < zero3.gathered_inference < zero2.gathered_inference
    checkpointed = plan_group(GroupSpec("critic", TINY_SD3), PlanSetting(1, torch.bfloat16, 16, 8, True))
    assert checkpointed.activations.stored < plan_group(GroupSpec("critic", TINY_SD3), SETTING).activations.stored


def test_a_rank_fits_when_its_peak_leaves_the_headroom_free():
    plan = GroupMemory("actor", 1, 0, parameters=300, gradients=300, optimizer=600, frozen=100, ema=0, buffers=10,
                       gathered_train=200, gathered_inference=50,
                       activations=ActivationEstimate(400, 100))  # fmt: skip
    assert plan.train_peak == 300 + 300 + 600 + 100 + 10 + 200 + 500 == plan.peak
    assert plan.fits(plan.peak / (1 - HEADROOM))
    assert not plan.fits(plan.peak / (1 - HEADROOM) - 1)


def test_the_dry_run_prints_the_plan_of_every_group(tmp_path, caplog):
    pipeline = make_pipeline(tmp_path / "digits")
    argv = ["--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
            "--prompt-data", str(tmp_path / "p.jsonl"), "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "4",
            "--dmd2-critic-steps-per-rollout", "2", "--num-rollout", "1",
            "--dry-run", "--gpu-memory-gb", "0.001"]  # fmt: skip
    (tmp_path / "p.jsonl").write_text('{"prompt": "a digit 3"}\n')
    from miles.driver.arguments import parse_args
    from miles.driver.memory_plan import log_memory_plan

    with caplog.at_level(logging.INFO, logger="miles.driver.memory_plan"):
        log_memory_plan(parse_args(argv))
    text = caplog.text
    assert "memory per GPU, DP rank 0 of 2: float32 compute, 16 image + 16 text tokens per sample" in text
    assert "critic" in text and "actor" in text and "* estimates" in text
    assert "GPU of 1.02 MiB: does NOT fit" in text
    _, plans = plan_run(parse_args(argv))
    assert [plan.role for plan in plans] == ["critic", "actor"] and plans[1].frozen == 0
    # A plan that cannot be made (here: no pipeline there) is one warning; the dry run's other checks go on.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="miles.driver.memory_plan"):
        log_memory_plan(parse_args([*argv, "--hf-checkpoint", str(tmp_path / "nope")]))
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith("memory plan: not available (FileNotFoundError: ")
