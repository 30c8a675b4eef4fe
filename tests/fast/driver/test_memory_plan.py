"""The memory planner (``miles.driver.memory_plan``): exact bytes against real modules and a real AdamW (full
weights and a peft LoRA), FSDP2 shards at 2 ranks, the fit decision, and the ``--dry-run`` table. The agreement
with the bytes a real run logs is checked where the suite already runs DMD2 (test_dmd2_e2e.py, test_dmd2_gan_e2e.py
and the tiny GPU check); a bad ``--gpu-memory-gb`` is a case of test_bad_inputs.py."""

import logging

import pytest
import torch

from miles.driver.memory_plan import (
    HEADROOM,
    GroupMemory,
    GroupSpec,
    LoraSpec,
    PlanSetting,
    format_bytes,
    format_count,
    host_memory_line,
    host_memory_per_node,
    plan_group,
    plan_run,
    startup_table,
)
from miles.models import family_class
from miles.models.lora import add_lora_adapter
from miles.models.memory import ActivationEstimate
from miles.models.precision import cast_buffers
from tests.support.trainer import make_pipeline

TINY_SD3 = {
    "_class_name": "SD3Transformer2DModel", "sample_size": 8, "patch_size": 2, "in_channels": 4, "out_channels": 4,
    "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 3, "joint_attention_dim": 32,
    "caption_projection_dim": 24, "pooled_projection_dim": 32, "pos_embed_max_size": 8,
}  # fmt: skip
# The family lays out the activations (MemoryLayout); its path is not read.
SD3 = family_class("sd3")("unused")


def _setting(*args, **kwargs) -> PlanSetting:
    return PlanSetting(*args, family=SD3, **kwargs)


SETTING = _setting(dp_size=1, compute_dtype=torch.bfloat16, image_tokens=16, text_tokens=8)


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
        plan_group(GroupSpec("actor", TINY_SD3), _setting(2, torch.float32, 16, 8, rank=rank)) for rank in (0, 1)
    ]
    for rank, plan in enumerate(per_rank):
        chunks = [torch.chunk(p, 2, dim=0) for p in model.parameters()]
        assert plan.parameters == sum(c[rank].numel() * 4 for c in chunks if rank < len(c))
    assert per_rank[0].parameters + per_rank[1].parameters == _nbytes(model.parameters())
    whole = plan_group(GroupSpec("actor", TINY_SD3), _setting(1, torch.float32, 16, 8))
    # Sharded, the optimizer state halves but the window gathers the whole model and its unsharded gradients.
    assert per_rank[0].optimizer < whole.optimizer and per_rank[0].gathered_train == 2 * whole.parameters


def test_context_parallel_shards_over_dp_times_cp_and_splits_the_activations_of_the_image_tokens():
    """--context-parallel-size 2 at DP 1: FSDP shards over both ranks (as DP 2 without CP) and each rank keeps the
    activations of half the image tokens (as a sample of 8 image tokens; the 8 text tokens are not split)."""
    spec = GroupSpec("actor", TINY_SD3)
    cp = plan_group(spec, _setting(1, torch.float32, 16, 8, context_parallel=2))
    dp = plan_group(spec, _setting(2, torch.float32, 16, 8))
    half = plan_group(spec, _setting(2, torch.float32, 8, 8))
    assert (cp.parameters, cp.optimizer, cp.gathered_train) == (dp.parameters, dp.optimizer, dp.gathered_train)
    assert cp.activations == half.activations
    assert cp.activations.peak < dp.activations.peak
    assert _setting(3, torch.float32, 16, 8, context_parallel=2).shard_ranks == 6


def test_zero3_gathers_less_than_the_whole_model_and_checkpointing_keeps_fewer_activations():
    deeper = {**TINY_SD3, "num_layers": 4}  # with two blocks, "two at a time" is the whole model
    spec = GroupSpec("critic", deeper, teacher=deeper)
    zero2 = plan_group(spec, _setting(2, torch.bfloat16, 16, 8))
    zero3 = plan_group(spec, _setting(2, torch.bfloat16, 16, 8, reshard_every_microbatch=True))
    assert 0 < zero3.gathered_train < zero2.gathered_train
    assert 0 < zero3.gathered_inference < zero2.gathered_inference
    checkpointed = plan_group(GroupSpec("critic", TINY_SD3), _setting(1, torch.bfloat16, 16, 8, True))
    assert checkpointed.activations.stored < plan_group(GroupSpec("critic", TINY_SD3), SETTING).activations.stored


