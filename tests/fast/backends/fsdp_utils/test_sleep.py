"""Sleep / wake of FSDP2 models and AdamW state on CPU: the state machine runs and leaves every value intact."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer_support import denoiser_loss, make_pipeline, sharded_denoiser, single_process_group  # noqa: E402

from miles.backends.fsdp_utils.optimizer import build_optimizer  # noqa: E402
from miles.backends.fsdp_utils.sleep import ASLEEP, AWAKE, SleepController  # noqa: E402
from miles.models import get_model_family  # noqa: E402

OPT_ARGS = SimpleNamespace(lr=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pipeline = make_pipeline(tmp_path_factory.mktemp("digits"))
    with single_process_group() as mesh:
        yield SimpleNamespace(pipeline=pipeline, family=get_model_family(pipeline), mesh=mesh)


def _snapshot(model, optimizer):
    params = {name: p.detach().to_local().clone() for name, p in model.named_parameters()}
    state = {
        (name, key): (value.to_local() if isinstance(value, DTensor) else value).clone()
        for name, p in model.named_parameters()
        for key, value in optimizer.state[p].items()
    }
    return params, state


def _assert_same(a, b):
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys()
    for part_a, part_b in zip(a, b):
        for key, value in part_a.items():
            assert torch.equal(part_b[key], value), key


def _step(setup, model, optimizer, seed):
    denoiser_loss(setup.family, model, seed).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_sleep_wake_keeps_parameters_and_optimizer_state_bit_identical(setup):
    model = sharded_denoiser(setup.family, setup.pipeline, setup.mesh)
    optimizer = build_optimizer([model], OPT_ARGS)
    _step(setup, model, optimizer, seed=0)
    controller = SleepController([model], optimizer, torch.device("cpu"))
    before = _snapshot(model, optimizer)

    assert controller.state == AWAKE
    controller.sleep()
    assert controller.state == ASLEEP and controller.asleep
    _assert_same(before, _snapshot(model, optimizer))
    assert all(p.device.type == "cpu" for p in model.parameters())
    controller.sleep()  # sleeping twice is a no-op
    controller.wake_up()
    controller.wake_up()  # so is waking twice
    assert controller.state == AWAKE
    _assert_same(before, _snapshot(model, optimizer))

    # Training after a sleep/wake cycle is bit-identical to training without one.
    twin = sharded_denoiser(setup.family, setup.pipeline, setup.mesh)
    twin_opt = build_optimizer([twin], OPT_ARGS)
    _step(setup, twin, twin_opt, seed=0)
    _step(setup, twin, twin_opt, seed=1)
    _step(setup, model, optimizer, seed=1)
    _assert_same(_snapshot(twin, twin_opt), _snapshot(model, optimizer))


def test_awake_context_restores_sleep_and_reshards_frozen_roots(setup):
    teacher = sharded_denoiser(setup.family, setup.pipeline, setup.mesh, trainable=False)
    assert not any(p.requires_grad for p in teacher.parameters())
    controller = SleepController([teacher], None, torch.device("cpu"))
    controller.sleep()
    with controller.awake():
        assert controller.state == AWAKE
        with torch.no_grad():
            denoiser_loss(setup.family, teacher, seed=3)
        # FSDP2 keeps a root unsharded after a forward without backward: its parameters are plain tensors now.
        assert not all(isinstance(p, DTensor) for p in teacher.parameters())
    assert controller.state == ASLEEP
    # Sleeping resharded the root first, so only shards were moved.
    assert all(isinstance(p, DTensor) for p in teacher.parameters())
    controller.wake_up()
    with controller.awake():
        pass
    assert controller.state == AWAKE
