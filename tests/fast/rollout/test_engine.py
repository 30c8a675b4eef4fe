"""The rollout engine: step rules against hand-written loops, stopping at step i, seeds, the negative cond, data
samples of ``--train-only`` and the converter's checked output."""

import json

import pytest
import torch

from miles.driver.arguments import parse_args
from miles.models.digits import init_digits_pipeline
from miles.ray.data_conversion_hub.sft import expand_samples_to_train_pairs
from miles.ray.rollout import RolloutManager
from miles.rollout.conditioning import PromptConditioner
from miles.rollout.engine import convert_samples, data_samples
from miles.utils.misc import make_generator
from miles.utils.sampling import FlowNoiseSchedule, initial_noise, sample_latents
from miles.utils.types import TrainPair
from tests.support.rollout import STOP_STEPS_HOOK, engine_spec, make_engine, prompt_shard

PROMPTS = ["a handwritten digit 3", "a handwritten digit 3", "a handwritten digit 8", "a handwritten digit 0"]
INDICES = [0, 1, 2, 3]
SIGMAS = [1.0, 0.9, 0.75, 0.5, 0.0]  # shift 3, 4 steps


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return init_digits_pipeline(tmp_path_factory.mktemp("digits"), seed=0, num_layers=1, attention_head_dim=8)


def make_args(pipeline, *extra, stops=None):
    """Engine args; ``stops`` (sample index → stop step) go through a real step-strategy hook."""
    base = ["--hf-checkpoint", str(pipeline), "--prompt-data", "unused.jsonl", "--num-rollout", "1"]
    args = parse_args(base + ["--rollout-batch-size", "4", "--rollout-seed", "7", *extra])
    if stops is not None:
        args.diffusion_step_strategy_path = STOP_STEPS_HOOK
        args.test_stop_steps = stops
    return args


@pytest.fixture(scope="module")
def engine(pipeline):
    return make_engine(make_args(pipeline), pipeline)


def stopping_engine(pipeline, conditioner, *extra):
    """An engine whose stop steps the test sets on ``engine.args.test_stop_steps``."""
    return make_engine(make_args(pipeline, *extra, stops={}), pipeline, conditioner=conditioner)


def hand_loop(engine, prompts, indices, rollout_id, rule, guidance=1.0):
    """The step rules of docs/architecture.md written out: x̂0 = x − σ·v; dmd2 re-noises with fresh noise, euler steps the ODE."""
    family, model, encoder = engine.family, engine.denoiser, engine.conditioner.encoder
    cond = family.encode_prompts(encoder, prompts)
    neg = family.encode_prompts(encoder, [""] * len(prompts))
    x = torch.stack([torch.randn(1, 8, 8, generator=make_generator("init_noise", 7, rollout_id, i)) for i in indices])
    xs, x0s = [], []
    for k in range(4):
        t = torch.full((len(prompts),), SIGMAS[k] * 1000)
        with torch.no_grad():
            v = model(hidden_states=x, timestep=t, **cond).sample
            if guidance != 1.0:
                v_u = model(hidden_states=x, timestep=t, **neg).sample
                v = v_u + guidance * (v - v_u)
        x0 = x - SIGMAS[k] * v
        xs.append(x)
        x0s.append(x0)
        if rule == "dmd2":
            eps = torch.stack(
                [torch.randn(1, 8, 8, generator=make_generator("renoise", 7, rollout_id, i, k)) for i in indices]
            )
            x = (1 - SIGMAS[k + 1]) * x0 + SIGMAS[k + 1] * eps
        else:
            x = x + (SIGMAS[k + 1] - SIGMAS[k]) * v
    return torch.stack(xs, 1), torch.stack(x0s, 1), x


def test_dmd2_rule_equals_the_hand_written_loop(engine):
    samples = engine.generate(prompt_shard(3, PROMPTS, INDICES))
    xs, x0s, final = hand_loop(engine, PROMPTS, INDICES, 3, "dmd2")
    for b, sample in enumerate(samples):
        trajectory = sample.trajectory
        assert trajectory.step_indices == [0, 1, 2, 3]
        torch.testing.assert_close(trajectory.sigmas, torch.tensor(SIGMAS, dtype=torch.float64))
        torch.testing.assert_close(trajectory.latents, xs[b], rtol=0, atol=1e-6)
        torch.testing.assert_close(trajectory.x0_preds, x0s[b], rtol=0, atol=1e-6)
        torch.testing.assert_close(trajectory.final, final[b], rtol=0, atol=1e-6)
        assert trajectory.latents.dtype == trajectory.x0_preds.dtype == torch.float32
    # the final sample is the last x0 prediction, and the samples actually moved
    assert torch.equal(samples[0].trajectory.final, samples[0].trajectory.x0_preds[-1])
    assert (samples[0].trajectory.final - samples[0].trajectory.latents[0]).abs().mean() > 0.1


