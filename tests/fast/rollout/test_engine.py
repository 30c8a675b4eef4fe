"""The embedded sampler: step rules against hand-written loops, stopping at step i, seeds and the negative cond."""

import pytest
import torch

from miles.models import get_model_family
from miles.models.digits import init_digits_pipeline
from miles.rollout.engine import DiffusionEngine, initial_noise, sample_images, sample_latents
from miles.utils.arguments import parse_args
from miles.utils.misc import make_generator

PROMPTS = ["a handwritten digit 3", "a handwritten digit 3", "a handwritten digit 8", "a handwritten digit 0"]
INDICES = [0, 1, 2, 3]
SIGMAS = [1.0, 0.9, 0.75, 0.5, 0.0]  # shift 3, 4 steps


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return init_digits_pipeline(tmp_path_factory.mktemp("digits"), seed=0, num_layers=1, attention_head_dim=8)


def make_args(pipeline, *extra):
    base = ["--hf-checkpoint", str(pipeline), "--prompt-data", "unused.jsonl", "--num-rollout", "1"]
    return parse_args(base + ["--rollout-batch-size", "4", "--rollout-seed", "7", *extra])


@pytest.fixture(scope="module")
def engine(pipeline):
    return DiffusionEngine(make_args(pipeline), get_model_family(pipeline), pipeline, device="cpu")


def hand_loop(engine, prompts, indices, rollout_id, rule, guidance=1.0):
    """The step rules of docs/architecture.md written out: x̂0 = x − σ·v; dmd2 re-noises with fresh noise, euler steps the ODE."""
    family, model = engine.family, engine.denoiser
    cond = family.encode_prompts(engine.encoder, prompts)
    neg = family.encode_prompts(engine.encoder, [""] * len(prompts))
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
    samples = engine.generate(PROMPTS, INDICES, rollout_id=3)
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


def test_euler_rule_and_cfg_equal_the_hand_written_loop(pipeline):
    args = make_args(pipeline, "--diffusion-step-rule", "euler", "--diffusion-guidance-scale", "3.0")
    engine = DiffusionEngine(args, get_model_family(pipeline), pipeline, device="cpu")
    samples = engine.generate(PROMPTS, INDICES, rollout_id=0)
    xs, x0s, final = hand_loop(engine, PROMPTS, INDICES, 0, "euler", guidance=3.0)
    for b, sample in enumerate(samples):
        torch.testing.assert_close(sample.trajectory.latents, xs[b], rtol=0, atol=1e-6)
        torch.testing.assert_close(sample.trajectory.x0_preds, x0s[b], rtol=0, atol=1e-6)
        torch.testing.assert_close(sample.trajectory.final, final[b], rtol=0, atol=1e-5)
        assert sample.env.guidance_scale == 3.0 and sample.env.neg_cond


def test_stopping_at_step_i_returns_the_prefix_of_the_full_rollout(engine):
    full = engine.generate(PROMPTS, INDICES, rollout_id=5)
    for stops in ([0, 1, 2, 3], [3, 0, 2, 1], [1, 1, None, 0]):
        stopped = engine.generate(PROMPTS, INDICES, rollout_id=5, stop_steps=stops)
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


def test_same_seed_is_bit_identical_and_indices_change_the_noise(engine, pipeline):
    first = engine.generate(PROMPTS, INDICES, rollout_id=1)
    second = engine.generate(PROMPTS, INDICES, rollout_id=1)
    for a, b in zip(first, second):
        assert torch.equal(a.trajectory.latents, b.trajectory.latents)
        assert torch.equal(a.trajectory.final, b.trajectory.final)
    # samples 0 and 1 share their prompt but not their index: different initial noise and result
    assert not torch.equal(first[0].trajectory.latents[0], first[1].trajectory.latents[0])
    assert not torch.equal(first[0].trajectory.final, first[1].trajectory.final)
    # another rollout id or rollout seed draws other noise
    other_rollout = engine.generate(PROMPTS, INDICES, rollout_id=2)
    assert not torch.equal(other_rollout[0].trajectory.latents[0], first[0].trajectory.latents[0])
    assert torch.equal(first[2].trajectory.latents[0], initial_noise((1, 8, 8), 7, 1, [2])[0])
    reseeded = DiffusionEngine(
        make_args(pipeline, "--rollout-seed", "8"), engine.family, pipeline, device="cpu", encoder=engine.encoder
    )
    assert not torch.equal(
        reseeded.generate(PROMPTS[:1], [0], 1)[0].trajectory.latents[0], first[0].trajectory.latents[0]
    )


