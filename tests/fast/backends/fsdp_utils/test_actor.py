"""FSDPTrainRayActor on CPU: real Ray, real gloo, real FSDP2, the digits pipeline and the real SFT and DMD2 hooks."""

import dataclasses
import json

import pytest
import ray
import torch

from miles.backends.fsdp_utils.hooks import check_hooks, metric_key, split_windows
from miles.backends.fsdp_utils.loss_hub.sft import prepare_sft_batch, sft_loss_formula
from miles.backends.fsdp_utils.loss_hub.types import TrainContext
from miles.config import GroupHooks
from miles.driver import run_dir
from miles.driver.specs import data_spec, resolve_hooks
from miles.eval.digits.data import write_digits_jsonl
from miles.models import get_model_family
from miles.ray.actor_group import RayTrainGroup
from miles.ray.engine_group import EngineGroup
from miles.ray.rollout import RolloutManager
from miles.rollout.step_strategy_hub import stop_at_random_step
from miles.utils.sampling import initial_noise
from miles.utils.types import Box, PromptShard, RolloutResult, TrainPair, TrainResult
from miles.utils.validation import ArgumentValidationError
from tests.support.rollout import prompt_shard
from tests.support.trainer import SFT_LOSS, SFT_PREPARE, digits_pairs, make_args, make_pipeline, run_spec

WORLD = 2
PAIRS_PER_RANK = 4


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def family(pipeline):
    return get_model_family(pipeline)


def _rank_errors(refs) -> list[str]:
    """Each rank's error message, in rank order; a rank that returns, or still waits after 120 s, fails the test."""
    errors = []
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref, timeout=120)
        errors.append(str(info.value))
    return errors


def _spawn(args, role="actor", load_rollout_id=None):
    run = run_spec(args)
    if role not in run.roles:  # the run's group under another role's name (its metrics and messages name it)
        run = dataclasses.replace(run, groups=(dataclasses.replace(run.groups[-1], role=role),))
    pg = ray.util.placement_group([{"CPU": 1}] * WORLD)
    ray.get(pg.ready())
    group = RayTrainGroup(run, role, 1, WORLD, (pg, list(range(WORLD))), num_gpus_per_actor=0, num_cpus_per_actor=0.4)
    starts = ray.get(group.async_init(load_rollout_id))
    return group, pg, starts


def _teardown(group, pg):
    group.shutdown()
    ray.util.remove_placement_group(pg)


def _boxes(family, rollout_id):
    pairs = digits_pairs(family, rollout_id, WORLD * PAIRS_PER_RANK)
    shards = [pairs[r * PAIRS_PER_RANK : (r + 1) * PAIRS_PER_RANK] for r in range(WORLD)]
    return pairs, [Box(ray.put(shard)) for shard in shards]


def _reference_step(args, family, pipeline, rollout_id, shards):
    """One process, no FSDP: the same hooks per (rank, micro-batch), summed loss / all pairs, clip, AdamW."""
    model = family.load_denoiser(pipeline).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=0.0
    )
    losses, norms = [], []
    for window in range(args.num_steps_per_rollout):
        total_pairs, window_loss = 0, 0.0
        for rank, shard in enumerate(shards):
            size = len(shard) // args.num_steps_per_rollout
            pairs = shard[window * size : (window + 1) * size]
            total_pairs += len(pairs)
            mbs = [pairs[j : j + args.micro_batch_size] for j in range(0, len(pairs), args.micro_batch_size)]
            for j, mb in enumerate(mbs):
                ctx = TrainContext(
                    args=args, models={"transformer": model}, teacher_models={}, external_data={}, family=family,
                    device=torch.device("cpu"), dtype=torch.float32, rollout_id=rollout_id,
                    microbatch_id=window * len(mbs) + j, dp_rank=rank, dp_size=len(shards),
                )  # fmt: skip
                prepared = prepare_sft_batch(ctx, mb)
                pred = ctx.predict_velocity(model, prepared.latents, prepared.timestep, prepared.cond)
                loss = sft_loss_formula(ctx, mb, prepared, new_pred=pred, metrics={})
                (loss / (len(pairs) * len(shards))).backward()
                window_loss += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)))
        opt.step()
        opt.zero_grad()
        losses.append(window_loss / total_pairs)
    return model.state_dict(), losses, norms