def test_a_rank_fits_when_its_peak_leaves_the_headroom_free():
    plan = GroupMemory("actor", 1, 0, parameters=300, gradients=300, optimizer=600, frozen=100, ema=0, buffers=10,
                       gathered_train=200, gathered_inference=50,
                       activations=ActivationEstimate(400, 100))  # fmt: skip
    assert plan.train_peak == 300 + 300 + 600 + 100 + 10 + 200 + 500 == plan.peak
    assert plan.fits(plan.peak / (1 - HEADROOM))
    assert not plan.fits(plan.peak / (1 - HEADROOM) - 1)


def test_start_up_holds_the_shards_one_tensor_in_flight_and_the_groups_before_it_asleep():
    setting = _setting(2, torch.bfloat16, 16, 8, ranks_per_node=2)
    critic = plan_group(GroupSpec("critic", TINY_SD3, teacher=TINY_SD3), setting)
    actor = plan_group(GroupSpec("actor", TINY_SD3, ema=True), setting)
    # GPU: the shards as loaded, the buffers twice while to_empty replaces them, no optimizer state before a step.
    assert critic.startup == critic.parameters + critic.frozen + 2 * critic.buffers < critic.peak
    assert actor.startup == actor.parameters + actor.ema + 2 * actor.buffers < actor.peak
    # Host: the buffers built there, and the largest tensor's rank-0 rows in flight: read as float32, cast to float32.
    largest = max(torch.chunk(p.detach(), 2)[0].numel() for p in _real(TINY_SD3).parameters())
    assert critic.startup_host == critic.buffers + largest * (4 + 4)
    # A LoRA group builds its adapter whole on the host (float32) and reads its base in bf16.
    lora = plan_group(GroupSpec("critic", TINY_SD3, teacher=TINY_SD3, lora=LoraSpec(rank=4)), setting)
    adapter_numel = sum(
        p.numel() for p in add_lora_adapter(_real(TINY_SD3), "critic", 4).parameters() if p.requires_grad
    )
    assert lora.startup_host == lora.buffers + adapter_numel * 4 + largest * (4 + 2)
    # A resumed run loads its optimizer state at start-up.
    resumed = plan_group(GroupSpec("actor", TINY_SD3, ema=True), _setting(2, torch.bfloat16, 16, 8, resume=True))
    assert resumed.startup == actor.startup + actor.optimizer
    # While the actor loads, the critic sleeps in host memory with what it holds at rest (no optimizer state yet).
    rows = [line.split() for line in startup_table(setting, [critic, actor])[2:]]
    asleep = critic.resting - critic.optimizer
    critic_host, actor_host = critic.startup_host, actor.startup_host + asleep
    assert rows[0] == ["critic", *format_bytes(critic.startup).split(), *format_bytes(critic_host).split(),
                       *format_bytes(2 * critic_host).split()]  # fmt: skip
    assert rows[1] == ["actor", *format_bytes(actor.startup).split(), *format_bytes(actor_host).split(),
                       *format_bytes(2 * actor_host).split()]  # fmt: skip


def test_host_memory_per_node_pins_every_groups_optimizer_and_ema_and_pages_the_sleeping_weights():
    # Groups sleep on CUDA: their optimizer state and EMA stay in pinned buffers for the run (sleep.HostBuffers), the
    # sleeping groups' weights in pageable memory; the figures are DP rank 0's times the ranks of a node.
    critic = GroupMemory("critic", 1, 0, parameters=300, gradients=300, optimizer=600, frozen=100, ema=0, buffers=10,
                         gathered_train=0, gathered_inference=0, activations=ActivationEstimate(0, 0))  # fmt: skip
    actor = GroupMemory("actor", 1, 0, parameters=200, gradients=200, optimizer=400, frozen=0, ema=200, buffers=5,
                        gathered_train=0, gathered_inference=0, activations=ActivationEstimate(0, 0))  # fmt: skip
    pinned, pageable = host_memory_per_node([critic, actor], ranks_per_node=8)
    assert pinned == 8 * (600 + 400 + 200)
    assert pageable == 8 * (300 + 100 + 10)  # the actor awake, the larger critic asleep
    assert host_memory_per_node([actor], 8) == (0, 0)  # a group alone never sleeps
    assert host_memory_line([actor], 8) is None
    assert host_memory_line([critic, actor], 8).startswith(
        "host memory per node of 8 ranks while groups sleep (on CUDA): 9.38 KiB pinned for the run"
    )


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
    assert "start-up, one group after the other" in text and "host per node (2 ranks)*" in text
    assert "host memory per node of 2 ranks while groups sleep (on CUDA): " in text
    _, plans = plan_run(parse_args(argv))
    assert [plan.role for plan in plans] == ["critic", "actor"] and plans[1].frozen == 0
    # A plan that cannot be made (here: no pipeline there) is one warning; the dry run's other checks go on.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="miles.driver.memory_plan"):
        log_memory_plan(parse_args([*argv, "--hf-checkpoint", str(tmp_path / "nope")]))
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith("memory plan: not available (FileNotFoundError: ")


