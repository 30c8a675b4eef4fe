"""``GroupTrainer`` at world size 1 on the CPU, without Ray and without a process group: its window loop against a
plain PyTorch loop on identical work (bit for bit), the EMA post-step hook, the non-finite skip, the checkpoint of its
``Stateful`` s, a converter that freezes a base, and a method's own ``step``.

The model is the 2-layer digits denoiser; the pairs are real sklearn digits (``tests.support.trainer``).
"""

import math

import pytest
import torch
from torch import nn

from miles.backends.fsdp_utils.loss_hub.sft import prepare_sft_batch, sft_loss_formula
from miles.backends.fsdp_utils.loss_hub.types import PreparedBatch, TrainContext
from miles.backends.fsdp_utils.optimizer import lr_factor
from miles.backends.fsdp_utils.trainer import GroupTrainer
from miles.models import get_model_family
from miles.utils.collectives import LocalCollectives
from miles.utils.types import collate_cond
from miles.utils.validation import NonFiniteError
from tests.support.trainer import digits_pairs, make_args, make_pipeline, make_trainer

PAIRS = 8  # per rollout: 2 optimizer windows of 4 pairs, micro-batches of 2
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def family(pipeline):
    return get_model_family(pipeline)


def _args(pipeline, tmp_path, **overrides):
    values = dict(
        num_steps_per_rollout=2, lr_warmup_steps=3, lr_decay_style="cosine", min_lr=1e-5, ema_decay=0.9, clip_grad=0.5
    )
    return make_args(pipeline, tmp_path, **{**values, **overrides})


def _trainer(args, family, cls=None, **kwargs) -> GroupTrainer:
    torch.manual_seed(args.seed)
    return make_trainer(args, family=family, device=CPU, collectives=LocalCollectives(), trainer_class=cls, **kwargs)


def _reference(args, family, pipeline, rollouts: int):
    """The same work as a plain PyTorch loop: per window, the SFT hooks on each micro-batch, the summed loss over the
    window's pair count backward, clip, AdamW, the LR lambda, and the EMA update of diffusers' warm-up."""
    model = family.load_denoiser(pipeline).train()
    params = list(model.parameters())
    # Spelled out rather than miles' build_optimizer / build_lr_scheduler: the reference is plain PyTorch.
    optimizer = torch.optim.AdamW(
        params,
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
        foreach=True,
    )
    total = args.num_rollout * args.num_steps_per_rollout
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            lr=args.lr,
            min_lr=args.min_lr,
            warmup_steps=args.lr_warmup_steps,
            decay_style=args.lr_decay_style,
            total_steps=total,
        ),
    )
    shadow = [p.detach().clone() for p in params]
    losses, updates = [], 0
    for rollout_id in range(rollouts):
        pairs = digits_pairs(family, rollout_id, PAIRS)
        size = PAIRS // args.num_steps_per_rollout
        for window in range(args.num_steps_per_rollout):
            chunk = pairs[window * size : (window + 1) * size]
            micro_batches = [chunk[j : j + args.micro_batch_size] for j in range(0, size, args.micro_batch_size)]
            loss_sum = 0.0
            for j, micro_batch in enumerate(micro_batches):
                ctx = TrainContext(
                    args=args, models={"transformer": model}, teacher_models={}, external_data={}, family=family,
                    device=CPU, dtype=torch.float32, rollout_id=rollout_id,
                    microbatch_id=window * len(micro_batches) + j,
                )  # fmt: skip
                prepared = prepare_sft_batch(ctx, micro_batch)
                pred = family.predict_velocity(model, prepared.latents, prepared.timestep, prepared.cond)
                loss = sft_loss_formula(ctx, micro_batch, prepared, new_pred=pred, metrics={})
                (loss / size).backward()
                loss_sum += loss.item()
            torch.nn.utils.clip_grad_norm_(params, args.clip_grad, foreach=True)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1
            decay = 0.0 if updates == 1 else min(args.ema_decay, updates / (9 + updates))
            with torch.no_grad():
                for s, p in zip(shadow, params):
                    s.sub_(s - p, alpha=1 - decay)
            losses.append(loss_sum / size)
    names = [name for name, _ in model.named_parameters()]
    return model, dict(zip(names, shadow)), losses


def _train(trainer, family, rollouts: range) -> list[float]:
    losses = []
    for rollout_id in rollouts:
        output, metrics, timers = trainer.train(rollout_id, digits_pairs(family, rollout_id, PAIRS), {})
        assert output is None and set(timers) == {"train_steps_time", "train_output_time"}
        losses += [record["train/loss"] for record in metrics]
    return losses


