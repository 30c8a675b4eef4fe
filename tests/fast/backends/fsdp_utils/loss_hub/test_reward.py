"""DMD2 + reward (DMDR) without Ray: the reward group's shipped gradient against autograd and the logistic
regression's closed form, the actor's x0 gradient with the reward term, and weight 0 changing nothing.

The reward is the real digits one (:mod:`miles.eval.digits.reward`, a logistic regression fitted on the train split,
cached like the evaluator's classifier) on the real digits family's decoder; the actor side uses the toy models of
``test_dmd2``.
"""

import numpy as np
import pytest
import torch

from miles.backends.fsdp_utils.loss_hub.dmd2 import dmd2_loss_formula, prepare_generator_batch
from miles.backends.fsdp_utils.loss_hub.reward import reward_gradient
from miles.backends.fsdp_utils.loss_hub.types import TrainContext
from miles.backends.fsdp_utils.trainer import host_values
from miles.eval.digits.data import load_split, prompt_for_label
from miles.eval.digits.reward import digit_log_prob, label_of_prompt, load_reward_classifier
from miles.models.digits import DigitsFamily
from miles.utils.types import TrainPair
from tests.fast.backends.fsdp_utils.loss_hub.test_dmd2 import (
    C,
    H,
    W,
    make_args,
    make_ctx,
    make_dmd2_pairs,
    random_scores,
)

REWARD = "miles.eval.digits.reward.digit_log_prob"


def _digit_pairs(count: int) -> list[TrainPair]:
    images, labels = load_split("heldout")
    gen = torch.Generator().manual_seed(0)
    pairs = []
    for j in range(count):
        # Off the data manifold (a student's x̂0 is): the image plus noise, partly outside [-1, 1].
        x0 = torch.from_numpy(images[j]).float().div(255).mul(2).sub(1)[None] + 0.3 * torch.randn(
            1, 8, 8, generator=gen
        )
        pairs.append(TrainPair(sample_index=50 - j, x0=x0, pos_cond={}, prompt=prompt_for_label(int(labels[j]))))
    return pairs


def _reward_ctx(tmp_path, **values) -> TrainContext:
    args = make_args(dmd2_reward_weight=0.5, dmd2_reward_function_path=REWARD, **values)
    return TrainContext(
        args=args, models={}, teacher_models={}, external_data={}, family=DigitsFamily(tmp_path),
        device=torch.device("cpu"), dtype=torch.float32, rollout_id=0,
    )  # fmt: skip