def test_the_dry_run_plans_a_wan_run_at_context_parallel_2(tmp_path, caplog):
    """The tiny Wan pipeline at 2 ranks (planned at the latent shape the family samples: 32760 video tokens): CP 2 is
    DP 1, sharded over both ranks as DP 2 is, each rank holding the activations of 16380 tokens; the header says
    so."""
    from miles.driver.arguments import parse_args
    from miles.driver.memory_plan import log_memory_plan
    from tests.support.tiny_pipelines import write_tiny_wan

    wan = write_tiny_wan(tmp_path / "wan")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat"}\n')
    argv = ["--loss-type", "sft_loss", "--train-only", "--hf-checkpoint", str(wan), "--prompt-data",
            str(tmp_path / "p.jsonl"), "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "2",
            "--num-rollout", "1", "--dry-run"]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="miles.driver.memory_plan"):
        log_memory_plan(parse_args([*argv, "--context-parallel-size", "2"]))
    assert (
        "memory per GPU, DP rank 0 of 1: float32 compute, 32760 image + 512 text tokens per sample, gradient "
        "checkpointing off, ZeRO-2-like (whole models per phase), context parallel 2 (FSDP over 2 ranks, 16380 "
        "image tokens per rank)"
    ) in caplog.text
    setting, (cp,) = plan_run(parse_args([*argv, "--context-parallel-size", "2"]))
    assert (setting.dp_size, setting.context_parallel, setting.shard_ranks) == (1, 2, 2)
    _, (dp,) = plan_run(parse_args(argv))
    assert cp.parameters == dp.parameters and cp.optimizer == dp.optimizer
    assert cp.activations.peak < dp.activations.peak


def _sd3_argv(pipeline, data, tmp_path, *extra) -> list[str]:
    return ["--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
            "--prompt-data", str(data), "--rollout-batch-size", "2", "--dmd2-critic-steps-per-rollout", "1",
            "--num-rollout", "1", "--train-dtype", "bfloat16", "--output-dir", str(tmp_path / "out"),
            "--dry-run", *extra]  # fmt: skip


def test_the_plan_counts_the_text_encoders_of_every_actor_rank_without_a_prompt_cache(tmp_path, caplog):
    """Without a cached cond each actor rank loads the family's text encoders whole (SD3.5: two CLIPs and T5-XXL); the
    plan counts them in the compute dtype from the safetensors headers, and a prompt cache takes them out."""
    from miles.driver.arguments import parse_args
    from miles.driver.memory_plan import log_memory_plan, text_encoder_memory
    from miles.models import get_model_family
    from miles.models.base import text_encoder_modules
    from miles.rollout.prompt_cache import write_prompt_cache
    from tests.support.sd3_t5 import tiny_sd3_t5_pipeline

    pipeline = tiny_sd3_t5_pipeline(tmp_path / "sd3")
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a cat"}\n{"prompt": "a dog"}\n')
    modules = text_encoder_modules(get_model_family(pipeline).load_text_encoder(pipeline))
    numel = sum(param.numel() for module in modules for param in module.parameters())
    encoders = text_encoder_memory(parse_args(_sd3_argv(pipeline, data, tmp_path)))
    assert encoders.numel == numel and encoders.bytes == 2 * numel and encoders.dtype == torch.bfloat16
    assert encoders.reason == "--prompt-data record 1 has no cached cond under --cond-key 'cond'"
    with caplog.at_level(logging.INFO, logger="miles.driver.memory_plan"):
        log_memory_plan(parse_args(_sd3_argv(pipeline, data, tmp_path)))
    _, plans = plan_run(parse_args(_sd3_argv(pipeline, data, tmp_path)))
    peak = format_bytes(plans[1].peak + 2 * numel)
    assert (
        f"text encoders: {format_count(numel)} parameters, {format_bytes(2 * numel)} per actor rank in bfloat16 "
        in (caplog.text)
    )
    assert f"asleep with the actor group; actor peak with them {peak}" in caplog.text

    cache = tmp_path / "cache"
    write_prompt_cache(pipeline, data, cache)
    cached = ["--prompt-data", str(cache / "prompts.jsonl")]
    # DMD2's teacher CFG encodes the negative prompt too (--dmd2-teacher-guidance-scale > 1).
    negative = parse_args(_sd3_argv(pipeline, data, tmp_path, *cached, "--dmd2-teacher-guidance-scale", "3"))
    assert text_encoder_memory(negative).reason == "the negative prompt is encoded (no --negative-cond)"
    argv = _sd3_argv(pipeline, data, tmp_path, *cached, "--negative-cond", str(cache / "negative.safetensors"))
    assert text_encoder_memory(parse_args([*argv, "--dmd2-teacher-guidance-scale", "3"])) is None


