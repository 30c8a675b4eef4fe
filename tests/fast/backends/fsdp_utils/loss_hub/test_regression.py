"""DMD's regression loss without Ray: the per-pair value and gradient on constructed tensors, the student's batch with
its regression rows, the combined loss against its two halves, and the offline pairs against a plain Euler loop.

The actor side uses the toy models of ``test_dmd2``; the offline command runs the real tiny digits pipeline.
"""

import json

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub.dmd2 import dmd2_loss_formula, prepare_generator_batch
from miles.backends.fsdp_utils.loss_hub.regression import (
    REGRESSION_DATA,
    dmd2_regression_loss,
    first_sigma,
    prepare_generator_regression_batch,
    regression_loss_per_pair,
)
from miles.backends.fsdp_utils.trainer import host_values
from miles.rollout.regression_pairs import regression_noise, write_regression_pairs
from miles.utils.misc import make_generator
from miles.utils.types import DenoisingEnv, Sample
from tests.fast.backends.fsdp_utils.loss_hub.test_dmd2 import (
    C,
    H,
    W,
    make_args,
    make_cond,
    make_ctx,
    make_dmd2_pairs,
    random_scores,
)


def _args(**overrides):
    values = dict(diffusion_num_steps=4, diffusion_flow_shift=3.0, diffusion_timesteps=None)
    values.update(overrides)
    return make_args(dmd2_regression_weight=0.25, dmd2_regression_pairs="pairs.jsonl", **values)


def _with_regression_pairs(pairs, seed: int = 9):
    gen = torch.Generator().manual_seed(seed)
    for j, pair in enumerate(pairs):
        pair.extras[REGRESSION_DATA] = Sample(
            index=pair.sample_index,
            prompt=f"regression prompt {j}",
            metadata={"regression_seed": 7, "regression_index": 40 + j},
            env=DenoisingEnv(pos_cond=make_cond(gen)),
            x0=torch.randn(C, H, W, generator=gen),
        )
    return pairs


def test_the_per_pair_loss_and_its_gradient_on_constructed_tensors():
    noise = torch.ones(2, 1, 2, 2)
    target = torch.zeros(2, 1, 2, 2)
    target[1] = 0.5
    velocity = torch.full((2, 1, 2, 2), 0.5, requires_grad=True)
    loss, x0 = regression_loss_per_pair(velocity, noise, target, 1.0)
    # x̂0 = z − σ·v = 0.5 everywhere: pair 0 is 0.5 from its target in each of 4 elements, pair 1 is on it.
    assert x0.tolist() == torch.full((2, 1, 2, 2), 0.5).tolist()
    assert loss.tolist() == [0.25, 0.0]
    loss.sum().backward()
    # ∂loss_j/∂v = −σ·2(x̂0 − y)/numel = −2·0.5/4 for pair 0, 0 for pair 1.
    assert velocity.grad[0].unique().tolist() == [-0.25] and velocity.grad[1].unique().tolist() == [0.0]
    # At σ_0 = 0.9 (a grid without the pure-noise point): x̂0 = 1 − 0.9·0.5 = 0.55.
    assert regression_loss_per_pair(velocity.detach(), noise, target, 0.9)[0][0].item() == pytest.approx(0.55**2)


def test_sigma_0_is_the_student_schedules_first_point():
    assert first_sigma(_args()) == 1.0
    assert first_sigma(_args(diffusion_timesteps=[800.0, 500.0])) == pytest.approx(0.8)


def test_the_batch_appends_one_regression_row_per_pair_after_the_dmd2_rows():
    pairs = _with_regression_pairs(make_dmd2_pairs(3))
    ctx = make_ctx(args=_args())
    batch = prepare_generator_regression_batch(ctx, pairs)
    plain = prepare_generator_batch(ctx, pairs)
    assert torch.equal(batch.latents[:3], plain.latents) and torch.equal(batch.timestep[:3], plain.timestep)
    for key in plain.cond:
        assert torch.equal(batch.cond[key][:3], plain.cond[key])
        assert torch.equal(batch.cond[key][3:], torch.stack([p.extras["regression"].env.pos_cond[key] for p in pairs]))
    # The noise is the keyed draw of each record (seed 7, indices 40..42), at the first step's timestep.
    expected = torch.stack([torch.randn(C, H, W, generator=make_generator("init_noise", 7, "regression", 40 + j))
                            for j in range(3)])  # fmt: skip
    assert torch.equal(batch.latents[3:], expected)
    assert torch.equal(batch.extras["regression_noise"], expected)
    assert batch.timestep[3:].tolist() == [1000.0] * 3 and batch.extras["regression_sigma"] == 1.0
    assert torch.equal(batch.extras["regression_target"], torch.stack([p.extras["regression"].x0 for p in pairs]))
    assert batch.extras["regression_batch"] == 3 and batch.extras["sigma"].tolist() == plain.extras["sigma"].tolist()


