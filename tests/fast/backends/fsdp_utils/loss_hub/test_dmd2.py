"""DMD2 hooks: critic batch, teacher/critic scoring, the generator batch and the distribution-matching surrogate.

The models are tiny deterministic torch modules behind a minimal model family (``predict_velocity`` calls the module
with the cond kwargs); the model families themselves are tested in tests/fast/models.
"""

import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from miles.backends.fsdp_utils.loss_hub.dmd2 import (
    NORMALIZER_FLOOR,
    dmd2_loss_formula,
    predict_teacher_and_critic_x0,
    prepare_critic_batch,
    prepare_generator_batch,
    record_rollout_train_abs_diff,
)
from miles.backends.fsdp_utils.loss_hub.dmd2_types import DMD2Pair
from miles.backends.fsdp_utils.loss_hub.sft import prepare_sft_batch
from miles.backends.fsdp_utils.loss_hub.types import TrainContext
from miles.backends.fsdp_utils.trainer import host_values
from miles.models import TrueCFG
from miles.utils.misc import make_generator
from miles.utils.sampling import FlowNoiseSchedule
from miles.utils.types import TrainPair
from tests.support.trainer import dmd2_args

C, H, W, L, D, P = 2, 4, 4, 3, 5, 6


class CallFamily(TrueCFG):
    """The family methods the hooks use: the denoiser takes ``(latents, timestep, **cond)`` and returns v; the
    teacher is guided by true CFG (the declared guidance form)."""

    def predict_velocity(self, denoiser, latents, timestep, cond):
        return denoiser(latents, timestep, **cond).float()


class CondVelocity(nn.Module):
    """A deterministic cond-dependent velocity model that records its inputs."""

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.scale = nn.Parameter(torch.randn(C, 1, 1, generator=gen))
        self.pooled = nn.Linear(P, C)
        with torch.no_grad():
            self.pooled.weight.copy_(torch.randn(C, P, generator=gen))
            self.pooled.bias.copy_(torch.randn(C, generator=gen))
        self.calls = []

    def forward(self, latents, timestep, encoder_hidden_states, pooled_projections):
        self.calls.append({"latents": latents.clone(), "timestep": timestep.clone(), "pooled": pooled_projections})
        text = self.pooled(pooled_projections) + encoder_hidden_states.mean(dim=(1, 2))[:, None]
        return self.scale * latents + (timestep / 1000)[:, None, None, None] + text[:, :, None, None]


def make_args(**overrides):
    values = dict(
        seed=1234,
        fsdp_flow_shift=3.0,
        micro_batch_size=2,
        dmd2_teacher_guidance_scale=1.0,
        dmd2_min_timestep_ratio=0.02,
        dmd2_max_timestep_ratio=0.98,
        sft_uncond_prob=0.0,
    )
    values.update(overrides)
    return dmd2_args(**values)


def make_ctx(args=None, models=None, teacher_models=None, external_data=None, dp_rank=0, rollout_id=3, mb=0):
    return TrainContext(
        args=args or make_args(),
        models=models if models is not None else {"transformer": CondVelocity(1)},
        teacher_models=teacher_models if teacher_models is not None else {"transformer": CondVelocity(2)},
        external_data=external_data or {},
        family=CallFamily(),
        device=torch.device("cpu"),
        dtype=torch.float32,
        rollout_id=rollout_id,
        microbatch_id=mb,
        dp_rank=dp_rank,
        dp_size=2,
    )


def make_cond(gen):
    return {
        "encoder_hidden_states": torch.randn(L, D, generator=gen),
        "pooled_projections": torch.randn(P, generator=gen),
    }


def make_dmd2_pairs(count: int, seed: int = 0, with_neg: bool = True) -> list[DMD2Pair]:
    gen = torch.Generator().manual_seed(seed)
    schedule = FlowNoiseSchedule(4, 3.0)
    pairs = []
    for j in range(count):
        step = j % 4
        pairs.append(
            DMD2Pair(
                sample_index=100 + 3 * j,
                x0=torch.randn(C, H, W, generator=gen),
                pos_cond=make_cond(gen),
                neg_cond=make_cond(gen) if with_neg else {},
                latent=torch.randn(C, H, W, generator=gen),
                sigma=float(schedule.sigmas[step]),
                timestep=float(schedule.timesteps[step]),
                step_index=step,
            )
        )
    return pairs


