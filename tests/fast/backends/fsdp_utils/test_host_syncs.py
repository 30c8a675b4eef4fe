"""Where the trainer waits for the device: once at the end of each timed phase, once per optimizer window for its
figures, and nowhere else in the window loop.

There is no GPU here. ``torch.cuda.synchronize`` is mocked and counted for ``timed`` on a ``cuda`` device (it
stands in for the wait for the kernels a phase queued). For the window loop, every host read of a tensor's value
(``.tolist()``, ``.item()``, ``float()``, ``int()``, ``bool()``, ``.cpu()``) is counted on the CPU run: on a GPU each
one of them is a sync that drains the CUDA queue. AdamW's ``step`` counters are left out: they stay CPU tensors on a
GPU (``capturable=False``), so reading them waits for nothing.
"""

import time

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub.sft import sft_loss_formula
from miles.backends.fsdp_utils.trainer import GroupTrainer, host_means, timed
from miles.models import get_model_family
from miles.utils.collectives import LocalCollectives
from tests.support.trainer import digits_pairs, make_args, make_pipeline, make_trainer

HOST_READS = ("tolist", "item", "__float__", "__int__", "__bool__", "cpu")


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda``'s timing calls on a machine without CUDA; ``synchronize`` takes 50 ms (the queued kernels)."""
    calls = []

    def synchronize(device=None):
        calls.append(("synchronize", device))
        time.sleep(0.05)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1024)
    return calls


def test_timed_synchronises_once_per_phase_on_cuda_and_counts_the_wait(fake_cuda):
    device = torch.device("cuda", 3)
    timers = {}
    for _ in range(3):
        assert timed(timers, "train_steps_time", device, lambda x: x + 1, 1) == 2
    syncs = [call for call in fake_cuda if call[0] == "synchronize"]
    assert syncs == [("synchronize", device)] * 3  # once per phase, on the rank's device
    # The wait for the device belongs to the phase: 3 phases of at least 50 ms each.
    assert timers["train_steps_time"] >= 0.15 and timers["peak_train_steps_bytes"] == 1024
    # A phase that raises is timed (and synchronised) too.
    with pytest.raises(ZeroDivisionError):
        timed(timers, "generate_time", device, lambda: 1 / 0)
    assert len([call for call in fake_cuda if call[0] == "synchronize"]) == 4


def test_timed_never_synchronises_on_the_cpu(fake_cuda):
    timers = {}
    timed(timers, "train_steps_time", torch.device("cpu"), lambda: None)
    assert fake_cuda == [] and set(timers) == {"train_steps_time"}


def test_host_means_average_numbers_and_tensors_exactly_as_python_floats():
    values = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float32)
    figures = host_means(
        {"a": [values[:2], 3, values[2:]], "b": torch.tensor(2.5, dtype=torch.float64), "c": [], "d": 1.5}
    )
    expected_a = (float(values[0]) + float(values[1]) + 3 + float(values[2])) / 4
    assert figures == {"a": expected_a, "b": 2.5, "d": 1.5}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


def _trainer(pipeline, tmp_path, loss=None) -> GroupTrainer:
    # 8 pairs in 2 optimizer windows of 4 micro-batches of 1 pair, clipping on, an EMA.
    args = make_args(
        pipeline,
        tmp_path,
        num_steps_per_rollout=2,
        micro_batch_size=1,
        clip_grad=0.5,
        ema_decay=0.9,
        lr_warmup_steps=3,
    )
    torch.manual_seed(args.seed)
    hooks = {} if loss is None else {"loss": loss}
    return make_trainer(args, family=get_model_family(pipeline), collectives=LocalCollectives(), **hooks)


def _count_host_reads(monkeypatch, trainer: GroupTrainer) -> list[str]:
    reads = []
    optimizer = trainer.models.optimizer
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def spy(tensor, *args, _name=name, _original=original, **kwargs):
            steps = {id(state.get("step")) for state in optimizer.state.values()}
            if id(tensor) not in steps:
                reads.append(_name)
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


def test_a_window_of_micro_batches_reads_its_figures_from_the_device_once(pipeline, tmp_path, monkeypatch):
    trainer = _trainer(pipeline, tmp_path)
    pairs = digits_pairs(trainer.family, 0, 8)
    reads = _count_host_reads(monkeypatch, trainer)
    _, metrics, _ = trainer.train(0, pairs, {})
    monkeypatch.undo()
    # One read per window (its loss, the hook's per-pair figures and the gradient norm together); the base commit
    # read 11 per window here: a .cpu() and a .tolist() per micro-batch, float(loss), float(norm), bool(finite norm).
    assert reads == ["tolist", "tolist"]
    assert [record["train/step"] for record in metrics] == [1, 2]


def test_the_figures_are_those_of_hooks_that_read_each_micro_batch(pipeline, tmp_path):
    def eager_sft_loss(ctx, train_pairs, prepared, *, new_pred, metrics):
        # The base commit's hook: each micro-batch's per-pair losses read to Python floats at once.
        own = {}
        loss = sft_loss_formula(ctx, train_pairs, prepared, new_pred=new_pred, metrics=own)
        for name, values in own.items():
            metrics.setdefault(name, []).extend(value for tensor in values for value in tensor.cpu().tolist())
        return loss

    runs = []
    for loss in (None, eager_sft_loss):
        trainer = _trainer(pipeline, tmp_path, loss)
        runs.append([trainer.train(r, digits_pairs(trainer.family, r, 8), {})[1] for r in range(2)])
    assert runs[0] == runs[1]  # every figure of every step, to the last bit
    assert all(
        record["train/sft_loss"] > 0 and record["train/grad_norm"] > 0 for rollout in runs[0] for record in rollout
    )