def test_two_rank_fsdp_sft_matches_single_process(ray_cluster, pipeline, family, tmp_path):
    args = make_args(pipeline, tmp_path, num_steps_per_rollout=2)
    group, pg, starts = _spawn(args)
    try:
        assert starts == [0, 0]
        pairs, boxes = _boxes(family, rollout_id=0)
        results = ray.get(group.async_train(0, boxes))
        assert all(isinstance(result, TrainResult) and ray.get(result.output.inner) is None for result in results)
        trained = ray.get(group.async_get_full_state_dict())[0]

        # The gathered weights reach a real engine replica: its samples change from the initial student's, and
        # equal what the trained actor ranks sample themselves.
        prompts = write_digits_jsonl(tmp_path / "data", prompt_repeats=1)["prompts"]
        engine_args = make_args(pipeline, tmp_path, train_only=False, prompt_data=prompts, rollout_num_gpus=1)
        engine_pg = ray.util.placement_group([{"CPU": 1}])
        ray.get(engine_pg.ready())
        engines = EngineGroup(run_spec(engine_args), (engine_pg, [0]), num_gpus=0.0, num_cpus=0.2)
        try:
            shard = prompt_shard("eval", ["a handwritten digit 3"] * 3)
            before = engines.evaluate(shard)
            ray.get(group.async_update_weights(engines.engines))
            after = engines.evaluate(shard)
            assert before.shape == after.shape == (3, 8, 8, 1) and not torch.equal(before, after)
            assert torch.equal(group.evaluate(shard), after)  # split over the 2 ranks, padded to 2 + 2
        finally:
            for engine in engines.engines:
                ray.kill(engine)
            ray.util.remove_placement_group(engine_pg)
    finally:
        _teardown(group, pg)

    shards = [pairs[r * PAIRS_PER_RANK : (r + 1) * PAIRS_PER_RANK] for r in range(WORLD)]
    expected, ref_losses, ref_norms = _reference_step(args, family, pipeline, 0, shards)
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=1e-5, msg=name)
    # One record per optimizer window, averaged over the ranks, returned by rank 0 (no tracker in the workers).
    records = results[0].metrics
    assert results[1].metrics == [] and results[1].perf == {}
    assert [r["train/loss"] for r in records] == pytest.approx(ref_losses, abs=1e-6)
    # The norm of the local shards, all-reduced once, is the whole model's (GroupTrainer.clip_grad_norm); the
    # reference norms exceed --clip-grad, so the in-place clip of the shards is in the weights compared above.
    assert [r["train/grad_norm"] for r in records] == pytest.approx(ref_norms, rel=1e-5)
    assert min(ref_norms) > args.clip_grad
    assert {"train/grad_norm", "train/lr", "train/sft_loss", "train/step"} <= records[0].keys()
    assert records[0]["train/lr"] == pytest.approx(1e-3) and [r["train/step"] for r in records] == [1, 2]
    assert {"perf/actor-train_steps_time", "perf/actor-train_output_time"} <= results[0].perf.keys()


def test_resume_reproduces_losses_and_weights(ray_cluster, pipeline, family, tmp_path):
    save = tmp_path / "ckpt"
    full = make_args(pipeline, tmp_path / "full", save=str(save))
    group, pg, _ = _spawn(full)
    losses_full = {}
    try:
        for rollout_id in range(4):
            results = ray.get(group.async_train(rollout_id, _boxes(family, rollout_id)[1]))
            losses_full[rollout_id] = results[0].metrics[0]["train/loss"]
            if rollout_id == 1:
                ray.get(group.async_save(rollout_id, {"cursor": 16}))
                run_dir.commit([save], rollout_id)  # the driver commits once every group has saved
        weights_full = ray.get(group.async_get_full_state_dict())[0]
    finally:
        _teardown(group, pg)
    assert (save / "latest").read_text().strip() == "1"

    resumed = make_args(pipeline, tmp_path / "resumed", load=str(save))
    assert run_dir.read_data_state(save) == (1, {"cursor": 16})
    group, pg, starts = _spawn(resumed, load_rollout_id=run_dir.resume_rollout([save]))
    losses_resumed = {}
    try:
        assert starts == [2, 2]
        for rollout_id in range(2, 4):
            results = ray.get(group.async_train(rollout_id, _boxes(family, rollout_id)[1]))
            losses_resumed[rollout_id] = results[0].metrics[0]["train/loss"]
        weights_resumed = ray.get(group.async_get_full_state_dict())[0]
    finally:
        _teardown(group, pg)

    assert losses_resumed == {2: losses_full[2], 3: losses_full[3]}  # exact, not approx
    for name, value in weights_full.items():
        assert torch.equal(weights_resumed[name], value), name