def make_batched_cond(pairs, which: str) -> dict[str, torch.Tensor]:
    conds = [getattr(pair, which) for pair in pairs]
    return {key: torch.stack([cond[key] for cond in conds]) for key in conds[0]}


def expected_scoring_draws(args, rollout_id, dp_rank, pairs):
    """Recompute the scoring σ and x_σ per micro-batch from the seed (independently of the hook)."""
    grid = FlowNoiseSchedule(1000, args.fsdp_flow_shift)
    t = grid.timesteps
    allowed = [k for k in range(1000) if 20 <= t[k] <= 980]
    sigmas, x_sigmas = [], []
    for mb, start in enumerate(range(0, len(pairs), args.micro_batch_size)):
        chunk = pairs[start : start + args.micro_batch_size]
        gen = make_generator("dmd2_score", args.seed, rollout_id, mb, dp_rank)
        pick = torch.randint(0, len(allowed), (len(chunk),), generator=gen)
        noise = torch.randn(len(chunk), C, H, W, generator=gen)
        sigma = grid.sigmas[torch.tensor(allowed)[pick]]
        s = sigma.float().view(-1, 1, 1, 1)
        x0 = torch.stack([p.x0 for p in chunk])
        sigmas.append(sigma)
        x_sigmas.append((1 - s) * x0 + s * noise)
    return torch.cat(sigmas), x_sigmas


# ----------------------------------------------------------------------------------------------------- critic steps


def test_critic_batch_equals_sft_batch_on_rollout_x0_and_positive_cond():
    pairs = make_dmd2_pairs(3)
    ctx = make_ctx(mb=4, dp_rank=1)
    critic = prepare_critic_batch(ctx, pairs)
    sft = prepare_sft_batch(ctx, [TrainPair(sample_index=p.sample_index, x0=p.x0, pos_cond=p.pos_cond) for p in pairs])
    assert torch.equal(critic.latents, sft.latents)
    assert torch.equal(critic.timestep, sft.timestep)
    assert torch.equal(critic.target, sft.target)
    assert critic.cond.keys() == sft.cond.keys()
    for key in sft.cond:
        assert torch.equal(critic.cond[key], sft.cond[key])
    for key in ("sigma", "noise", "x0", "grid_index"):
        assert torch.equal(critic.extras[key], sft.extras[key])
    # The target really is SFT's: ε − x̂0_i, where x̂0_i is the rollout's x0 (not the latent x_i).
    assert torch.equal(critic.target, critic.extras["noise"] - torch.stack([p.x0 for p in pairs]))


# ---------------------------------------------------------------------------------------------------------- scoring


def test_scoring_reproduces_sigma_and_x_sigma_from_the_seed():
    pairs = make_dmd2_pairs(5)  # micro-batches of 2, 2, 1
    ctx = make_ctx()
    out = predict_teacher_and_critic_x0(ctx, pairs)
    sigma, x_sigmas = expected_scoring_draws(ctx.args, 3, 0, pairs)

    assert out["sigma"].dtype == torch.float64
    assert torch.equal(out["sigma"], sigma)
    assert torch.equal(out["sample_index"], torch.tensor([p.sample_index for p in pairs]))
    assert out["x0_real"].shape == out["x0_fake"].shape == (5, C, H, W)
    assert out["x0_real"].dtype == out["x0_fake"].dtype == torch.float32
    timestep = out["sigma"] * 1000
    assert bool(((timestep >= 20) & (timestep <= 980)).all())

    critic = ctx.models["transformer"]
    assert [call["latents"].shape[0] for call in critic.calls] == [2, 2, 1]
    for call, x_sigma, start in zip(critic.calls, x_sigmas, (0, 2, 4)):
        torch.testing.assert_close(call["latents"], x_sigma, rtol=0, atol=0)
        torch.testing.assert_close(call["timestep"], (sigma[start : start + len(x_sigma)] * 1000).float())

    # x0 = x_σ − σ·v for the critic, with v recomputed by calling the critic directly.
    x_sigma = torch.cat(x_sigmas)
    s = sigma.float().view(-1, 1, 1, 1)
    cond = make_batched_cond(pairs, "pos_cond")
    with torch.no_grad():
        v_fake = critic(x_sigma, (sigma * 1000).float(), **cond)
        v_real = ctx.teacher_models["transformer"](x_sigma, (sigma * 1000).float(), **cond)
    torch.testing.assert_close(out["x0_fake"], x_sigma - s * v_fake)
    torch.testing.assert_close(out["x0_real"], x_sigma - s * v_real)