def test_a_pair_without_its_regression_record_is_named():
    pairs = make_dmd2_pairs(2)
    with pytest.raises(ValueError, match="train pair 100 carries no regression pair"):
        prepare_generator_regression_batch(make_ctx(args=_args()), pairs)
    _with_regression_pairs(pairs)
    del pairs[1].extras["regression"].metadata["regression_index"]
    with pytest.raises(ValueError, match="has no 'regression_index' field"):
        prepare_generator_regression_batch(make_ctx(args=_args()), pairs)


def test_the_loss_is_the_dmd2_loss_of_the_first_rows_plus_w_times_the_regression_loss():
    pairs = _with_regression_pairs(make_dmd2_pairs(3))
    external = {"critic": random_scores(pairs, seed=5)}
    ctx = make_ctx(args=_args(), external_data=external)
    batch = prepare_generator_regression_batch(ctx, pairs)
    v = torch.randn(6, C, H, W, generator=torch.Generator().manual_seed(6), requires_grad=True)
    metrics: dict[str, list] = {}
    loss = dmd2_regression_loss(ctx, pairs, batch, new_pred=v, metrics=metrics)
    loss.backward()

    # The DMD2 half, on its own batch and the same velocities, as a run without the term computes it.
    v_dm = v.detach()[:3].clone().requires_grad_(True)
    dm_metrics: dict[str, list] = {}
    dm = dmd2_loss_formula(ctx, pairs, prepare_generator_batch(ctx, pairs), new_pred=v_dm, metrics=dm_metrics)
    dm.backward()
    x0 = batch.extras["regression_noise"] - v.detach()[3:]  # σ_0 = 1
    target = batch.extras["regression_target"]
    reg = (x0 - target).pow(2).flatten(1).mean(dim=1)
    torch.testing.assert_close(loss.detach(), dm.detach() + 0.25 * reg.sum(), rtol=0, atol=1e-6)
    assert torch.equal(v.grad[:3], v_dm.grad)  # the DM rows' gradient is untouched by the term
    torch.testing.assert_close(v.grad[3:], 0.25 * -2 * (x0 - target) / (C * H * W), rtol=1e-6, atol=1e-8)
    host, dm_host = host_values(metrics), host_values(dm_metrics)
    assert host["dmd2_regression_loss"] == pytest.approx(reg.tolist(), rel=1e-6)
    assert {key: host[key] for key in dm_host} == dm_host


def test_the_offline_pairs_are_the_teachers_euler_ode_from_the_keyed_noise(tmp_path):
    from miles.models.digits import DigitsFamily
    from tests.support.trainer import make_pipeline

    teacher = make_pipeline(tmp_path / "digits")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a handwritten digit {d}", "label": i}) + "\n"
                               for i, d in enumerate(("zero", "one", "two"))))  # fmt: skip
    out = tmp_path / "pairs"
    manifest = write_regression_pairs(teacher, prompts, out, num_pairs=4, num_steps=3, seed=11, batch_size=3)
    assert (manifest["count"], manifest["num_steps"], manifest["guidance_scale"], manifest["flow_shift"]) == (
        4, 3, 1.0, 3.0)  # fmt: skip
    records = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert [(r["label"], r["regression_seed"], r["regression_index"]) for r in records] == [
        (0, 11, 0), (1, 11, 1), (2, 11, 2), (0, 11, 3)]  # fmt: skip
    from safetensors.torch import load_file

    family = DigitsFamily(teacher)
    denoiser = family.load_denoiser(str(teacher)).eval()
    encoder = family.load_text_encoder(teacher)
    # The shift-3 grid of 3 steps: s = 1, 2/3, 1/3 and σ = 3s / (1 + 2s), then the terminal 0.
    s = torch.linspace(1, 1 / 3, 3, dtype=torch.float64)
    sigmas = (3 * s / (1 + 2 * s)).tolist() + [0.0]
    for record in records:
        stored = load_file(str(out / record["latent"]))
        z = regression_noise((1, 8, 8), 11, [record["regression_index"]])
        assert torch.equal(stored["noise"], z[0])
        # The flow ODE by hand: x ← x + (σ_{k+1} − σ_k)·v(x, σ_k·1000), float32.
        x = z.clone()
        cond = family.encode_prompts(encoder, [record["prompt"]])
        with torch.no_grad():
            for k in range(3):
                v = family.predict_velocity(denoiser, x, torch.tensor([sigmas[k] * 1000.0]), cond)
                x = x + (sigmas[k + 1] - sigmas[k]) * v
        torch.testing.assert_close(stored["latent"], x[0], rtol=0, atol=1e-5)
    # The same command again writes the same pairs (the same batch size: a forward's batch moves the low bits).
    again = write_regression_pairs(
        teacher, prompts, tmp_path / "again", num_pairs=4, num_steps=3, seed=11, batch_size=3
    )
    assert again["count"] == 4
    for record in records:
        assert torch.equal(load_file(str(out / record["latent"]))["latent"],
                           load_file(str(tmp_path / "again" / record["latent"]))["latent"])  # fmt: skip
