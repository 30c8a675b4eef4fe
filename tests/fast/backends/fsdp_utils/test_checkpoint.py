"""DCP checkpoints of a digits denoiser, sharded (every rank of a multi-rank group) or plain (a DP-1 run): round trip,
atomic layout, the one commit per rollout (``latest``, :mod:`miles.driver.run_dir`), clean-up after a crash, clear
errors."""

import json
import random
import shutil
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils import checkpoint
from miles.backends.fsdp_utils.model import is_sharded
from miles.backends.fsdp_utils.optimizer import build_lr_scheduler, build_optimizer
from miles.config import OptimizerSpec, ScheduleSpec
from miles.driver import run_dir
from miles.models import get_model_family
from tests.support.trainer import denoiser_loss, make_pipeline, sharded_denoiser, single_process_group

OPT_ARGS = OptimizerSpec(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
SCHEDULE = ScheduleSpec(total_steps=10, decay_style="cosine", warmup_steps=2, min_lr=0.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pipeline = make_pipeline(tmp_path_factory.mktemp("digits"))
    with single_process_group() as mesh:
        yield SimpleNamespace(pipeline=pipeline, family=get_model_family(pipeline), mesh=mesh)


def _trainer(setup, steps: int, shard: bool = True, pipeline=None):
    """A group's checkpointed state after ``steps`` optimizer steps: ``(states, scheduler, model)``."""
    model = sharded_denoiser(setup.family, pipeline or setup.pipeline, setup.mesh, shard=shard)
    optimizer = build_optimizer([model], OPT_ARGS)
    scheduler = build_lr_scheduler(optimizer, SCHEDULE, OPT_ARGS.lr)
    for step in range(steps):
        denoiser_loss(setup.family, model, seed=step).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    states = {
        "train": checkpoint.ModulesState(nn.ModuleDict({"transformer": model}), optimizer),
        "scheduler": checkpoint.SchedulerState(scheduler),
        "rng": checkpoint.RNGState(),
    }
    return states, scheduler, model


def _local(model):
    return {
        name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for name, p in model.named_parameters()
    }


def _step(states, scheduler, model, setup, seed):
    denoiser_loss(setup.family, model, seed=seed).backward()
    states["train"].optimizer.step()
    scheduler.step()


@pytest.mark.parametrize("shard", [True, False], ids=["fsdp2", "plain"])
def test_round_trip_restores_model_optimizer_scheduler_rng(setup, tmp_path, shard):
    state, scheduler, model = _trainer(setup, steps=3, shard=shard)
    assert is_sharded(model) is shard
    path = checkpoint.save_checkpoint(tmp_path, 4, state, role="critic", data_state={"epoch": 2})

    assert path == tmp_path / "rollout_4"
    # A group's save does not commit: the driver moves `latest` once every group has saved the rollout.
    assert not (tmp_path / "latest").exists()
    run_dir.commit([tmp_path], 4)
    assert (tmp_path / "latest").read_text() == "4\n"
    assert sorted(p.name for p in path.iterdir()) == ["data_state.pt", "dcp", "metadata.json"]
    metadata = json.loads((path / "metadata.json").read_text())
    assert metadata["rollout_id"] == 4 and metadata["role"] == "critic" and metadata["world_size"] == 1
    assert metadata["format_version"] == checkpoint.FORMAT_VERSION
    assert not list(tmp_path.glob(".tmp*"))
    assert run_dir.read_data_state(tmp_path) == (4, {"epoch": 2})

    fresh_state, fresh_sched, fresh_model = _trainer(setup, steps=0, shard=shard)
    assert run_dir.resume_rollout([tmp_path]) == 4
    checkpoint.load_checkpoint(tmp_path, 4, fresh_state)
    for name, value in _local(model).items():
        assert torch.equal(_local(fresh_model)[name], value), name
    assert fresh_sched.last_epoch == scheduler.last_epoch == 3
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr()
    # The next step from the loaded state equals the next step of the original.
    _step(state, scheduler, model, setup, seed=99)
    _step(fresh_state, fresh_sched, fresh_model, setup, seed=99)
    for name, value in _local(model).items():
        assert torch.equal(_local(fresh_model)[name], value), name


def test_rng_state_is_restored(setup, tmp_path):
    state, scheduler, _ = _trainer(setup, steps=1)
    torch.manual_seed(11)
    random.seed(11)
    checkpoint.save_checkpoint(tmp_path, 0, state, role="actor")
    expected = (torch.rand(4), random.random())
    torch.manual_seed(12345)
    random.seed(12345)
    checkpoint.load_checkpoint(tmp_path, 0, _trainer(setup, steps=0)[0])
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]


def test_latest_pointer_ignores_incomplete_saves_and_failed_save_keeps_good_one(setup, tmp_path):
    state, scheduler, _ = _trainer(setup, steps=1)
    for rollout_id in (1, 3):
        checkpoint.save_checkpoint(tmp_path, rollout_id, state, role="actor")
        run_dir.commit([tmp_path], rollout_id)
    assert run_dir.read_latest(tmp_path) == 3
    good = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "rollout_3").rglob("*"))

    # A save that fails midway (an unpicklable data cursor) leaves `latest` and rollout_3 as they were.
    with pytest.raises(TypeError, match="cannot pickle"):
        checkpoint.save_checkpoint(tmp_path, 5, state, role="actor", data_state={"lock": threading.Lock()})
    assert run_dir.read_latest(tmp_path) == 3
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "rollout_3").rglob("*")) == good
    assert not (tmp_path / "rollout_5").exists()
    assert run_dir.complete_rollouts(tmp_path) == [1, 3]
    checkpoint.load_checkpoint(tmp_path, run_dir.resume_rollout([tmp_path]), _trainer(setup, steps=0)[0])

    # A crash between the rename and the commit leaves an uncommitted rollout_5; saving 5 again replaces it.
    (tmp_path / "rollout_5").mkdir()
    (tmp_path / "rollout_5" / "junk").write_text("partial")
    checkpoint.save_checkpoint(tmp_path, 5, state, role="actor")
    run_dir.commit([tmp_path], 5)
    assert run_dir.read_latest(tmp_path) == 5
    assert not (tmp_path / "rollout_5" / "junk").exists()
    assert not list(tmp_path.glob(".tmp*")) and not list(tmp_path.glob(".stale*"))

    # One commit for every group: it refuses a rollout that a group did not save completely, and leaves `latest`.
    other = tmp_path / "critic"
    checkpoint.save_checkpoint(other, 5, state, role="critic")
    checkpoint.save_checkpoint(tmp_path, 7, state, role="actor")
    with pytest.raises(RuntimeError, match="critic/rollout_7 is missing"):
        run_dir.commit([tmp_path, other], 7)
    assert run_dir.read_latest(tmp_path) == 5
    # A resume removes what the crashed rollout left behind (no hand edit of `latest`): rollout_7 and any temp dir.
    (other / ".tmp_rollout_7").mkdir()
    removed = run_dir.remove_uncommitted([tmp_path, other], committed=5)
    assert sorted(path.name for path in removed) == [".tmp_rollout_7", "rollout_7"]
    assert run_dir.complete_rollouts(tmp_path) == [1, 3, 5] and run_dir.complete_rollouts(other) == [5]