def test_scoring_sigma_stays_within_the_timestep_range():
    pairs = make_dmd2_pairs(64)
    out = predict_teacher_and_critic_x0(make_ctx(make_args(micro_batch_size=8)), pairs)
    timestep = out["sigma"] * 1000
    assert timestep.min() >= 20 and timestep.max() <= 980
    narrow = predict_teacher_and_critic_x0(
        make_ctx(make_args(micro_batch_size=8, dmd2_min_timestep_ratio=0.4, dmd2_max_timestep_ratio=0.5)), pairs
    )
    assert narrow["sigma"].min() >= 0.4 and narrow["sigma"].max() <= 0.5
    with pytest.raises(ValueError, match="dmd2-min-timestep-ratio"):
        predict_teacher_and_critic_x0(
            make_ctx(make_args(dmd2_min_timestep_ratio=0.5001, dmd2_max_timestep_ratio=0.5002)), pairs
        )
    # A continuous rule samples the same range, which holds no grid point, instead of failing on the grid.
    between = make_args(dmd2_min_timestep_ratio=0.5001, dmd2_max_timestep_ratio=0.5002, dmd2_scoring_sigma="shift")
    sigma = predict_teacher_and_critic_x0(make_ctx(between), pairs)["sigma"]
    assert sigma.min() >= 0.5001 and sigma.max() <= 0.5002


def test_scoring_seed_includes_dp_rank_and_rollout():
    pairs = make_dmd2_pairs(4)
    rank0 = predict_teacher_and_critic_x0(make_ctx(dp_rank=0), pairs)
    rank0_again = predict_teacher_and_critic_x0(make_ctx(dp_rank=0), pairs)
    rank1 = predict_teacher_and_critic_x0(make_ctx(dp_rank=1), pairs)
    next_rollout = predict_teacher_and_critic_x0(make_ctx(dp_rank=0, rollout_id=4), pairs)
    assert torch.equal(rank0["sigma"], rank0_again["sigma"])
    assert torch.equal(rank0["x0_fake"], rank0_again["x0_fake"])
    assert not torch.equal(rank0["sigma"], rank1["sigma"])
    assert not torch.equal(rank0["x0_fake"], rank1["x0_fake"])
    assert not torch.equal(rank0["sigma"], next_rollout["sigma"])
    assert torch.equal(rank1["sigma"], expected_scoring_draws(make_args(), 3, 1, pairs)[0])


def test_teacher_runs_cfg_over_negative_cond_and_critic_runs_unguided():
    w = 3.5
    pairs = make_dmd2_pairs(4)
    ctx = make_ctx(make_args(dmd2_teacher_guidance_scale=w))
    out = predict_teacher_and_critic_x0(ctx, pairs)
    sigma, x_sigmas = expected_scoring_draws(ctx.args, 3, 0, pairs)
    x_sigma = torch.cat(x_sigmas)
    t = (sigma * 1000).float()
    s = sigma.float().view(-1, 1, 1, 1)

    teacher, critic = ctx.teacher_models["transformer"], ctx.models["transformer"]
    with torch.no_grad():
        uncond = teacher(x_sigma, t, **make_batched_cond(pairs, "neg_cond"))
        cond = teacher(x_sigma, t, **make_batched_cond(pairs, "pos_cond"))
        critic_v = critic(x_sigma, t, **make_batched_cond(pairs, "pos_cond"))
    expected_real = x_sigma - s * (uncond + w * (cond - uncond))
    torch.testing.assert_close(out["x0_real"], expected_real, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["x0_fake"], x_sigma - s * critic_v, rtol=1e-5, atol=1e-5)
    # The guided prediction differs from the unguided one, so the comparison above did test the CFG.
    assert (out["x0_real"] - (x_sigma - s * cond)).abs().max() > 1e-2

    # The teacher saw the negative and the positive cond, the critic only the positive one.
    teacher_pooled = torch.cat([call["pooled"] for call in teacher.calls[:2]])
    neg = make_batched_cond(pairs, "neg_cond")["pooled_projections"]
    pos = make_batched_cond(pairs, "pos_cond")["pooled_projections"]
    assert torch.equal(teacher_pooled, torch.cat([neg[:2], pos[:2], neg[2:], pos[2:]]))
    assert torch.equal(torch.cat([call["pooled"] for call in critic.calls[:2]]), pos)


