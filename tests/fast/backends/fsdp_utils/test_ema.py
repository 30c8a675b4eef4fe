"""The generator EMA: diffusers' EMAModel warm-up math on the (sharded) weights, the swap for evaluation, and its
checkpoint round trip through DCP."""

import dataclasses

import pytest
import torch
from torch import nn

from miles.backends.fsdp_utils import checkpoint
from miles.backends.fsdp_utils.ema import ParameterEMA
from miles.backends.fsdp_utils.model import shard_model
from miles.backends.fsdp_utils.optimizer import build_lr_scheduler, build_optimizer
from miles.models import get_model_family
from tests.support.trainer import denoiser_loss, make_args, make_pipeline, run_spec, single_process_group


def _weights(modules: nn.ModuleDict) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in modules.named_parameters()
    }


def test_ema_follows_the_warmed_up_decay_and_swaps_for_evaluation(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    spec = run_spec(make_args(pipeline, tmp_path)).group("actor")
    with single_process_group() as mesh:
        model = family.load_denoiser(pipeline)
        model.train()
        shard_model(model, [], mesh, torch.float32, reshard_after_forward=False)
        modules = nn.ModuleDict({"transformer": model})
        optimizer = build_optimizer([model], spec.optimizer)
        ema = ParameterEMA(modules, decay=0.9)
        expected = _weights(modules)
        for step in range(1, 5):
            denoiser_loss(family, model, seed=step).backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update()
            live = _weights(modules)
            # diffusers EMAModel: d_1 = 0, then min(decay, (1 + m) / (10 + m)) with m = n − 1.
            decay = 0.0 if step == 1 else min(0.9, step / (9 + step))
            expected = {name: decay * expected[name] + (1 - decay) * live[name] for name in live}
            assert abs(ema.decay_value - decay) < 1e-12
        shadow = {name: tensor.full_tensor() for name, tensor in ema.state_dict()["shadow"].items()}
        for name in live:
            torch.testing.assert_close(shadow[name], expected[name], rtol=1e-6, atol=1e-7)
        assert max((shadow[name] - live[name]).abs().max().item() for name in live) > 1e-5  # not the live weights
        with ema.applied():
            applied = _weights(modules)
        after = _weights(modules)
    assert all(torch.allclose(applied[name], shadow[name]) for name in live)
    assert all(torch.equal(after[name], live[name]) for name in live)  # the live weights come back exactly


def test_ema_shadows_round_trip_through_a_checkpoint(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    spec = run_spec(make_args(pipeline, tmp_path)).group("actor")
    with single_process_group() as mesh:

        def group():
            model = family.load_denoiser(pipeline)
            model.train()
            shard_model(model, [], mesh, torch.float32, reshard_after_forward=False)
            modules = nn.ModuleDict({"transformer": model})
            optimizer = build_optimizer([model], spec.optimizer)
            scheduler = build_lr_scheduler(optimizer, dataclasses.replace(spec.schedule, total_steps=10), 1e-3)
            ema = ParameterEMA(modules, decay=0.99)
            states = {
                "train": checkpoint.ModulesState(modules, optimizer),
                "ema": ema,
                "scheduler": checkpoint.SchedulerState(scheduler),
            }
            return model, optimizer, scheduler, ema, states

        model, optimizer, scheduler, ema, state = group()
        for step in range(3):
            denoiser_loss(family, model, seed=step).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            ema.update()
        checkpoint.save_checkpoint(tmp_path / "ckpt", 2, state, role="actor")
        saved = {name: t.full_tensor().clone() for name, t in ema.state_dict()["shadow"].items()}
        _, _, _, fresh_ema, fresh_state = group()
        checkpoint.load_checkpoint(tmp_path / "ckpt", 2, fresh_state)
        loaded = {name: t.full_tensor() for name, t in fresh_ema.state_dict()["shadow"].items()}
        assert fresh_ema.num_updates == ema.num_updates == 3
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[name], loaded[name]) for name in saved)


def test_ema_min_decay_and_update_after_step_set_the_warm_up():
    """--ema-min-decay = --ema-decay turns diffusers' warm-up off (a constant decay from the second step);
    --ema-update-after-step keeps the shadow a copy of the live weights until that step."""

    def decays(**kwargs) -> list[float]:
        torch.manual_seed(0)
        modules = nn.ModuleDict({"layer": nn.Linear(3, 2)})
        ema = ParameterEMA(modules, decay=0.99, **kwargs)
        shadow = modules["layer"].weight.detach().clone()
        seen = []
        for step in range(1, 7):
            with torch.no_grad():
                modules["layer"].weight.add_(float(step))
            ema.update()
            seen.append(ema.decay_value)
            live = modules["layer"].weight.detach()
            shadow = seen[-1] * shadow + (1 - seen[-1]) * live
            torch.testing.assert_close(ema.state_dict()["shadow"]["layer.weight"], shadow)
        return seen

    warm = [0.0] + [min(0.99, (1 + m) / (10 + m)) for m in range(1, 6)]
    assert decays() == pytest.approx(warm)
    assert decays(min_decay=0.99) == pytest.approx([0.0] + [0.99] * 5)
    assert decays(update_after_step=3) == pytest.approx([0.0, 0.0, 0.0, 0.0, 2 / 11, 3 / 12])
    with pytest.raises(ValueError, match="--ema-min-decay must be in \\[0, --ema-decay 0.9\\]"):
        ParameterEMA(nn.ModuleDict({"layer": nn.Linear(1, 1)}), decay=0.9, min_decay=0.95)


def test_the_model_set_builds_its_ema_with_the_warm_up_flags(tmp_path):
    """``build_model_set`` (the trainer's EMA) reads the spec of --ema-min-decay and --ema-update-after-step; a group of one needs
    no process group."""
    from miles.backends.fsdp_utils.model_set import build_model_set

    pipeline = make_pipeline(tmp_path / "digits")
    flags = ["--ema-decay", "0.99", "--ema-min-decay", "0.5", "--ema-update-after-step", "2"]
    args = make_args(pipeline, tmp_path, *flags)
    models = build_model_set(run_spec(args).group("actor"), get_model_family(pipeline), torch.device("cpu"),
                             torch.float32, None, [])  # fmt: skip
    assert (models.ema._ema.decay, models.ema._ema.min_decay, models.ema._ema.update_after_step) == (0.99, 0.5, 2)
    default = build_model_set(run_spec(make_args(pipeline, tmp_path, "--ema-decay", "0.99")).group("actor"),
                              get_model_family(pipeline), torch.device("cpu"), torch.float32, None, [])  # fmt: skip
    assert (default.ema._ema.min_decay, default.ema._ema.update_after_step) == (0.0, 0)
    from miles.driver.validators import validate_number_args
    from miles.utils.validation import ArgumentValidationError

    args.ema_min_decay = 0.995
    with pytest.raises(ArgumentValidationError, match="--ema-min-decay 0.995 must be <= --ema-decay 0.99"):
        validate_number_args(args)