def test_missing_and_corrupt_checkpoints_fail_clearly(setup, tmp_path):
    state, scheduler, _ = _trainer(setup, steps=1)
    with pytest.raises(ValueError, match=r"--load .*nope: no such directory"):
        run_dir.read_latest(tmp_path / "nope")
    with pytest.raises(RuntimeError, match=r"checkpoint .*nope/rollout_0 is missing"):
        checkpoint.load_checkpoint(tmp_path / "nope", 0, state)
    with pytest.raises(ValueError, match="no 'latest' file"):
        run_dir.resume_rollout([tmp_path])

    checkpoint.save_checkpoint(tmp_path, 2, state, role="actor")
    run_dir.commit([tmp_path], 2)
    (tmp_path / "latest").write_text("two\n")
    with pytest.raises(RuntimeError, match="holds 'two', not a rollout id"):
        run_dir.read_latest(tmp_path)
    (tmp_path / "latest").write_text("-1\n")
    with pytest.raises(RuntimeError, match="holds '-1', not a rollout id"):
        run_dir.read_latest(tmp_path)
    (tmp_path / "latest").write_text("7\n")
    with pytest.raises(RuntimeError, match="committed rollout 7, but checkpoint .*rollout_7 is missing"):
        run_dir.resume_rollout([tmp_path])
    (tmp_path / "latest").write_text("2\n")
    # A checkpoint of another format (format 2 kept the schedule and RNG beside DCP) is refused in one line.
    metadata = json.loads((tmp_path / "rollout_2" / "metadata.json").read_text())
    (tmp_path / "rollout_2" / "metadata.json").write_text(json.dumps({**metadata, "format_version": 2}))
    with pytest.raises(RuntimeError, match=r"committed rollout 2, but checkpoint .*rollout_2 has format 2") as info:
        run_dir.resume_rollout([tmp_path])
    (tmp_path / "rollout_2" / "metadata.json").write_text(json.dumps(metadata))
    assert "\n" not in str(info.value) and f"reads format {checkpoint.FORMAT_VERSION} only" in str(info.value)
    (tmp_path / "rollout_2" / "dcp" / ".metadata").unlink()
    with pytest.raises(RuntimeError, match="incomplete or corrupt: dcp/.metadata is missing"):
        checkpoint.load_checkpoint(tmp_path, 2, state)
    (tmp_path / "rollout_2" / "metadata.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="cannot read metadata.json"):
        run_dir.read_data_state(tmp_path)


def test_checkpoint_of_another_architecture_is_rejected(setup, tmp_path):
    state, scheduler, _ = _trainer(setup, steps=1)
    checkpoint.save_checkpoint(tmp_path / "ckpt", 0, state, role="actor")
    other_pipeline = make_pipeline(tmp_path / "wide")
    config = json.loads((other_pipeline / "transformer" / "config.json").read_text())
    shutil.rmtree(other_pipeline)
    from miles.models.digits import init_digits_pipeline

    init_digits_pipeline(other_pipeline, num_layers=config["num_layers"], attention_head_dim=16)
    with pytest.raises(RuntimeError, match="does not fit this model: .*Size mismatch"):
        checkpoint.load_checkpoint(tmp_path / "ckpt", 0, _trainer(setup, steps=0, pipeline=other_pipeline)[0])