def test_euler_rule_and_cfg_equal_the_hand_written_loop(pipeline, engine):
    args = make_args(pipeline, "--diffusion-step-rule", "euler", "--diffusion-guidance-scale", "3.0")
    guided = make_engine(args, pipeline, conditioner=PromptConditioner(engine_spec(args), engine.family, pipeline))
    samples = guided.generate(prompt_shard(0, PROMPTS, INDICES))
    xs, x0s, final = hand_loop(guided, PROMPTS, INDICES, 0, "euler", guidance=3.0)
    for b, sample in enumerate(samples):
        torch.testing.assert_close(sample.trajectory.latents, xs[b], rtol=0, atol=1e-6)
        torch.testing.assert_close(sample.trajectory.x0_preds, x0s[b], rtol=0, atol=1e-6)
        torch.testing.assert_close(sample.trajectory.final, final[b], rtol=0, atol=1e-5)
        assert sample.env.guidance_scale == 3.0 and sample.env.neg_cond


def test_stopping_at_step_i_returns_the_prefix_of_the_full_rollout(pipeline, engine):
    full = engine.generate(prompt_shard(5, PROMPTS, INDICES))
    stopping = stopping_engine(pipeline, engine.conditioner)
    for stops in ([0, 1, 2, 3], [3, 0, 2, 1], [1, 1, None, 0]):
        stopping.args.test_stop_steps = dict(zip(INDICES, stops))
        stopped = stopping.generate(prompt_shard(5, PROMPTS, INDICES))
        for sample, ref, step in zip(stopped, full, stops):
            if step is None:
                assert torch.equal(sample.trajectory.final, ref.trajectory.final)
                continue
            trajectory = sample.trajectory
            assert trajectory.step_indices == [step] and trajectory.final is None
            assert torch.equal(trajectory.latents[0], ref.trajectory.latents[step])
            assert torch.equal(trajectory.x0_preds[0], ref.trajectory.x0_preds[step])
            sigma = float(trajectory.sigmas[step])
            assert trajectory.timesteps[step] == sigma * 1000


def test_sync_last_step_runs_the_steps_every_rank_runs(pipeline, engine):
    """FSDP ranks run the same forwards: a rank whose own samples stop early still runs up to the synced step, and
    its samples are unchanged by it."""
    stopping = stopping_engine(pipeline, engine.conditioner)
    stopping.args.test_stop_steps = {0: 0, 1: 1}
    asked = []

    def sync(last_step):
        asked.append(last_step)
        return 3

    shard = prompt_shard(2, PROMPTS[:2], [0, 1])
    synced = stopping.generate(shard, sync_last_step=sync)
    assert asked == [1]
    for sample, ref in zip(synced, stopping.generate(shard)):
        assert torch.equal(sample.trajectory.x0_preds, ref.trajectory.x0_preds)


def test_same_seed_is_bit_identical_and_indices_change_the_noise(engine, pipeline):
    first = engine.generate(prompt_shard(1, PROMPTS, INDICES))
    second = engine.generate(prompt_shard(1, PROMPTS, INDICES))
    for a, b in zip(first, second):
        assert torch.equal(a.trajectory.latents, b.trajectory.latents)
        assert torch.equal(a.trajectory.final, b.trajectory.final)
    # samples 0 and 1 share their prompt but not their index: different initial noise and result
    assert not torch.equal(first[0].trajectory.latents[0], first[1].trajectory.latents[0])
    assert not torch.equal(first[0].trajectory.final, first[1].trajectory.final)
    # another rollout id or rollout seed draws other noise
    other_rollout = engine.generate(prompt_shard(2, PROMPTS, INDICES))
    assert not torch.equal(other_rollout[0].trajectory.latents[0], first[0].trajectory.latents[0])
    assert torch.equal(first[2].trajectory.latents[0], initial_noise((1, 8, 8), 7, 1, [2])[0])
    reseeded = make_engine(make_args(pipeline, "--rollout-seed", "8"), pipeline, conditioner=engine.conditioner)
    assert not torch.equal(
        reseeded.generate(prompt_shard(1, PROMPTS[:1], [0]))[0].trajectory.latents[0], first[0].trajectory.latents[0]
    )


