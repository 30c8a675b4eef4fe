"""AdamW's multi-tensor (``foreach``) update is the per-tensor update's math, on FSDP2's DTensor parameters; the LR
schedule's warmup, constant and cosine phases."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.model import shard_model
from miles.backends.fsdp_utils.optimizer import apply_optimizer_spec, build_lr_scheduler, build_optimizer, lr_factor
from miles.config import OptimizerSpec, ScheduleSpec
from miles.models import get_model_family
from tests.support.trainer import denoiser_loss, make_pipeline, single_process_group

ARGS = OptimizerSpec(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def _train(pipeline, mesh, foreach: bool, steps: int = 5) -> dict[str, torch.Tensor]:
    family = get_model_family(pipeline)
    model = family.load_denoiser(pipeline)
    model.train()
    shard_model(model, family.blocks(model), mesh, torch.float32)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    if foreach:
        optimizer = build_optimizer([model], ARGS)
        assert optimizer.defaults["foreach"] is True
    else:
        # The per-tensor loop, what foreach=None fell back to for DTensors before.
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=ARGS.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, foreach=False
        )
    for step in range(steps):
        denoiser_loss(family, model, seed=step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def test_foreach_adamw_matches_the_per_tensor_update(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    with single_process_group() as mesh:
        fused = _train(pipeline, mesh, foreach=True)
        single = _train(pipeline, mesh, foreach=False)
    assert fused.keys() == single.keys()
    worst = max((fused[name] - single[name]).abs().max().item() for name in fused)
    assert worst <= 1e-6, worst
    # Five steps at lr 1e-3 moved the weights: the comparison is not between two untouched models.
    init = get_model_family(pipeline).load_denoiser(pipeline)
    moved = max((fused[name] - p.detach()).abs().max().item() for name, p in init.named_parameters())
    assert moved > 1e-3


def test_lr_schedule_warmup_constant_cosine():
    common = dict(lr=1e-3, min_lr=1e-4, warmup_steps=2, total_steps=6)
    assert [lr_factor(s, decay_style="constant", **common) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cosine = [1e-3 * lr_factor(s, decay_style="cosine", **common) for s in range(8)]
    # after warmup: min + (max - min)(1 + cos(pi p))/2 with p = (s - 2)/4, clamped at p = 1
    expected = [5e-4, 1e-3, 1e-3, 1e-4 + 9e-4 * (1 + 2**-0.5) / 2, 5.5e-4, 1e-4 + 9e-4 * (1 - 2**-0.5) / 2, 1e-4, 1e-4]
    assert cosine == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="--lr-decay-style 'linear'"):
        lr_factor(0, decay_style="linear", **common)


SCHEDULE = ScheduleSpec(total_steps=10, decay_style="cosine", warmup_steps=2, min_lr=1e-4)


def _settings(**changes) -> OptimizerSpec:
    return OptimizerSpec(**{**dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0), **changes})


def _stepped(settings, model) -> tuple:
    optimizer = build_optimizer([model], settings)
    scheduler = build_lr_scheduler(optimizer, SCHEDULE, settings.lr)
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return optimizer, scheduler


def test_a_resumed_optimizer_takes_the_commands_settings_and_keeps_equal_ones_bit_for_bit():
    """``load_state_dict`` brings back the earlier run's lr, betas, eps and weight decay; ``apply_optimizer_spec``
    puts the command's in their place, at the schedule's position (step 3)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    saved_optimizer, saved_scheduler = _stepped(_settings(), model)
    new = _settings(lr=2e-3, betas=(0.5, 0.95), eps=1e-6, weight_decay=0.01)
    optimizer = build_optimizer([model], new)
    scheduler = build_lr_scheduler(optimizer, SCHEDULE, new.lr)
    optimizer.load_state_dict(saved_optimizer.state_dict())
    scheduler.load_state_dict(saved_scheduler.state_dict())
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"][0], group["weight_decay"]) == (saved_scheduler.get_last_lr()[0], 0.9, 0.0)
    apply_optimizer_spec(optimizer, scheduler, new)
    expected = 2e-3 * lr_factor(3, lr=2e-3, min_lr=1e-4, warmup_steps=2, decay_style="cosine", total_steps=10)
    assert group["lr"] == scheduler.get_last_lr()[0] == expected
    assert (group["betas"], group["eps"], group["weight_decay"], group["initial_lr"]) == (
        (0.5, 0.95),
        1e-6,
        0.01,
        2e-3,
    )
    scheduler.step()  # the schedule continues from the new base
    assert group["lr"] == 2e-3 * lr_factor(
        4, lr=2e-3, min_lr=1e-4, warmup_steps=2, decay_style="cosine", total_steps=10
    )

    # The same settings change nothing: a resume without changes repeats the uninterrupted run.
    same = build_optimizer([model], _settings())
    same_scheduler = build_lr_scheduler(same, SCHEDULE, 1e-3)
    same.load_state_dict(saved_optimizer.state_dict())
    same_scheduler.load_state_dict(saved_scheduler.state_dict())
    before = {key: value for key, value in same.param_groups[0].items() if key != "params"}
    apply_optimizer_spec(same, same_scheduler, _settings())
    assert {key: value for key, value in same.param_groups[0].items() if key != "params"} == before
    assert same_scheduler.get_last_lr() == saved_scheduler.get_last_lr()