def test_a_dry_run_refuses_text_encoders_that_do_not_fit_and_names_the_prompt_cache(tmp_path):
    from miles.driver.arguments import parse_args
    from miles.driver.memory_plan import GIB, text_encoder_memory
    from miles.driver.preflight import validate_inputs
    from miles.rollout.prompt_cache import write_prompt_cache
    from miles.utils.validation import ArgumentValidationError
    from tests.support.sd3_t5 import tiny_sd3_t5_pipeline

    pipeline = tiny_sd3_t5_pipeline(tmp_path / "sd3")
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a cat"}\n{"prompt": "a dog"}\n')
    args = parse_args(_sd3_argv(pipeline, data, tmp_path))
    _, plans = plan_run(args)
    actor, encoders = plans[1].peak, text_encoder_memory(args).bytes
    # A GPU whose 90% holds the actor group, and every other group, but not the actor with its text encoders.
    gpu_gb = (max(actor + encoders // 2, plans[0].peak) / (1 - HEADROOM)) / GIB
    assert actor + encoders > (1 - HEADROOM) * gpu_gb * GIB
    with pytest.raises(ArgumentValidationError) as info:
        validate_inputs(parse_args(_sd3_argv(pipeline, data, tmp_path, "--gpu-memory-gb", str(gpu_gb))))
    message = str(info.value)
    assert "\n" not in message and message.startswith("the text encoders (")
    assert f"encode the prompts once instead: python -m miles.rollout.prompt_cache {pipeline} {data} CACHE_DIR" in (
        message
    )
    # A larger GPU holds them; on the same GPU, the prompt cache the message names takes them off it.
    validate_inputs(parse_args(_sd3_argv(pipeline, data, tmp_path, "--gpu-memory-gb", str(2 * gpu_gb))))
    cache = tmp_path / "cache"
    write_prompt_cache(pipeline, data, cache)
    cached = ["--prompt-data", str(cache / "prompts.jsonl"), "--negative-cond", str(cache / "negative.safetensors")]
    validate_inputs(parse_args(_sd3_argv(pipeline, data, tmp_path, *cached, "--gpu-memory-gb", str(gpu_gb))))


def test_a_dry_run_whose_plan_does_not_fit_exits_2_on_one_line(tmp_path, capsys, caplog):
    # Issue 34 item 5: "does NOT fit" was printed and the dry run exited 0. --gpu-memory-gib is GiB; the older
    # --gpu-memory-gb is the same flag.
    import train_diffusion
    from tests.support.inputs import write_digit_records

    pipeline = make_pipeline(tmp_path / "digits")
    prompts = write_digit_records(tmp_path / "p.jsonl", 4, images=False)
    argv = ["--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
            "--prompt-data", str(prompts), "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "4",
            "--dmd2-critic-steps-per-rollout", "2", "--num-rollout", "1", "--output-dir", str(tmp_path / "out"),
            "--dry-run"]  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        train_diffusion.main([*argv, "--gpu-memory-gib", "0.001"])
    assert exc.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train_diffusion.py: error:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "train_diffusion.py: error: the memory plan does NOT fit a GPU of 1.02 MiB (--gpu-memory-gib): the "
    ), lines[0]
    assert "group's planned peak is" in lines[0] and "--fsdp-reshard-every-microbatch" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="miles.driver.memory_plan"):
        train_diffusion.main([*argv, "--gpu-memory-gb", "80"])  # the older name; 80 GiB fits: the dry run returns
    assert "GPU of 80 GiB: fits" in caplog.text