def test_the_window_loop_and_the_ema_equal_a_plain_pytorch_loop(pipeline, family, tmp_path):
    args = _args(pipeline, tmp_path)
    trainer = _trainer(args, family)
    taken = []
    trainer.post_step_hooks.append(lambda: taken.append(trainer.models.scheduler.last_epoch))
    losses = _train(trainer, family, range(3))
    model, shadow, ref_losses = _reference(args, family, pipeline, rollouts=3)

    assert losses == ref_losses  # exact: the same draws, micro-batches, reductions and optimizer
    for name, value in model.state_dict().items():
        assert torch.equal(trainer.models.denoiser.state_dict()[name], value), name
    # The EMA is the first post-step hook; hooks run after the optimizer and LR steps, once per step taken.
    assert trainer.post_step_hooks[0] == trainer.models.ema.update
    assert taken == [1, 2, 3, 4, 5, 6] and trainer.models.ema.num_updates == 6
    ema = trainer.models.ema.state_dict()["shadow"]
    assert ema.keys() == {f"transformer.{name}" for name in shadow}
    for name, value in shadow.items():
        assert torch.equal(ema[f"transformer.{name}"], value), name
    assert max((value - model.state_dict()[name]).abs().max() for name, value in shadow.items()) > 0


def test_a_non_finite_step_is_skipped_and_enough_of_them_stop_the_run(pipeline, family, tmp_path):
    def nan_loss(ctx, pairs, prepared, *, new_pred, metrics):
        return sft_loss_formula(ctx, pairs, prepared, new_pred=new_pred, metrics=metrics) * math.nan

    args = _args(pipeline, tmp_path, max_skipped_steps=3)
    trainer = _trainer(args, family, prepare=prepare_sft_batch, loss=nan_loss)
    before = {name: value.clone() for name, value in trainer.models.denoiser.state_dict().items()}
    _, metrics, _ = trainer.train(0, digits_pairs(family, 0, PAIRS), {})
    assert [record["train/skipped_steps"] for record in metrics] == [1, 2]
    assert [record["train/step"] for record in metrics] == [0, 0]  # no LR step either
    assert trainer.models.ema.num_updates == 0
    assert all(torch.equal(value, before[name]) for name, value in trainer.models.denoiser.state_dict().items())
    with pytest.raises(
        NonFiniteError, match=r"3 optimizer steps in a row .*\(first non-finite figure train/loss=nan\)"
    ):
        trainer.train(1, digits_pairs(family, 1, PAIRS), {})


def test_a_checkpoint_of_every_stateful_resumes_exactly_without_a_process_group(pipeline, family, tmp_path):
    args = _args(pipeline, tmp_path)
    trainer = _trainer(args, family)
    _train(trainer, family, range(2))
    trainer.save(str(tmp_path / "ckpt"), 1)
    expected = _train(trainer, family, range(2, 4))

    resumed = _trainer(args, family)
    resumed.load(str(tmp_path / "ckpt"), 1)
    assert resumed.models.scheduler.last_epoch == 4 and resumed.models.ema.num_updates == 4
    assert _train(resumed, family, range(2, 4)) == expected
    for name, value in trainer.models.denoiser.state_dict().items():
        assert torch.equal(resumed.models.denoiser.state_dict()[name], value), name


def test_an_asleep_group_refuses_to_save_or_train_instead_of_waking_itself(pipeline, family, tmp_path):
    """Only the driver wakes a group (train_diffusion.DeviceTurns, after the group on the shared GPU went to sleep): a
    save that woke its own group would put two groups' state on one GPU (it did, before issue 30)."""
    trainer = _trainer(_args(pipeline, tmp_path), family)
    trainer.sleeper.sleep()
    with pytest.raises(RuntimeError, match=r"^actor group is asleep; call wake_up\(\) before save \(rollout 3\)$"):
        trainer.save(str(tmp_path / "ckpt"), 3)
    with pytest.raises(RuntimeError, match=r"before train \(rollout 4\)$"):
        trainer.train(4, digits_pairs(family, 4, PAIRS), {})
    assert trainer.sleeper.asleep and not (tmp_path / "ckpt").exists()
    trainer.sleeper.wake_up()
    trainer.save(str(tmp_path / "ckpt"), 3)
    assert (tmp_path / "ckpt" / "rollout_3").is_dir()


class FreezeAllButOutput:
    """A converter as LoRA will be one: it freezes the base and leaves the checkpoint only what it trains."""

    def convert(self, name: str, module: nn.Module) -> None:
        for param_name, param in module.named_parameters():
            param.requires_grad_(param_name.startswith("proj_out."))

    def keeps_in_checkpoint(self, key: str) -> bool:
        return key.startswith("transformer.proj_out.")


