"""What the trainer accepts from its hooks, checked on the values real hooks return: the SFT prepare and loss hooks
on real digits pairs through the digits denoiser, and each way of getting their result wrong. The run-time table of
``tests/fast/driver/test_bad_inputs.py`` drives the same checks through ``train_diffusion.main``."""

import dataclasses

import pytest
import torch

from miles.backends.fsdp_utils.hooks import check_loss, check_prepared, check_train_input
from miles.backends.fsdp_utils.loss_hub.sft import prepare_sft_batch, sft_loss_formula
from miles.backends.fsdp_utils.loss_hub.types import TrainContext
from miles.models import get_model_family
from miles.utils.validation import HookResultError, RunError
from tests.support.trainer import digits_pairs, make_args, make_pipeline

LOSS, PREPARE, INPUT = "my.loss", "my.prepare", "my.train_input"


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A real micro-batch: digits pairs, the SFT prepare hook's batch, the denoiser's velocity and the SFT loss."""
    root = tmp_path_factory.mktemp("hook_results")
    pipeline = make_pipeline(root / "digits")
    (root / "data.jsonl").write_text('{"prompt": "a", "image": [[0]]}\n')
    args = make_args(pipeline, root)
    family = get_model_family(pipeline)
    model = family.load_denoiser(pipeline).train()
    ctx = TrainContext(args, {"transformer": model}, {}, {}, family, torch.device("cpu"), torch.float32, rollout_id=0)
    pairs = digits_pairs(family, 0, 4)
    prepared = prepare_sft_batch(ctx, pairs)
    new_pred = ctx.predict_velocity(model, prepared.latents, prepared.timestep, prepared.cond)
    loss = sft_loss_formula(ctx, pairs, prepared, new_pred=new_pred, metrics={})
    return {"pairs": pairs, "prepared": prepared, "new_pred": new_pred, "loss": loss}


def test_what_the_real_hooks_return_is_accepted(real):
    assert check_prepared(real["prepared"], PREPARE) is real["prepared"]
    assert check_loss(real["loss"], LOSS) is real["loss"]
    assert check_train_input(real["pairs"], INPUT, 4) is real["pairs"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda r: float(r["loss"]), "loss hook my.loss returned float; expected a scalar tensor with grad"),
        (lambda r: None, "loss hook my.loss returned None; expected a scalar tensor with grad"),
        (lambda r: (r["new_pred"] ** 2).flatten(1).mean(1), "returned a tensor of shape (4,); expected a scalar"),
        (lambda r: r["loss"].detach(), "returned a tensor without grad (computed under no_grad, detached"),
        (lambda r: (r["loss"] * 0).long(), "returned a torch.int64 tensor; expected a scalar tensor with grad"),
        (lambda r: {"loss": r["loss"]}, "loss hook my.loss returned dict; expected"),
    ],
    ids=["float", "none", "vector", "no-grad", "integer", "dict"],
)
def test_a_loss_that_is_not_a_scalar_with_grad_is_named(real, make, message):
    with pytest.raises(HookResultError) as exc:
        check_loss(make(real), LOSS)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    # A complete message: the driver prints it without a traceback, as a ValueError.
    assert isinstance(exc.value, RunError) and isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda r: dataclasses.asdict(r["prepared"]), "prepare hook my.prepare returned dict; expected a miles."),
        (lambda r: None, "prepare hook my.prepare returned None"),
        (lambda r: (r["prepared"].latents, r["prepared"].timestep), "returned tuple"),
        (
            lambda r: dataclasses.replace(r["prepared"], timestep=r["prepared"].timestep.tolist()),
            "returned a PreparedBatch whose timestep is list; expected a tensor",
        ),
        (
            lambda r: dataclasses.replace(r["prepared"], cond=list(r["prepared"].cond.values())),
            "returned a PreparedBatch whose cond is list; expected a dict of tensors",
        ),
    ],
    ids=["dict", "none", "tuple", "timestep-list", "cond-list"],
)
def test_a_prepared_batch_of_the_wrong_kind_is_named(real, make, message):
    with pytest.raises(HookResultError) as exc:
        check_prepared(make(real), PREPARE)
    assert message in str(exc.value)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p[:-1], "train-input hook my.train_input returned 3 train pairs for the 4 it was given"),
        (lambda p: p + p[:1], "returned 5 train pairs for the 4 it was given"),
        (lambda p: tuple(p), "returned tuple; expected a list of miles.utils.types.TrainPair"),
        (lambda p: [pair.x0 for pair in p], "returned a list holding Tensor; expected a list of"),
        (lambda p: None, "returned None"),
    ],
    ids=["drops", "adds", "tuple", "tensors", "none"],
)
def test_a_train_input_hook_may_not_change_the_pair_count_or_type(real, make, message):
    with pytest.raises(HookResultError) as exc:
        check_train_input(make(list(real["pairs"])), INPUT, 4)
    assert message in str(exc.value)