def test_negative_cond_follows_its_consumers(pipeline, engine):
    sft = engine.generate(prompt_shard(0, PROMPTS[:2], [0, 1]))
    assert sft[0].env.neg_cond == {} and sft[0].env.guidance_scale == 1.0
    # dmd2 with teacher CFG > 1 and an unguided student: the method asks for the negative prompt's cond
    args = make_args(
        pipeline,
        "--loss-type",
        "dmd2",
        "--teacher-load",
        str(pipeline),
        "--dmd2-teacher-guidance-scale",
        "4.5",
        "--dmd2-critic-steps-per-rollout",
        "1",
        "--negative-prompt",
        "blurry",
        stops={0: 1, 1: 2},
    )
    assert args.encode_negative_prompt
    dmd2 = make_engine(args, pipeline)
    samples = dmd2.generate(prompt_shard(0, PROMPTS[:2], [0, 1]))
    expected = engine.family.encode_prompts(engine.conditioner.encoder, ["blurry"])
    for sample in samples:
        assert sample.env.guidance_scale == 1.0
        assert torch.equal(sample.env.neg_cond["encoder_hidden_states"], expected["encoder_hidden_states"][0])
        assert torch.equal(sample.env.neg_cond["pooled_projections"], expected["pooled_projections"][0])
    # unguided: the negative cond does not change the rollout
    plain = stopping_engine(pipeline, engine.conditioner)
    plain.args.test_stop_steps = {0: 1, 1: 2}
    unguided = plain.generate(prompt_shard(0, PROMPTS[:2], [0, 1]))
    assert torch.equal(unguided[1].trajectory.x0_preds, samples[1].trajectory.x0_preds)
    forced = make_engine(make_args(pipeline, "--encode-negative-prompt"), pipeline, conditioner=engine.conditioner)
    assert forced.generate(prompt_shard(0, PROMPTS[:1], [0]))[0].env.neg_cond


def test_sample_latents_reproduces_the_engine_and_runs_teacher_style(engine):
    samples = engine.generate(prompt_shard("eval", PROMPTS, INDICES))
    family, conditioner = engine.family, engine.conditioner
    records = [{"prompt": prompt} for prompt in PROMPTS]
    latents = sample_latents(
        family,
        engine.denoiser,
        lambda start, end: conditioner.cond(PROMPTS[start:end], records[start:end]),
        INDICES,
        latent_shape=(1, 8, 8),
        schedule=FlowNoiseSchedule(4, 3.0),
        guidance_scale=1.0,
        step_rule="dmd2",
        seed=7,
        batch_size=1,
    )
    # Bit-identical at the engine's batching (--micro-batch-size 1); other batchings agree to float rounding.
    assert torch.equal(latents, torch.stack([s.trajectory.final for s in samples]))
    assert torch.equal(engine.sample(prompt_shard("eval", PROMPTS, INDICES), batch_size=1), latents)
    torch.testing.assert_close(engine.sample(prompt_shard("eval", PROMPTS, INDICES)), latents, rtol=0, atol=1e-5)
    teacher = sample_latents(
        family,
        engine.denoiser,
        lambda start, end: family.encode_prompts(conditioner.encoder, PROMPTS[start:end]),
        list(range(4)),
        latent_shape=(1, 8, 8),
        schedule=FlowNoiseSchedule(6, 3.0),
        guidance_scale=4.0,
        step_rule="euler",
        seed=0,
        negative=conditioner.negative(),
        batch_size=3,
    )
    images = family.latents_to_images(teacher)
    assert images.shape == (4, 8, 8, 1) and images.dtype == torch.uint8
    # engine.sample's overrides: more steps and CFG give other samples than the rollout's schedule
    other = engine.sample(prompt_shard("eval", PROMPTS, INDICES), num_steps=6, guidance_scale=4.0)
    assert other.shape == latents.shape and not torch.equal(other, latents)