def test_a_converter_freezes_the_base_for_the_optimizer_ema_clip_and_checkpoint(pipeline, family, tmp_path):
    args = _args(pipeline, tmp_path)
    trainer = _trainer(args, family, converters=[FreezeAllButOutput()])
    trainable = trainer.models.trainable_parameters()
    assert 0 < len(trainable) < len(list(trainer.models.denoiser.parameters()))
    assert sum(len(group["params"]) for group in trainer.models.optimizer.param_groups) == len(trainable)
    assert all(name.startswith("transformer.proj_out.") for name in trainer.models.ema.names)
    before = {name: value.clone() for name, value in trainer.models.denoiser.state_dict().items()}
    _train(trainer, family, range(1))
    after = trainer.models.denoiser.state_dict()
    changed = {name for name, value in after.items() if not torch.equal(value, before[name])}
    assert changed and all(name.startswith("proj_out.") for name in changed)

    trainer.save(str(tmp_path / "ckpt"), 0)
    model_state = trainer.models.states()["train"].state_dict()["model"]
    assert model_state and all(key.startswith("transformer.proj_out.") for key in model_state)
    resumed = _trainer(args, family, converters=[FreezeAllButOutput()])
    resumed.load(str(tmp_path / "ckpt"), 0)
    for name, value in resumed.models.denoiser.state_dict().items():
        assert torch.equal(value, after[name]), name  # trained head from the checkpoint, base from the pipeline


class WholeWindowTrainer(GroupTrainer):
    """A method's own step: the window's loss in one forward (no micro-batches), then the trainer's clip, skip and
    post-step hooks through ``apply_gradients``."""

    def step(self, rollout_id, external, micro_batches, first_microbatch_id):
        pairs = [pair for micro_batch in micro_batches for pair in micro_batch]
        ctx = self.context(rollout_id, external, first_microbatch_id)
        prepared = self.hooks.prepare(ctx, pairs)
        pred = ctx.predict_velocity(self.models.denoiser, prepared.latents, prepared.timestep, prepared.cond)
        loss = self.hooks.loss(ctx, pairs, prepared, new_pred=pred, metrics={})
        (loss / len(pairs)).backward()
        return self.apply_gradients(rollout_id, {"loss": loss.item() / len(pairs)})


def test_a_method_may_override_the_step(pipeline, family, tmp_path):
    from miles.driver.specs import build_run_spec
    from miles.utils.validation import ArgumentValidationError

    args = _args(pipeline, tmp_path, custom_trainer_path=f"{__name__}.WholeWindowTrainer")
    trainer = _trainer(args, family)
    assert type(trainer).__qualname__ == "WholeWindowTrainer"  # the spec's class, imported once by the driver
    _, metrics, _ = trainer.train(0, digits_pairs(family, 0, PAIRS), {})
    assert [record["train/step"] for record in metrics] == [1, 2] and trainer.models.ema.num_updates == 2
    assert all(math.isfinite(record["train/grad_norm"]) for record in metrics)
    with pytest.raises(ArgumentValidationError, match="^--custom-trainer-path miles.utils.misc.make_generator is "):
        build_run_spec(_args(pipeline, tmp_path, custom_trainer_path="miles.utils.misc.make_generator"))


class _NoFlags:
    """Stands for the command's flags where nothing may read them: any attribute read fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"read the flags' {name!r}; the trainer reads its spec")


def _plain_prepare(ctx, pairs):
    x0 = torch.stack([pair.x0 for pair in pairs]).float()
    return PreparedBatch(
        latents=x0, timestep=torch.full((len(pairs),), 500.0), cond=collate_cond([p.pos_cond for p in pairs]),
        target=torch.zeros_like(x0),
    )  # fmt: skip


def _plain_loss(ctx, pairs, prepared, *, new_pred, metrics):
    return (new_pred - prepared.target).pow(2).flatten(1).mean(dim=1).sum()


def test_the_trainer_its_model_set_optimizer_ema_and_checkpoint_read_the_spec_and_never_the_flags(
    pipeline, family, tmp_path
):
    """``GroupTrainer(spec, family, ...)`` reads no args: with hooks that read none, a trainer whose ``args`` fail on
    any read trains, keeps its EMA, saves and loads (``ctx.args`` stays the hooks' own)."""
    from miles.methods.base import replace_hooks
    from tests.support.trainer import run_spec

    spec = replace_hooks(run_spec(_args(pipeline, tmp_path)).group("actor"), prepare=_plain_prepare, loss=_plain_loss)
    torch.manual_seed(spec.seed)
    trainer = GroupTrainer(spec, family, device=CPU, collectives=LocalCollectives(), args=_NoFlags())
    _, metrics, _ = trainer.train(0, digits_pairs(family, 0, PAIRS), {})
    assert [record["train/step"] for record in metrics] == [1, 2] and trainer.models.ema.num_updates == 2
    assert all(math.isfinite(record["train/loss"]) for record in metrics)
    trainer.save(str(tmp_path / "ckpt"), 0)
    trainer.load(str(tmp_path / "ckpt"), 0)