def test_unguided_teacher_runs_one_forward_per_micro_batch():
    pairs = make_dmd2_pairs(4, with_neg=False)
    ctx = make_ctx(make_args(dmd2_teacher_guidance_scale=1.0))
    predict_teacher_and_critic_x0(ctx, pairs)
    assert [call["latents"].shape[0] for call in ctx.teacher_models["transformer"].calls] == [2, 2]


def test_missing_negative_cond_with_teacher_cfg_raises():
    pairs = make_dmd2_pairs(3)
    pairs[1].neg_cond = {}
    ctx = make_ctx(make_args(dmd2_teacher_guidance_scale=2.0))
    with pytest.raises(ValueError, match=r"--dmd2-teacher-guidance-scale 2.*samples \[103\].*negative"):
        predict_teacher_and_critic_x0(ctx, pairs)
    assert ctx.teacher_models["transformer"].calls == []


def test_scoring_without_teacher_names_the_flag():
    with pytest.raises(ValueError, match="--teacher-load"):
        predict_teacher_and_critic_x0(make_ctx(teacher_models={}), make_dmd2_pairs(2))


@pytest.fixture
def gloo_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", world_size=1, rank=0, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_sd3_transformer(seed: int) -> nn.Module:
    from diffusers import SD3Transformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SD3Transformer2DModel(
            sample_size=H,
            patch_size=2,
            in_channels=C,
            out_channels=C,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            caption_projection_dim=16,
            joint_attention_dim=D,
            pooled_projection_dim=P,
            pos_embed_max_size=H // 2,
        ).eval()