def test_bad_stop_steps_and_rules_are_rejected(engine, pipeline):
    stopping = stopping_engine(pipeline, engine.conditioner)
    stopping.args.test_stop_steps = {0: 0, 1: 4}
    with pytest.raises(ValueError, match=rf"{STOP_STEPS_HOOK} stops sample 1 at step 4, outside \[0, 4\)"):
        stopping.generate(prompt_shard(0, PROMPTS[:2], [0, 1]))
    stopping.args.test_stop_steps = [0]
    with pytest.raises(ValueError, match="returned 1 stop steps for 2 samples"):
        stopping.generate(prompt_shard(0, PROMPTS[:2], [0, 1]))
    args = make_args(pipeline)
    args.diffusion_step_rule = "heun"
    with pytest.raises(ValueError, match="--diffusion-step-rule 'heun' is unknown"):
        make_engine(args, pipeline, conditioner=engine.conditioner)
    with pytest.raises(ValueError, match="--diffusion-step-rule"):
        sample_latents(
            engine.family, engine.denoiser, lambda start, end: engine.conditioner.cond(["x"], [{}]), [0],
            latent_shape=(1, 8, 8), schedule=FlowNoiseSchedule(2, 1.0), guidance_scale=1.0, step_rule="heun", seed=0,
        )  # fmt: skip


# -- --train-only data samples and the converter -----------------------------------------------------------------
@pytest.fixture(scope="module")
def digits_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    records = [
        {"prompt": f"a handwritten digit {d}", "label": d, "image": [[(d * 16 + x + y) % 256 for x in range(8)] for y in range(8)]}
        for d in range(5)
    ]  # fmt: skip
    path = root / "digits.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path, records


def test_train_only_sft_pairs_carry_the_data_images(pipeline, engine, digits_data):
    data, records = digits_data
    args = parse_args(
        ["--hf-checkpoint", str(pipeline), "--prompt-data", str(data), "--train-only", "--rollout-shuffle"]
        + ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
    )
    spec = engine_spec(args)
    manager = RolloutManager(spec.data, dp_size=1)
    (shard,) = manager.shards(0)
    samples = data_samples(spec, engine.family, engine.conditioner, shard, (1, 8, 8))
    pairs = convert_samples(args, expand_samples_to_train_pairs, samples)
    order = manager.data_source._epoch_order(0)
    assert [pair.sample_index for pair in pairs] == [0, 1, 2, 3]
    for pair in pairs:
        record = records[order[pair.sample_index // 2]]
        image = torch.tensor(record["image"], dtype=torch.float32)
        torch.testing.assert_close(pair.x0, (image / 255 * 2 - 1)[None])
        assert type(pair) is TrainPair and pair.neg_cond == {} and pair.extras == {}
        expected = engine.family.encode_prompts(engine.conditioner.encoder, [record["prompt"]])
        assert torch.equal(pair.pos_cond["encoder_hidden_states"], expected["encoder_hidden_states"][0])
    assert samples[0].metadata == {"label": records[order[0]]["label"]}
    assert all(sample.trajectory is None for sample in samples)  # data samples are not sampled
    (next_shard,) = manager.shards(1)
    assert data_samples(spec, engine.family, engine.conditioner, next_shard, (1, 8, 8))[0].metadata == {
        "label": records[order[2]]["label"]
    }
    # a latent shape the model does not take is rejected naming the sample
    with pytest.raises(ValueError, match="--train-only sample 0 .*latent of shape \\(1, 8, 8\\) but the model takes"):
        data_samples(spec, engine.family, engine.conditioner, shard, (1, 16, 16))


def test_convert_samples_checks_what_the_converter_returns(engine):
    args = make_args(engine.args.hf_checkpoint)
    samples = engine.generate(prompt_shard(0, PROMPTS[:2], [0, 1]))
    pairs = convert_samples(args, expand_samples_to_train_pairs, samples)
    assert all(isinstance(pair, TrainPair) for pair in pairs) and len(pairs) == 2

    def as_tuple(args, samples):
        return tuple(pairs)

    # The message names the converter that ran (the function the spec holds), by its module and name.
    with pytest.raises(ValueError, match=rf"converter {__name__}\.[a-z_.<>]*as_tuple returned tuple; expected a list"):
        convert_samples(args, as_tuple, samples)
    with pytest.raises(
        ValueError, match="returned a list holding Sample; expected a list of miles.utils.types.TrainPair"
    ):
        convert_samples(args, lambda args, samples: [*pairs, samples[0]], samples)