def test_the_shipped_gradient_is_autograd_of_each_pairs_reward_and_the_closed_form(tmp_path):
    pairs = _digit_pairs(5)
    with torch.no_grad():  # as the trainer runs a train-output hook
        out = reward_gradient(_reward_ctx(tmp_path, micro_batch_size=2), pairs, reward=digit_log_prob)
    assert out["sample_index"].tolist() == [p.sample_index for p in pairs]
    classifier = load_reward_classifier()
    weight, bias = classifier.weight.double(), classifier.bias.double()
    for j, pair in enumerate(pairs):
        x0 = pair.x0[None].clone().requires_grad_(True)
        reward = digit_log_prob((x0 + 1) / 2, [pair.prompt])
        (grad,) = torch.autograd.grad(reward.sum(), x0)
        torch.testing.assert_close(out["reward"][j], reward.detach()[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(out["g_reward"][j], grad[0], atol=1e-6, rtol=0)
        # ∂ log p_y / ∂x0 = ½·(W_y − Σ_k p_k W_k) for x = (x0 + 1)/2 and p = softmax(W·x + b)
        p = torch.softmax(weight @ ((pair.x0.double().flatten() + 1) / 2) + bias, dim=0)
        y = label_of_prompt(pair.prompt)
        closed = 0.5 * (weight[y] - p @ weight)
        np.testing.assert_allclose(out["g_reward"][j].flatten().numpy(), closed.numpy(), atol=1e-6)
    assert classifier.heldout_accuracy >= 0.95


def test_the_reward_hook_names_a_prompt_without_a_digit(tmp_path):
    pairs = _digit_pairs(1)
    pairs[0].prompt = "a cat"
    with pytest.raises(ValueError, match="'a cat'"):
        reward_gradient(_reward_ctx(tmp_path, micro_batch_size=2), pairs, reward=digit_log_prob)


def _actor_step(weight: float, reward_scores=None):
    pairs = make_dmd2_pairs(3)
    external = {"critic": random_scores(pairs, seed=5)}
    if reward_scores is not None:
        external["reward"] = reward_scores
    args = make_args(dmd2_reward_weight=weight, dmd2_reward_function_path=REWARD if weight else None)
    ctx = make_ctx(args=args, external_data=external)
    batch = prepare_generator_batch(ctx, pairs)
    v = torch.randn(3, C, H, W, generator=torch.Generator().manual_seed(6), requires_grad=True)
    metrics: dict[str, list[float]] = {}
    loss = dmd2_loss_formula(ctx, pairs, batch, new_pred=v, metrics=metrics)
    loss.backward()
    return loss.detach(), v.grad, host_values(metrics), batch


def test_the_actors_x0_gradient_is_the_dm_gradient_minus_w_times_the_reward_gradient():
    pairs = make_dmd2_pairs(3)
    gen = torch.Generator().manual_seed(11)
    order = [1, 2, 0]  # the reward group's shard order differs from the micro-batch's: matched by sample index
    scores = {
        "sample_index": torch.tensor([pairs[k].sample_index for k in order]),
        "reward": torch.randn(3, generator=gen),
        "g_reward": torch.randn(3, C, H, W, generator=gen),
    }
    w = 0.25
    _, dm_grad_v, dm_metrics, batch = _actor_step(0.0)
    _, grad_v, metrics, _ = _actor_step(w, scores)
    # x0 = x_i − σ_i·v, so ∂/∂v = −σ_i·∂/∂x0; the reward term adds −w·∂r/∂x0 to ∂loss/∂x0.
    sigma = batch.extras["sigma"].float().view(-1, 1, 1, 1)
    g_reward = scores["g_reward"][[order.index(k) for k in range(3)]]
    torch.testing.assert_close(grad_v, dm_grad_v - sigma * (-w * g_reward), atol=1e-6, rtol=1e-5)
    assert metrics["dmd2_reward"] == pytest.approx(scores["reward"][[order.index(k) for k in range(3)]].tolist())
    # the ratio ‖w·numel·∂r/∂x0‖ / ‖g_DM‖ per pair, g_DM = numel·∂loss_DM/∂x0 = −numel·(∂loss_DM/∂v)/σ
    numel = C * H * W
    g_dm = -numel * dm_grad_v / sigma
    expected = (w * numel * g_reward).flatten(1).norm(dim=1) / g_dm.flatten(1).norm(dim=1)
    assert metrics["dmd2_reward_dm_grad_ratio"] == pytest.approx(expected.tolist(), rel=1e-4)
    assert metrics["dmd2_loss"] != dm_metrics["dmd2_loss"]


def test_weight_0_leaves_the_step_bit_identical_and_ignores_a_reward_output():
    loss, grad_v, metrics, _ = _actor_step(0.0)
    junk = {"sample_index": torch.tensor([-1]), "reward": torch.ones(1), "g_reward": torch.ones(1, C, H, W)}
    loss_with, grad_with, metrics_with, _ = _actor_step(0.0, junk)
    assert torch.equal(loss, loss_with) and torch.equal(grad_v, grad_with)
    assert metrics == metrics_with and "dmd2_reward" not in metrics


def test_a_missing_reward_output_names_the_group():
    with pytest.raises(RuntimeError, match="reward group"):
        _actor_step(0.5)