def test_sleep_wake_and_bad_inputs(ray_cluster, pipeline, family, tmp_path):
    args = make_args(pipeline, tmp_path, custom_train_input_function_path="tests.support.trainer.drop_pairs_on_rank1")
    group, pg, _ = _spawn(args, role="critic")
    try:
        before = ray.get(group.async_get_full_state_dict())[0]
        ray.get(group.async_sleep())
        assert ray.get(group.async_sleep_state()) == ["asleep", "asleep"]
        with pytest.raises(ray.exceptions.RayTaskError, match="asleep; call wake_up"):
            ray.get(group.async_train(0, _boxes(family, 0)[1]))
        ray.get(group.async_wake_up())
        assert ray.get(group.async_sleep_state()) == ["awake", "awake"]
        after = ray.get(group.async_get_full_state_dict())[0]
        assert all(torch.equal(after[k], v) for k, v in before.items())
        # Rank 1's hook drops a pair: every rank raises before any model collective, nothing hangs. Rank 1 names
        # what its hook did; rank 0 names rank 1.
        errors = _rank_errors(group.async_train(0, _boxes(family, 0)[1]))
        hook = "train-input hook tests.support.trainer.drop_pairs_on_rank1"
        assert f"{hook} failed its check on DP rank 1 of the critic group" in errors[0]
        assert f"{hook} returned 3 train pairs for the 4 it was given" in errors[1]
    finally:
        _teardown(group, pg)


def test_bad_hook_path_fails_in_the_driver_before_any_rank_starts(pipeline, tmp_path):
    # The driver imports every hook path once, before Ray: no rank is spawned to find it out.
    args = make_args(pipeline, tmp_path, custom_loss_function_path="miles.no_such_module.loss")
    with pytest.raises(
        ArgumentValidationError, match="^--custom-loss-function-path: .*miles.no_such_module.loss.*cannot import"
    ):
        run_spec(args)


