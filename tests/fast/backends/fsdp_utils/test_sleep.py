"""Sleep / wake of FSDP2 models and AdamW state: the state machine runs and leaves every value intact.

On the CPU there is nowhere to move to, so the transitions only flip the state; the move itself (shards and optimizer
state to the CPU and back) runs only where CUDA is (``test_sleep_moves_shards_off_the_gpu_and_back``).

The host buffers' bookkeeping runs here with two stand-ins for a GPU node: ``cudaHostRegister`` / ``Unregister`` are
mocked (``sleep._pin`` / ``sleep._unpin``, recorded), and the training device is ``cpu:0``, a device the controller
must move the state off as it would ``cuda:0`` (its copies are CPU copies).
"""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils import sleep as sleep_module
from miles.backends.fsdp_utils.ema import ParameterEMA
from miles.backends.fsdp_utils.model import reshard
from miles.backends.fsdp_utils.optimizer import build_optimizer
from miles.backends.fsdp_utils.sleep import ASLEEP, AWAKE, HostBuffers, SleepController
from miles.config import OptimizerSpec
from miles.models import get_model_family
from tests.support.trainer import denoiser_loss, make_pipeline, sharded_denoiser, single_process_group

OPT_ARGS = OptimizerSpec(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


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


@pytest.fixture
def fake_pinning(monkeypatch):
    """Records ``("pin" | "unpin", data_ptr, bytes)`` instead of calling cudaHostRegister / cudaHostUnregister."""
    calls = []
    monkeypatch.setattr(sleep_module, "_pin", lambda t: calls.append(("pin", t.data_ptr(), t.numel())))
    monkeypatch.setattr(sleep_module, "_unpin", lambda t: calls.append(("unpin", t.data_ptr(), t.numel())))
    return calls


def test_host_buffers_are_pinned_once_reused_by_every_stage_and_freed(fake_pinning):
    host = HostBuffers(pin=True)
    first = {"a": torch.arange(3, dtype=torch.float32), "b": torch.ones(2, 2, dtype=torch.bfloat16)}
    slots = host.stage(first)
    assert all(torch.equal(slots[key], value) and slots[key].dtype == value.dtype for key, value in first.items())
    # one flat buffer, each slot 64-byte aligned: 12 bytes of "a" take 64, 8 bytes of "b" take 64
    assert host.nbytes == 128 and host.pinned
    assert fake_pinning == [("pin", host.buffer.data_ptr(), 128)]
    assert all(slot.untyped_storage().data_ptr() == host.buffer.data_ptr() for slot in slots.values())

    ptr = host.buffer.data_ptr()
    again = host.stage({"a": torch.full((3,), 7.0), "b": torch.zeros(2, 2, dtype=torch.bfloat16)})
    assert host.buffer.data_ptr() == ptr and len(fake_pinning) == 1  # the same pinned memory, not pinned again
    assert again["a"].tolist() == [7.0, 7.0, 7.0] and slots["a"].tolist() == [7.0, 7.0, 7.0]

    # Another set of tensors (the optimizer's moments appeared): the old buffer is unpinned, a new one pinned.
    host.stage({**first, "c": torch.zeros(20)})
    assert [call[0] for call in fake_pinning] == ["pin", "unpin", "pin"] and fake_pinning[1][1] == ptr
    assert host.nbytes == 64 + 64 + 128
    host.release()
    assert fake_pinning[-1] == ("unpin", fake_pinning[-2][1], 256) and host.nbytes == 0 and not host.pinned
    host.release()  # twice is a no-op
    assert len(fake_pinning) == 4

    # A CPU group's buffers are never pinned.
    unpinned = HostBuffers(pin=False)
    unpinned.stage(first)
    assert not unpinned.pinned and len(fake_pinning) == 4


def test_sleeping_optimizer_state_and_ema_live_in_one_pinned_buffer_kept_across_sleeps(setup, fake_pinning):
    model = sharded_denoiser(setup.family, setup.pipeline, setup.mesh)
    optimizer = build_optimizer([model], OPT_ARGS)
    ema = ParameterEMA(torch.nn.ModuleDict({"transformer": model}), decay=0.9)
    _step(setup, model, optimizer, seed=0)
    ema.update()
    # cpu:0 stands in for cuda:0 (module docstring); pinning is on by default only for a cuda device.
    assert SleepController([model], optimizer, torch.device("cuda", 0)).host.pin
    controller = SleepController([model], optimizer, torch.device("cpu", 0), ema=ema, pin_memory=True)
    before = _snapshot(model, optimizer)
    shadows = [shadow.clone() for shadow in ema.shadows]

    def sleeping_tensors():
        moments = [
            value.to_local() if isinstance(value, DTensor) else value
            for state in optimizer.state.values()
            for key, value in state.items()
            if key != "step"
        ]
        return moments + list(ema.shadows)

    buffers = []
    for _ in range(3):
        controller.sleep()
        buffer = controller.host.buffer
        buffers.append(buffer.data_ptr())
        # Every moment and shadow of the sleeping group is a slot of the one buffer, values intact.
        assert {t.untyped_storage().data_ptr() for t in sleeping_tensors()} == {buffer.data_ptr()}
        assert all(isinstance(value, DTensor) for state in optimizer.state.values() for value in state.values()
                   if value.ndim)  # fmt: skip
        _assert_same(before, _snapshot(model, optimizer))
        assert all(torch.equal(a, b) for a, b in zip(ema.shadows, shadows))
        controller.wake_up()
        # Awake, the state is on the device again (fresh tensors), and the buffer stays for the next sleep.
        assert not {t.untyped_storage().data_ptr() for t in sleeping_tensors()} & {buffer.data_ptr()}
        assert controller.host.buffer is buffer and controller.host.pinned
    expected = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in sleeping_tensors())
    assert buffers == [buffers[0]] * 3 and controller.host.nbytes == expected
    assert fake_pinning == [("pin", buffers[0], expected)]  # pinned once for the three sleeps

    controller.sleep()
    with pytest.raises(RuntimeError, match="while asleep"):
        controller.release_host_buffers()
    controller.wake_up()
    controller.release_host_buffers()
    assert fake_pinning[-1] == ("unpin", buffers[0], expected) and controller.host.nbytes == 0
    # Training goes on exactly as before the cycles.
    _step(setup, model, optimizer, seed=1)
    twin = sharded_denoiser(setup.family, setup.pipeline, setup.mesh)
    twin_opt = build_optimizer([twin], OPT_ARGS)
    _step(setup, twin, twin_opt, seed=0)
    _step(setup, twin, twin_opt, seed=1)
    _assert_same(_snapshot(twin, twin_opt), _snapshot(model, optimizer))


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