def test_negative_cond_follows_its_consumers(pipeline, engine):
    sft = engine.generate(PROMPTS[:2], [0, 1], rollout_id=0)
    assert sft[0].env.neg_cond == {} and sft[0].env.guidance_scale == 1.0
    # dmd2 with teacher CFG > 1 and an unguided student: the negative prompt's cond is still returned
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
    )
    dmd2 = DiffusionEngine(args, engine.family, pipeline, device="cpu", encoder=engine.encoder)
    samples = dmd2.generate(PROMPTS[:2], [0, 1], rollout_id=0, stop_steps=[1, 2])
    expected = engine.family.encode_prompts(engine.encoder, ["blurry"])
    for sample in samples:
        assert sample.env.guidance_scale == 1.0
        assert torch.equal(sample.env.neg_cond["encoder_hidden_states"], expected["encoder_hidden_states"][0])
        assert torch.equal(sample.env.neg_cond["pooled_projections"], expected["pooled_projections"][0])
    # unguided: the negative cond does not change the rollout
    plain = engine.generate(PROMPTS[:2], [0, 1], rollout_id=0, stop_steps=[1, 2])
    assert torch.equal(plain[1].trajectory.x0_preds, samples[1].trajectory.x0_preds)
    forced = engine.generate(PROMPTS[:1], [0], rollout_id=0, need_negative=True)
    assert forced[0].env.neg_cond


def test_sample_latents_reproduces_the_engine_and_runs_teacher_style(engine):
    samples = engine.generate(PROMPTS, INDICES, rollout_id="eval")
    latents = sample_latents(
        engine.family,
        engine.denoiser,
        engine.encoder,
        PROMPTS,
        num_steps=4,
        shift=3.0,
        guidance_scale=1.0,
        step_rule="dmd2",
        seed=7,
        sample_indices=INDICES,
    )
    assert torch.equal(latents, torch.stack([s.trajectory.final for s in samples]))
    assert torch.equal(engine.sample(PROMPTS, INDICES), latents)
    teacher = sample_images(
        engine.family,
        engine.denoiser,
        engine.encoder,
        PROMPTS,
        num_steps=6,
        shift=3.0,
        guidance_scale=4.0,
        step_rule="euler",
        seed=0,
        batch_size=3,
    )
    assert teacher.shape == (4, 8, 8, 1) and teacher.dtype == torch.uint8


def test_bad_stop_steps_and_rules_are_rejected(engine, pipeline):
    with pytest.raises(ValueError, match="sample 1: stop step 4"):
        engine.generate(PROMPTS[:2], [0, 1], rollout_id=0, stop_steps=[0, 4])
    with pytest.raises(ValueError, match="must match"):
        engine.generate(PROMPTS[:2], [0], rollout_id=0)
    with pytest.raises(ValueError, match="--diffusion-step-rule"):
        sample_latents(
            engine.family, engine.denoiser, engine.encoder, ["x"], num_steps=2, shift=1.0, guidance_scale=1.0,
            step_rule="heun", seed=0,
        )  # fmt: skip


def test_load_weights_replaces_the_denoiser(pipeline):
    family = get_model_family(pipeline)
    engine = DiffusionEngine(make_args(pipeline), family, pipeline, device="cpu")
    before = engine.generate(PROMPTS[:1], [0], rollout_id=0)[0].trajectory.final
    state = {key: value * 0.5 for key, value in engine.denoiser.state_dict().items()}
    engine.load_weights(state)
    assert torch.equal(engine.denoiser.state_dict()["proj_out.weight"], state["proj_out.weight"])
    assert not torch.equal(engine.generate(PROMPTS[:1], [0], rollout_id=0)[0].trajectory.final, before)
    with pytest.raises(RuntimeError, match="does not match"):
        engine.load_weights({"nope": torch.zeros(1)})


def test_sft_conditioning_dropout_needs_the_negative_prompt():
    from types import SimpleNamespace

    from miles.rollout.engine import needs_negative

    args = SimpleNamespace(loss_type="sft_loss", diffusion_guidance_scale=1.0, sft_uncond_prob=0.0)
    assert not needs_negative(args)
    args.sft_uncond_prob = 0.1
    assert needs_negative(args)