def _sharded(model: nn.Module, family) -> nn.Module:
    """``fully_shard`` per block, then the root, over the process's 1-rank gloo group (the trainer's layout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for block in family.blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_models_are_resharded_after_a_failed_forward_at_the_next_scoring(gloo_group, tmp_path):
    """Real FSDP2 modules: a scoring forward that raises (cond of the wrong width) propagates its error; the next
    scoring leaves both models sharded again.

    The hook reshards in ``finally``, but FSDP2 keeps a root whose forward raised in its FORWARD state, where
    ``FSDPModule.reshard`` leaves it gathered (torch 2.13 ``FSDPParamGroup.reshard``); the next forward resets it.
    """
    from torch.distributed.tensor import DTensor

    from miles.models.digits import DigitsFamily

    family = DigitsFamily(tmp_path)
    teacher, critic = _sharded(tiny_sd3_transformer(2), family), _sharded(tiny_sd3_transformer(1), family)
    teacher.requires_grad_(False)
    ctx = make_ctx(models={"transformer": critic}, teacher_models={"transformer": teacher})
    ctx.family = family
    bad = make_dmd2_pairs(2)
    for pair in bad:
        pair.pos_cond["pooled_projections"] = torch.zeros(P + 1)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        predict_teacher_and_critic_x0(ctx, bad)
    predict_teacher_and_critic_x0(ctx, make_dmd2_pairs(3))
    for model in (teacher, critic):
        assert all(isinstance(param, DTensor) for param in model.parameters())


def test_fsdp2_sd3_teacher_and_critic_are_resharded_and_score_like_plain_models(gloo_group, tmp_path):
    """Real parts: FSDP2 over a 1-rank gloo group, diffusers SD3 transformers and the digits family's forward."""
    from torch.distributed.tensor import DTensor

    from miles.models.digits import DigitsFamily

    family = DigitsFamily(tmp_path)
    teacher, critic = _sharded(tiny_sd3_transformer(2), family), _sharded(tiny_sd3_transformer(1), family)
    plain_teacher, plain_critic = tiny_sd3_transformer(2), tiny_sd3_transformer(1)
    teacher.requires_grad_(False)

    # Without a reshard, an FSDP2 root keeps unsharded (plain) parameters after a no_grad forward.
    with torch.no_grad():
        family.predict_velocity(
            teacher,
            torch.zeros(1, C, H, W),
            torch.full((1,), 500.0),
            make_batched_cond(make_dmd2_pairs(1), "pos_cond"),
        )
    assert not all(isinstance(param, DTensor) for param in teacher.parameters())

    w = 2.0
    pairs = make_dmd2_pairs(3)
    args = make_args(dmd2_teacher_guidance_scale=w)
    ctx = make_ctx(args, models={"transformer": critic}, teacher_models={"transformer": teacher})
    ctx.family = family
    out = predict_teacher_and_critic_x0(ctx, pairs)
    for model in (teacher, critic):
        assert all(isinstance(param, DTensor) for param in model.parameters())

    sigma, x_sigmas = expected_scoring_draws(args, 3, 0, pairs)
    x_sigma, t = torch.cat(x_sigmas), (sigma * 1000).float()
    s = sigma.float().view(-1, 1, 1, 1)
    with torch.no_grad():
        uncond = family.predict_velocity(plain_teacher, x_sigma, t, make_batched_cond(pairs, "neg_cond"))
        cond = family.predict_velocity(plain_teacher, x_sigma, t, make_batched_cond(pairs, "pos_cond"))
        fake = family.predict_velocity(plain_critic, x_sigma, t, make_batched_cond(pairs, "pos_cond"))
    torch.testing.assert_close(out["x0_real"], x_sigma - s * (uncond + w * (cond - uncond)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["x0_fake"], x_sigma - s * fake, rtol=1e-5, atol=1e-5)
    assert (out["x0_real"] - (x_sigma - s * cond)).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------- generator step


def test_generator_batch_fields():
    pairs = make_dmd2_pairs(3)
    batch = prepare_generator_batch(make_ctx(), pairs)
    assert torch.equal(batch.latents, torch.stack([p.latent for p in pairs]))
    assert batch.timestep.dtype == torch.float32
    torch.testing.assert_close(batch.timestep, torch.tensor([p.timestep for p in pairs], dtype=torch.float32))
    torch.testing.assert_close(batch.extras["sigma"], torch.tensor([p.sigma for p in pairs], dtype=torch.float64))
    assert torch.equal(batch.extras["rollout_x0"], torch.stack([p.x0 for p in pairs]))
    assert batch.extras["sample_index"].tolist() == [100, 103, 106]
    assert torch.equal(
        batch.cond["pooled_projections"], torch.stack([p.pos_cond["pooled_projections"] for p in pairs])
    )
    assert batch.target is None and batch.component == "transformer"


def test_generator_batch_rejects_multiple_components_and_non_dmd2_pairs():
    ctx = make_ctx(models={"transformer": CondVelocity(1), "transformer_2": CondVelocity(3)})
    with pytest.raises(ValueError, match="single DiT component.*transformer_2"):
        prepare_generator_batch(ctx, make_dmd2_pairs(2))
    sft_pair = TrainPair(sample_index=9, x0=torch.zeros(C, H, W), pos_cond=make_cond(torch.Generator()))
    with pytest.raises(ValueError, match="sample 9"):
        prepare_generator_batch(make_ctx(), [sft_pair])


def reference_distribution_matching_loss(latents, pred_real_image, pred_fake_image):
    """Port of tianweiy/DMD2 ``compute_distribution_matching_loss`` after its real/fake score forwards.

    ``latents`` is the generator's x0 (with grad), ``pred_*_image`` the teacher's and critic's x0 predictions.
    """
    original_latents = latents
    with torch.no_grad():
        p_real = latents - pred_real_image
        p_fake = latents - pred_fake_image
        grad = (p_real - p_fake) / torch.abs(p_real).mean(dim=[1, 2, 3], keepdim=True)
        grad = torch.nan_to_num(grad)
    return 0.5 * F.mse_loss(original_latents.float(), (original_latents - grad).detach().float(), reduction="mean")


def random_scores(pairs, seed, perm=None):
    gen = torch.Generator().manual_seed(seed)
    n = len(pairs)
    order = perm if perm is not None else list(range(n))
    return {
        "sample_index": torch.tensor([pairs[k].sample_index for k in order]),
        "x0_real": torch.randn(n, C, H, W, generator=gen),
        "x0_fake": torch.randn(n, C, H, W, generator=gen),
        "sigma": torch.rand(n, generator=gen, dtype=torch.float64),
    }


def test_surrogate_gradient_matches_reference_implementation():
    pairs = make_dmd2_pairs(4)
    # The critic's shard order differs from the micro-batch's: scores are matched by sample index.
    scores = random_scores(pairs, seed=5, perm=[2, 0, 3, 1])
    ctx = make_ctx(external_data={"critic": scores})
    batch = prepare_generator_batch(ctx, pairs)
    v = torch.randn(4, C, H, W, generator=torch.Generator().manual_seed(6), requires_grad=True)
    metrics: dict[str, list[float]] = {}
    loss = dmd2_loss_formula(ctx, pairs, batch, new_pred=v, metrics=metrics)
    metrics = host_values(metrics)  # the trainer's one read of a window's figures
    (loss / len(pairs)).backward()  # the trainer divides by the window's pair count

    row = {int(s): k for k, s in enumerate(scores["sample_index"])}
    rows = [row[p.sample_index] for p in pairs]
    v_ref = v.detach().clone().requires_grad_(True)
    sigma = torch.tensor([p.sigma for p in pairs]).view(-1, 1, 1, 1)
    x0_ref = batch.latents - sigma * v_ref
    ref = reference_distribution_matching_loss(x0_ref, scores["x0_real"][rows], scores["x0_fake"][rows])
    ref.backward()

    torch.testing.assert_close(loss / len(pairs), ref)
    torch.testing.assert_close(v.grad, v_ref.grad)
    assert v.grad.abs().max() > 0
    assert len(metrics["dmd2_loss"]) == len(metrics["dmd2_grad_abs_mean"]) == 4
    assert sum(metrics["dmd2_loss"]) / 4 == pytest.approx(ref.item(), rel=1e-5)
    assert metrics["dmd2_nonfinite_frac"] == [0.0] * 4
    # The surrogate's value is 0.5·mean(g²), its gradient g / numel per pair.
    with torch.no_grad():
        x0 = batch.latents - sigma * v
        real, fake = scores["x0_real"][rows], scores["x0_fake"][rows]
        g = (fake - real) / (x0 - real).abs().mean(dim=(1, 2, 3), keepdim=True)
    assert metrics["dmd2_grad_abs_mean"] == pytest.approx(g.abs().mean(dim=(1, 2, 3)).tolist(), rel=1e-5)
    assert metrics["dmd2_loss"] == pytest.approx((0.5 * g.pow(2).mean(dim=(1, 2, 3))).tolist(), rel=1e-5)


def test_zero_loss_and_gradient_when_critic_equals_teacher():
    pairs = make_dmd2_pairs(3)
    scores = random_scores(pairs, seed=8)
    scores["x0_fake"] = scores["x0_real"].clone()
    ctx = make_ctx(external_data={"critic": scores})
    batch = prepare_generator_batch(ctx, pairs)
    v = torch.randn(3, C, H, W, generator=torch.Generator().manual_seed(9), requires_grad=True)
    metrics: dict[str, list[float]] = {}
    loss = dmd2_loss_formula(ctx, pairs, batch, new_pred=v, metrics=metrics)
    metrics = host_values(metrics)  # the trainer's one read of a window's figures
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(v.grad) == 0
    assert metrics["dmd2_grad_abs_mean"] == [0.0, 0.0, 0.0]


def test_nonfinite_ratio_is_zeroed_and_counted():
    pairs = make_dmd2_pairs(2)
    ctx = make_ctx()
    batch = prepare_generator_batch(ctx, pairs)
    v = torch.randn(2, C, H, W, generator=torch.Generator().manual_seed(3))
    x0 = batch.latents - batch.extras["sigma"].float().view(-1, 1, 1, 1) * v
    scores = random_scores(pairs, seed=4)
    # A zero normalizer for pair 0 (the student equals the teacher's x0) is floored at NORMALIZER_FLOOR, so its
    # ratio stays finite (it used to be ±inf / nan everywhere), and 0 on channel 0 where fake = real.
    scores["x0_real"][0] = x0[0]
    scores["x0_fake"][0, 0] = x0[0, 0]
    # A non-finite critic score (pair 1, channel 0) makes those ratio entries non-finite: zeroed, and counted.
    scores["x0_fake"][1, 0] = float("nan")
    ctx.external_data["critic"] = scores
    metrics: dict[str, list[float]] = {}
    loss = dmd2_loss_formula(ctx, pairs, batch, new_pred=v, metrics=metrics)
    metrics = host_values(metrics)  # the trainer's one read of a window's figures
    assert metrics["dmd2_nonfinite_frac"] == [0.0, 0.5]  # channel 0 of C = 2
    assert all(math.isfinite(value) for value in metrics["dmd2_loss"]) and math.isfinite(loss.item())
    assert loss.dtype == torch.float32
    # Pair 0's gradient is the ratio over the floor: (fake − real) / 1e-6, 0 on channel 0.
    ratio = (scores["x0_fake"][0] - x0[0]) / NORMALIZER_FLOOR
    assert metrics["dmd2_grad_abs_mean"][0] == pytest.approx(ratio.abs().mean().item(), rel=1e-5)
    assert float(ratio[0].abs().max()) == 0.0


def test_x0_rollout_train_gap_metrics():
    pairs = make_dmd2_pairs(2)
    ctx = make_ctx(external_data={"critic": random_scores(pairs, seed=1)})
    batch = prepare_generator_batch(ctx, pairs)
    sigma = batch.extras["sigma"].float().view(-1, 1, 1, 1)
    rollout_x0 = batch.extras["rollout_x0"]
    # Choose v so the trainer's x0 is the rollout's x0 plus a known gap of 0.01 on one element of pair 1.
    gap = torch.zeros_like(rollout_x0)
    gap[1, 0, 0, 0] = 0.01
    v = (batch.latents - (rollout_x0 + gap)) / sigma
    metrics: dict[str, list[float]] = {}
    dmd2_loss_formula(ctx, pairs, batch, new_pred=v, metrics=metrics)
    metrics = host_values(metrics)
    assert metrics["x0_max_abs_diff"][0] < 1e-5
    assert metrics["x0_max_abs_diff"][1] == pytest.approx(0.01, abs=1e-5)
    assert metrics["x0_mean_abs_diff"][1] == pytest.approx(0.01 / (C * H * W), abs=1e-6)
    assert metrics["x0_rel_max"][1] == pytest.approx(0.01 / rollout_x0[1].abs().max().item(), rel=1e-3)


def test_record_rollout_train_abs_diff_values():
    metrics: dict[str, list[float]] = {"x0_max_abs_diff": [9.0]}
    train = torch.tensor([[1.0, -2.0, 4.0], [0.0, 0.0, 0.0]])
    rollout = torch.tensor([[1.5, -2.0, 2.0], [0.0, 0.0, 0.0]])
    record_rollout_train_abs_diff(metrics, "x0", train, rollout)
    metrics = host_values(metrics)  # numbers already there stay first
    assert metrics["x0_mean_abs_diff"] == pytest.approx([2.5 / 3, 0.0])
    assert metrics["x0_max_abs_diff"] == pytest.approx([9.0, 2.0, 0.0])
    assert metrics["x0_rel_max"] == pytest.approx([2.0 / 2.0, 0.0])


def test_missing_critic_output_or_sample_is_a_clear_error():
    pairs = make_dmd2_pairs(2)
    batch = prepare_generator_batch(make_ctx(), pairs)
    v = torch.zeros(2, C, H, W)
    with pytest.raises(RuntimeError, match="no 'critic' output"):
        dmd2_loss_formula(make_ctx(), pairs, batch, new_pred=v, metrics={})
    scores = random_scores(pairs[:1], seed=2)
    with pytest.raises(RuntimeError, match="no sample 103"):
        dmd2_loss_formula(make_ctx(external_data={"critic": scores}), pairs, batch, new_pred=v, metrics={})


# --------------------------------------------------------------------------------------- 1-D Gaussian toy problem


class GaussianPosteriorVelocity(nn.Module):
    """Exact flow-matching velocity of data N(mu, s²): v = (x_σ − E[x0 | x_σ]) / σ.

    With x_σ = (1 − σ)·x0 + σ·ε, x_σ ~ N((1 − σ)·mu, (1 − σ)²s² + σ²) and
    E[x0 | x_σ] = mu + (1 − σ)s² / ((1 − σ)²s² + σ²) · (x_σ − (1 − σ)·mu).
    """

    def __init__(self, mu: float, std: float):
        super().__init__()
        self.mu, self.std = mu, std

    def forward(self, latents, timestep, **cond):
        sigma = timestep.double().view(-1, 1, 1, 1) / 1000
        x = latents.double()
        var = (1 - sigma) ** 2 * self.std**2 + sigma**2
        posterior_mean = self.mu + (1 - sigma) * self.std**2 / var * (x - (1 - sigma) * self.mu)
        return ((x - posterior_mean) / sigma).float()


def test_gaussian_toy_moves_student_mean_to_teacher_mean():
    mu_teacher, std, lr, steps, batch_size = 1.5, 0.5, 0.3, 20, 8
    mu_student = torch.tensor(-1.0, requires_grad=True)
    teacher = GaussianPosteriorVelocity(mu_teacher, std)
    critic = GaussianPosteriorVelocity(mu_student.item(), std)
    args = make_args(micro_batch_size=4)
    history = [mu_student.item()]
    for step in range(steps):
        critic.mu = mu_student.item()  # a perfect critic: the exact score of the current student
        gen = torch.Generator().manual_seed(1000 + step)
        z = torch.randn(batch_size, 1, 4, 4, generator=gen)
        x_i = torch.randn(batch_size, 1, 4, 4, generator=gen)
        x0_student = mu_student + std * z
        pairs = [
            DMD2Pair(
                sample_index=j,
                x0=x0_student[j].detach(),
                pos_cond={"pooled_projections": torch.zeros(P)},
                latent=x_i[j],
                sigma=0.6,
                timestep=600.0,
                step_index=1,
            )
            for j in range(batch_size)
        ]
        ctx = make_ctx(args, models={"transformer": critic}, teacher_models={"transformer": teacher}, rollout_id=step)
        scores = predict_teacher_and_critic_x0(ctx, pairs)
        actor_ctx = make_ctx(args, models={"transformer": nn.Identity()}, external_data={"critic": scores})
        batch = prepare_generator_batch(actor_ctx, pairs)
        v = (batch.latents - x0_student) / 0.6  # the student's velocity whose x0 is mu_student + std·z
        loss = dmd2_loss_formula(actor_ctx, pairs, batch, new_pred=v, metrics={}) / batch_size
        mu_student.grad = None
        loss.backward()
        with torch.no_grad():
            mu_student -= lr * mu_student.grad
        history.append(mu_student.item())

    # Far from the teacher the per-pair normalizer makes the step size about constant (lr·sign); close to it the
    # gap shrinks geometrically. A flipped sign or a missing normalizer would diverge or stall.
    gaps = [abs(mu - mu_teacher) for mu in history]
    assert all(later < earlier or later < 1e-4 for earlier, later in zip(gaps, gaps[1:])), history
    assert gaps[-1] < 1e-3 * gaps[0], history


@pytest.mark.parametrize(
    "name",
    [
        "prepare_critic_batch",
        "predict_teacher_and_critic_x0",
        "prepare_generator_batch",
        "dmd2_loss_formula",
    ],
)
def test_hooks_load_by_their_dotted_paths(name):
    import miles.backends.fsdp_utils.loss_hub.dmd2 as dmd2_hooks
    from miles.utils.misc import load_function

    assert load_function(f"miles.backends.fsdp_utils.loss_hub.dmd2.{name}") is getattr(dmd2_hooks, name)