def test_actor_ranks_generate_their_dmd2_shards_and_a_converter_that_breaks_the_split_is_named(
    ray_cluster, pipeline, tmp_path
):
    """Each actor rank samples its own shard on its student (seed [DMD2 4/7]); the pairs stay on the rank for its
    own train and are boxed for the paired ranks of the other groups."""
    data = tmp_path / "digits.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"a handwritten digit {d}", "label": d}) + "\n" for d in range(5)))
    args = make_args(
        pipeline, tmp_path, "--loss-type", "dmd2", "--teacher-load", str(pipeline), "--n-samples-per-prompt", "2",
        "--dmd2-critic-steps-per-rollout", "1", "--dmd2-teacher-guidance-scale", "4.0", "--rollout-seed", "11",
        "--rollout-batch-size", "4", "--micro-batch-size", "2", train_only=False, prompt_data=str(data),
        custom_expand_samples_to_train_pairs_path="tests.support.trainer.dmd2_pairs_without_sample_99",
    )  # fmt: skip
    group, pg, _ = _spawn(args)  # the actor group of the DMD2 run (the critic is not spawned)
    try:
        shards = RolloutManager(data_spec(args), dp_size=WORLD).shards(0)
        results = ray.get(group.async_generate(0, [Box(ray.put(shard)) for shard in shards]))
        assert all(isinstance(result, RolloutResult) for result in results)
        assert [result.num_pairs for result in results] == [4, 4]
        assert "perf/actor-generate_time" in results[0].perf
        per_rank = [ray.get(result.pairs.inner) for result in results]
        pairs = per_rank[0] + per_rank[1]
        assert all(isinstance(pair, TrainPair) for pair in pairs)
        assert [pair.sample_index for pair in pairs] == list(range(8))
        assert [pair.step_index for pair in pairs] == stop_at_random_step(args, 0, list(range(8)), 4)
        sigmas = [1.0, 0.9, 0.75, 0.5]
        for pair in pairs:
            assert pair.sigma == pytest.approx(sigmas[pair.step_index])
            assert pair.timestep == pytest.approx(pair.sigma * 1000)
            assert pair.latent.shape == pair.x0.shape == (1, 8, 8)
            assert set(pair.neg_cond) == {"encoder_hidden_states", "pooled_projections"}  # teacher CFG 4 > 1
            if pair.step_index == 0:
                assert torch.equal(pair.latent, initial_noise((1, 8, 8), 11, 0, [pair.sample_index])[0])
        # samples 2j and 2j+1 come from prompt j: same cond, different noise
        for j in range(4):
            a, b = pairs[2 * j], pairs[2 * j + 1]
            assert torch.equal(a.pos_cond["pooled_projections"], b.pos_cond["pooled_projections"])
        assert not torch.equal(pairs[0].pos_cond["pooled_projections"], pairs[2].pos_cond["pooled_projections"])

        # The converter drops rank 1's sample 99: every rank raises naming the hook, before any train collective.
        uneven = [
            PromptShard(1, [0, 1], shards[0].prompts[:2], shards[0].records[:2]),
            PromptShard(1, [98, 99], shards[1].prompts[:2], shards[1].records[:2]),
        ]
        errors = _rank_errors(group.async_generate(1, [Box(ray.put(shard)) for shard in uneven]))
        converter = "converter tests.support.trainer.dmd2_pairs_without_sample_99"
        assert f"{converter} failed its check on DP rank 1 of the actor group" in errors[0]
        assert f"{converter} returned 1 train pairs for 2 samples" in errors[1]
    finally:
        _teardown(group, pg)


# -- in-process pieces --------------------------------------------------------------------------------------------
def test_hooks_are_imported_once_by_the_driver_and_an_unset_prepare_or_loss_hook_is_named(pipeline, tmp_path):
    scoring = "miles.backends.fsdp_utils.loss_hub.dmd2.predict_teacher_and_critic_x0"
    args = make_args(pipeline, tmp_path, custom_train_output_function_path=scoring)
    hooks = resolve_hooks(args).group.over(GroupHooks(prepare=prepare_sft_batch, loss=sft_loss_formula))
    assert check_hooks(hooks) is hooks
    assert hooks.prepare is prepare_sft_batch and hooks.loss is sft_loss_formula and hooks.train_input is None
    assert hooks.train_output.__name__ == "predict_teacher_and_critic_x0"
    assert hooks.names() == {"prepare": SFT_PREPARE, "loss": SFT_LOSS, "train_output": scoring}
    with pytest.raises(ValueError, match="--custom-loss-function-path is unset"):
        check_hooks(dataclasses.replace(hooks, loss=None))
    args.custom_loss_function_path = "miles.backends.fsdp_utils.loss_hub.sft.no_such_fn"
    with pytest.raises(ArgumentValidationError, match="has no attribute 'no_such_fn'"):
        resolve_hooks(args)


def test_split_windows_even_and_uneven():
    pairs = list(range(12))
    assert split_windows(pairs, 3, 3) == [[[0, 1, 2], [3]], [[4, 5, 6], [7]], [[8, 9, 10], [11]]]
    assert split_windows(pairs, 1, 12) == [[pairs]]
    with pytest.raises(ValueError, match="12 train pairs per rank do not split into 5 equal optimizer steps"):
        split_windows(pairs, 5, 1)
    with pytest.raises(ValueError, match="shard is empty"):
        split_windows([], 1, 1)


def test_metric_keys_carry_non_actor_roles():
    assert metric_key("actor", "loss") == "train/loss"
    assert metric_key("critic", "grad_norm") == "train/critic-grad_norm"
