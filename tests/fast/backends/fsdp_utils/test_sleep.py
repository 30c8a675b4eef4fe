"""Sleep / wake of FSDP2 models and AdamW state: the state machine runs and leaves every value intact.

On the CPU there is nowhere to move to, so the transitions only flip the state; the move itself (shards and optimizer
state to the CPU and back) runs only where CUDA is (``test_sleep_moves_shards_off_the_gpu_and_back``).
"""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.model import reshard
from miles.backends.fsdp_utils.optimizer import build_optimizer
from miles.backends.fsdp_utils.sleep import ASLEEP, AWAKE, SleepController
from miles.models import get_model_family
from tests.support.trainer import denoiser_loss, make_pipeline, sharded_denoiser, single_process_group

OPT_ARGS = SimpleNamespace(lr=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.0)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


@pytest.fixture
def setup(pipeline):
    # Per test: the CUDA test below opens an NCCL group of its own, and a process has one default group.
    with single_process_group() as mesh:
        yield SimpleNamespace(pipeline=pipeline, family=get_model_family(pipeline), mesh=mesh)


def _snapshot(model, optimizer):
    # On the CPU, so that a snapshot taken on the GPU compares with one taken asleep.
    params = {name: p.detach().to_local().cpu().clone() for name, p in model.named_parameters()}
    state = {
        (name, key): (value.to_local() if isinstance(value, DTensor) else value).cpu().clone()
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


def test_awake_context_restores_sleep_and_leaves_cpu_models_in_place(setup):
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
    # Training on the CPU, sleep moves nothing (it used to reshard and copy CPU to CPU): the root stays gathered
    # until the trainer reshards it after the hook (FSDPTrainRayActor._reshard_all).
    assert not all(isinstance(p, DTensor) for p in teacher.parameters())
    reshard(teacher)
    assert all(isinstance(p, DTensor) for p in teacher.parameters())
    controller.wake_up()
    with controller.awake():
        pass
    assert controller.state == AWAKE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="moving to the CPU and back needs a CUDA device")
def test_sleep_moves_shards_off_the_gpu_and_back(pipeline):
    """On CUDA: sleep reshards a gathered frozen root first, moves parameters and AdamW state to the CPU (values
    intact), and wake brings them back."""
    family = get_model_family(pipeline)
    device = torch.device("cuda", 0)
    with single_process_group(backend="nccl", device_type="cuda") as mesh:
        torch.cuda.set_device(device)
        model = sharded_denoiser(family, pipeline, mesh, device=device)
        teacher = sharded_denoiser(family, pipeline, mesh, trainable=False, device=device)
        optimizer = build_optimizer([model], OPT_ARGS)
        denoiser_loss(family, model, seed=0).backward()
        optimizer.step()
        with torch.no_grad():
            denoiser_loss(family, teacher, seed=3)
        assert not all(isinstance(p, DTensor) for p in teacher.parameters())
        before = _snapshot(model, optimizer)
        controller = SleepController([model, teacher], optimizer, device)

        controller.sleep()
        assert all(isinstance(p, DTensor) for p in teacher.parameters())  # resharded before the move
        assert {p.device.type for m in (model, teacher) for p in m.parameters()} == {"cpu"}
        assert {
            value.device.type
            for state in optimizer.state.values()
            for key, value in state.items()
            if key != "step" and isinstance(value, torch.Tensor)
        } == {"cpu"}
        _assert_same(before, _snapshot(model, optimizer))
        controller.wake_up()
        assert {p.device.type for m in (model, teacher) for p in m.parameters()} == {"cuda"}
        _assert_same(before, _snapshot(model, optimizer))
