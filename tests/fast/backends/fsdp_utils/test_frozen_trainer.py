"""A frozen group's rank (``FrozenGroupRunner``) at world size 1, without Ray: its own small class beside
``GroupTrainer``, built from a spec that trains nothing, running its train-input and train-output hooks only."""

import pytest
import torch

from miles.backends.fsdp_utils.frozen_trainer import FrozenGroupRunner
from miles.backends.fsdp_utils.trainer import GroupTrainer
from miles.config import GroupHooks, GroupSpec
from miles.models import get_model_family
from miles.utils.collectives import LocalCollectives
from tests.support.trainer import digits_pairs, make_pipeline

CPU = torch.device("cpu")


def _reverse(ctx, pairs):
    return pairs[::-1]


def _output(ctx, pairs):
    """What it saw, and one figure per pair (logged with the group's record)."""
    ctx.metrics.setdefault("first_index", []).append(float(pairs[0].sample_index))
    return {
        "indices": [pair.sample_index for pair in pairs],
        "external": ctx.external_data,
        "grad": torch.is_grad_enabled(),
    }


def test_a_frozen_spec_runs_its_hooks_alone_and_refuses_what_it_does_not_hold(tmp_path):
    assert not issubclass(FrozenGroupRunner, GroupTrainer)  # its own class: no parent's constructor to skip
    family = get_model_family(make_pipeline(tmp_path / "digits"))
    spec = GroupSpec(role="reward", hooks=GroupHooks(train_input=_reverse, train_output=_output), init=None)
    assert not spec.trains
    runner = FrozenGroupRunner(spec, family, device=CPU, collectives=LocalCollectives())
    pairs = digits_pairs(family, 0, 4)
    output, metrics, timers = runner.train(0, pairs, {"critic": "scores"})
    assert output == {"indices": [3, 2, 1, 0], "external": {"critic": "scores"}, "grad": False}
    assert metrics == [{"train/reward-first_index": 3.0}] and set(timers) == {"train_output_time"}
    assert runner.models.memory_bytes() == {"parameters": 0, "gradients": 0, "optimizer": 0, "frozen": 0}
    assert runner.train_output("probe", {}, pairs)["indices"] == [0, 1, 2, 3]  # the hook alone, no train-input
    with pytest.raises(RuntimeError, match="holds no denoiser"):
        _ = runner.models.denoiser
    with pytest.raises(RuntimeError, match="no trainable state to checkpoint"):
        runner.save(str(tmp_path / "ckpt"), 0)
    runner.sleeper.sleep()
    with pytest.raises(RuntimeError, match=r"reward group is asleep; call wake_up\(\) before train \(rollout 1\)"):
        runner.train(1, pairs, {})
    # A frozen spec without a train-output hook would do nothing; a spec with a model source is a GroupTrainer's.
    with pytest.raises(ValueError, match="needs --custom-train-output-function-path"):
        FrozenGroupRunner(GroupSpec(role="reward", hooks=GroupHooks(), init=None), family, device=CPU,
                          collectives=LocalCollectives())  # fmt: skip
    with pytest.raises(ValueError, match="a GroupTrainer runs it"):
        FrozenGroupRunner(GroupSpec(role="x", hooks=spec.hooks, init="/p"), family, device=CPU,
                          collectives=LocalCollectives())  # fmt: skip
    with pytest.raises(ValueError, match="has no model source: it is frozen"):
        GroupTrainer(spec, family, device=CPU, collectives=LocalCollectives())


def test_a_frozen_groups_hooks_see_the_dp_rank_of_its_context_parallel_group(tmp_path):
    """At --context-parallel-size 2, rank 3 of 4 is DP rank 1 of 2: its hooks draw the noise of its CP group's
    shard (the collectives stand in for rank 3's process group; only their rank and size are read)."""
    from types import SimpleNamespace

    family = get_model_family(make_pipeline(tmp_path / "digits"))
    spec = GroupSpec(role="reward", hooks=GroupHooks(train_output=_output), init=None)
    rank3 = SimpleNamespace(rank=3, world_size=4)
    ctx = FrozenGroupRunner(spec, family, device=CPU, collectives=rank3, context_parallel_size=2).context(0, {})
    assert (ctx.dp_rank, ctx.dp_size) == (1, 2)
    ctx = FrozenGroupRunner(spec, family, device=CPU, collectives=rank3).context(0, {})
    assert (ctx.dp_rank, ctx.dp_size) == (3, 4)
