"""LoRA per role (issue 19) without Ray: the adapter's gradient against a hand-built low-rank update under FSDP2, the
teacher as the base with adapters disabled, one base in a LoRA critic's model set, a step that moves only the
adapter, an exact resume from a checkpoint of the adapter alone, and the merged and adapter-only exports.

Real peft (through diffusers' adapter API), real FSDP2 on a 1-rank gloo group, the 2-layer digits denoiser.
"""

import pytest
import torch
from torch.func import functional_call

from miles.backends.fsdp_utils import checkpoint
from miles.backends.fsdp_utils.converters import LoraAdapter, build_converters
from miles.backends.fsdp_utils.export import LORA_DIR, write_pipeline
from miles.backends.fsdp_utils.model import load_frozen_denoiser, load_trainable_denoiser, reshard, shard_model
from miles.backends.fsdp_utils.model_set import build_model_set, local_bytes
from miles.backends.fsdp_utils.trainer import GroupTrainer
from miles.models import get_model_family
from miles.models.base import DENOISER
from miles.models.lora import (
    ADAPTER_NAME,
    DEFAULT_LORA_TARGET_MODULES,
    AdaptersDisabled,
    LoraSettings,
    adapted_linears,
    adapter_parameters,
)
from miles.models.memory import meta_denoiser, transformer_config
from miles.utils.collectives import LocalCollectives
from miles.utils.misc import make_generator
from miles.utils.validation import ArgumentValidationError
from tests.support.trainer import (
    TEXT_DIM,
    TEXT_LEN,
    denoiser_loss,
    digits_pairs,
    make_args,
    make_pipeline,
    make_trainer,
    run_spec,
    single_process_group,
)

CPU = torch.device("cpu")
LORA = LoraSettings(rank=4, alpha=8.0, target_modules=("to_q", "to_v", "net.2"))
PAIRS = 8


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def family(pipeline):
    return get_model_family(pipeline)


def _randomize_adapter(model) -> None:
    """peft starts lora_B at zero (a no-op adapter); seeded values make the adapter change the output."""
    gen = make_generator("test_lora_init", 0)
    with torch.no_grad():
        for _, param in adapter_parameters(model, ADAPTER_NAME):
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(torch.randn(local.shape, generator=gen) * 0.1)


def _lora_model(family, pipeline, mesh=None):
    model = load_trainable_denoiser(
        family, str(pipeline), mesh, CPU, torch.float32, [LoraAdapter(LORA, torch.float32)]
    )
    _randomize_adapter(model)
    return model


def test_the_lora_gradient_equals_that_of_a_hand_built_low_rank_update(pipeline, family):
    with single_process_group() as mesh:
        model = _lora_model(family, pipeline)
        adapter = {name: param.detach().clone() for name, param in adapter_parameters(model, ADAPTER_NAME)}
        shard_model(model, [], mesh, torch.float32)  # the trainer's FSDP2 wrapping of a multi-rank group
        denoiser_loss(family, model, seed=5).backward()
        grads = {name: param.grad.full_tensor() for name, param in adapter_parameters(model, ADAPTER_NAME)}
        assert {name for name, param in model.named_parameters() if param.grad is not None} == set(grads)

    # The same loss on the plain model, every targeted weight replaced by W + (alpha / r)·B·A, A and B leaves.
    plain = family.load_denoiser(pipeline).train()
    leaves = {name: value.clone().requires_grad_(True) for name, value in adapter.items()}
    weights = dict(plain.named_parameters())
    scale = LORA.alpha / LORA.rank
    suffix_a = f".lora_A.{ADAPTER_NAME}.weight"
    for name_a in [name for name in leaves if name.endswith(suffix_a)]:
        module = name_a.removesuffix(suffix_a)
        lora_b = leaves[f"{module}.lora_B.{ADAPTER_NAME}.weight"]
        weights[f"{module}.weight"] = weights[f"{module}.weight"] + scale * lora_b @ leaves[name_a]
    # lora_A and lora_B on to_q and to_v of 2 blocks and on net.2 of 3 MLPs (the last block has no context MLP)
    assert len(leaves) == 2 * (2 * 2 + 3)
    loss = denoiser_loss(family, _Bound(plain, weights), seed=5)
    loss.backward()
    for name, leaf in leaves.items():
        assert torch.allclose(grads[name], leaf.grad, atol=1e-6, rtol=0), name
    assert max(grad.abs().max().item() for grad in grads.values()) > 1e-4


class _Bound(torch.nn.Module):
    """``model`` run with other weights (``torch.func.functional_call``), for the hand-built reference."""

    def __init__(self, model, weights):
        super().__init__()
        self.model, self.weights = model, weights

    def parameters(self, recurse=True):
        return iter(self.weights.values())

    def forward(self, **kwargs):
        return functional_call(self.model, self.weights, args=(), kwargs=kwargs)


def test_the_base_with_adapters_disabled_is_the_frozen_teacher_bit_for_bit(pipeline, family):
    teacher = load_frozen_denoiser(family, str(pipeline), None, CPU, torch.float32)
    with single_process_group() as mesh:
        lora = _lora_model(family, pipeline)
        shard_model(lora, [], mesh, torch.float32, reshard_after_forward=False)  # as a multi-rank critic is
        base = AdaptersDisabled(lora)
        with torch.no_grad():
            expected = denoiser_loss(family, teacher, seed=7)
            assert torch.equal(denoiser_loss(family, base, seed=7), expected)
            assert not torch.equal(denoiser_loss(family, lora, seed=7), expected)  # the adapter is on again after it
        reshard(lora)
        # The critic's next step still trains its (sharded) adapter: the teacher's pass left requires_grad alone.
        denoiser_loss(family, lora, seed=8).backward()
        assert all(param.grad is not None for _, param in adapter_parameters(lora, ADAPTER_NAME))
    assert lora.training and not list(base.state_dict())  # no second copy of the weights


def _critic_args(pipeline, tmp_path, rank: int):
    return make_args(pipeline, tmp_path, teacher_load=str(pipeline), lora_rank=rank, lora_alpha=None)


def test_a_lora_critic_group_holds_one_base(pipeline, family, tmp_path):
    sets = {}
    for rank in (0, 4):
        spec = run_spec(_critic_args(pipeline, tmp_path, rank)).group("actor")
        sets[rank] = build_model_set(spec, family, CPU, torch.float32, None, build_converters(spec))
    full, lora = sets[0], sets[4]
    base_bytes = sum(local_bytes(p) for p in family.load_denoiser(pipeline).parameters())
    adapter_bytes = sum(local_bytes(p) for _, p in adapter_parameters(lora.denoiser, ADAPTER_NAME))
    assert isinstance(lora.frozen[DENOISER], AdaptersDisabled)
    assert full.memory_bytes() == {"parameters": base_bytes, "gradients": 0, "optimizer": 0, "frozen": base_bytes}
    assert lora.memory_bytes() == {"parameters": adapter_bytes, "gradients": 0, "optimizer": 0, "frozen": base_bytes}
    # Every weight tensor of the group: one base plus the adapter.
    tensors = {id(p): p for model in lora.modules() for p in model.parameters()}
    assert sum(local_bytes(p) for p in tensors.values()) == base_bytes + adapter_bytes


def _trainer(args, family) -> GroupTrainer:
    torch.manual_seed(args.seed)
    return make_trainer(args, family=family, device=CPU, collectives=LocalCollectives())


def _train(trainer, family, rollouts) -> list[float]:
    losses = []
    for rollout_id in rollouts:
        _, metrics, _ = trainer.train(rollout_id, digits_pairs(family, rollout_id, PAIRS), {})
        losses += [record["train/loss"] for record in metrics]
    return losses


def test_a_lora_step_moves_only_the_adapter_and_resumes_exactly(pipeline, family, tmp_path):
    args = make_args(pipeline, tmp_path, lora_rank=4, lora_alpha=8.0, ema_decay=0.9, num_steps_per_rollout=2)
    trainer = _trainer(args, family)
    adapter = {name for name, _ in adapter_parameters(trainer.models.denoiser, ADAPTER_NAME)}
    assert {f"{DENOISER}.{name}" for name in adapter} == set(trainer.models.ema.names)
    assert all(p.dtype == torch.float32 for p in trainer.models.trainable_parameters())
    before = {name: value.clone() for name, value in trainer.models.denoiser.state_dict().items()}
    _train(trainer, family, range(2))
    after = trainer.models.denoiser.state_dict()
    changed = {name for name, value in after.items() if not torch.equal(value, before[name])}
    # The last SD3 block is context_pre_only: its text-stream query feeds no output, so that adapter gets no gradient.
    assert changed == {name for name in adapter if not name.startswith("transformer_blocks.1.attn.add_q_proj.")}
    optimizer_tensors = [v for state in trainer.models.optimizer.state.values() for v in state.values() if v.ndim]
    assert sum(v.numel() for v in optimizer_tensors) == 2 * sum(before[name].numel() for name in adapter)

    trainer.save(str(tmp_path / "ckpt"), 1)
    model_state = trainer.models.states()["train"].state_dict()["model"]
    assert set(model_state) == {f"{DENOISER}.{name}" for name in adapter}  # no base in the checkpoint
    expected = _train(trainer, family, range(2, 4))
    resumed = _trainer(args, family)
    resumed.load(str(tmp_path / "ckpt"), 1)
    assert _train(resumed, family, range(2, 4)) == expected
    for name, value in trainer.models.denoiser.state_dict().items():
        assert torch.equal(resumed.models.denoiser.state_dict()[name], value), name


def test_the_adapter_export_loads_with_stock_diffusers_and_samples_as_the_merged_one(pipeline, family, tmp_path):
    from miles.models.digits_pipeline import DigitsPipeline

    model = _lora_model(family, pipeline)
    out = tmp_path / "export"
    write_pipeline(
        pipeline, out, family, model.state_dict(), None, overwrite=False, run_paths=[], lora=LORA, save_lora=True
    )
    merged = DigitsPipeline.from_pretrained(out)
    assert not any("lora" in name for name, _ in merged.transformer.named_parameters())
    base = DigitsPipeline.from_pretrained(pipeline)
    base.load_lora_weights(out / LORA_DIR)
    plain = DigitsPipeline.from_pretrained(pipeline)
    with torch.no_grad():
        velocity = {name: _velocity(family, pipe.transformer) for name, pipe in [("base", base), ("merged", merged)]}
        assert torch.allclose(velocity["base"], velocity["merged"], atol=1e-5, rtol=0)
        assert torch.allclose(velocity["merged"], _velocity(family, model), atol=1e-5, rtol=0)  # the trained one
        assert not torch.allclose(_velocity(family, plain.transformer), velocity["merged"], atol=1e-3)
    prompts = [f"a photo of the digit {d}" for d in range(4)]
    got, expected = (pipe(prompts, num_inference_steps=4, seed=11).images.astype(int) for pipe in (base, merged))
    assert abs(got - expected).max() <= 1  # the same images, to uint8 rounding


def test_an_extended_run_replaces_its_own_adapter_export_and_nothing_else(pipeline, family, tmp_path):
    # docs/cluster.md section 8: a LoRA run extended with --load ... --overwrite-save-hf --save-hf-lora exports again
    # over its first export, whose lora/ the export itself wrote.
    model = _lora_model(family, pipeline)
    out = tmp_path / "export"
    export = dict(run_paths=[], lora=LORA, save_lora=True)
    write_pipeline(pipeline, out, family, model.state_dict(), None, overwrite=False, **export)
    assert sorted(p.name for p in (out / LORA_DIR).iterdir()) == ["pytorch_lora_weights.safetensors"]
    first = (out / LORA_DIR / "pytorch_lora_weights.safetensors").read_bytes()
    _randomize_adapter(model)  # the same seed: perturb one entry so that the second export differs
    with torch.no_grad():
        next(param for _, param in adapter_parameters(model, ADAPTER_NAME)).add_(1.0)
    write_pipeline(pipeline, out, family, model.state_dict(), None, overwrite=True, **export)
    assert (out / LORA_DIR / "pytorch_lora_weights.safetensors").read_bytes() != first
    # A file of the user's in lora/ is still theirs: the export refuses to replace the directory.
    (out / LORA_DIR / "notes.txt").write_text("mine\n")
    with pytest.raises(ArgumentValidationError, match=r"holds lora/notes.txt, not part of the pipeline"):
        write_pipeline(pipeline, out, family, model.state_dict(), None, overwrite=True, **export)
    assert (out / LORA_DIR / "notes.txt").read_text() == "mine\n"


def _velocity(family, model) -> torch.Tensor:
    gen = make_generator("test_lora_velocity", 0)
    latents = torch.randn(2, 1, 8, 8, generator=gen)
    cond = {
        "encoder_hidden_states": torch.randn(2, TEXT_LEN, TEXT_DIM, generator=gen),
        "pooled_projections": torch.randn(2, TEXT_DIM, generator=gen),
    }
    return family.predict_velocity(model, latents, torch.tensor([300.0, 800.0]), cond)


def test_target_modules_that_match_nothing_are_named_in_one_line(pipeline, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        make_args(pipeline, tmp_path, "--lora-rank", "4", "--lora-target-modules", "to_q,to_qkv")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--lora-target-modules to_qkv match no Linear module of SD3Transformer2DModel" in err
    assert "to_k, to_out.0, to_q, to_v" in err  # the model's Linear names, for the fix


def test_a_rank_above_every_adapted_layers_width_is_warned(pipeline, tmp_path, caplog):
    widths = [min(m.in_features, m.out_features) for m in adapted_linears(meta_denoiser(transformer_config(pipeline)),
                                                                           DEFAULT_LORA_TARGET_MODULES)]  # fmt: skip
    with caplog.at_level("WARNING", logger="miles.models.lora"):
        make_args(pipeline, tmp_path, "--lora-rank", str(max(widths)))  # full rank on the widest layer: no warning
    assert not caplog.records
    with caplog.at_level("WARNING", logger="miles.models.lora"):
        args = make_args(pipeline, tmp_path, "--lora-rank", str(max(widths) + 1))
    assert args.lora_rank == max(widths) + 1  # it trains: a recipe for a wide model may run on a narrow test model
    assert f"--lora-rank {max(widths) + 1} exceeds min(in, out) of every adapted Linear" in caplog.text
    assert f"(at most {max(widths)})" in caplog.text


def _head(args, models):
    """A built module of the phase-2 kind (the GAN head's place), seeded."""
    head = torch.nn.Linear(4, 2)
    gen = make_generator("test_phase2_head", 0)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return {"head": head}


def test_phase_2_starts_its_head_and_ema_fresh_from_a_phase_1_checkpoint(pipeline, family, tmp_path):
    # Issue 34 item 4: a phase-1 checkpoint (no built module, no EMA) resumed by a command that adds both loads
    # the denoiser and its optimizer state exactly and starts the head as built and the EMA from the loaded weights.
    args = make_args(pipeline, tmp_path, lora_rank=4, lora_alpha=8.0)
    phase1 = _trainer(args, family)
    _train(phase1, family, range(2))
    phase1.save(str(tmp_path / "ckpt"), 1)
    assert not any(
        key.startswith(("train.model.head.", "ema.")) for key in checkpoint.saved_entries(tmp_path / "ckpt", 1)
    )

    torch.manual_seed(args.seed)
    phase2 = make_trainer(make_args(pipeline, tmp_path, lora_rank=4, lora_alpha=8.0, ema_decay=0.9), family=family,
                          device=CPU, collectives=LocalCollectives(), build_modules=_head)  # fmt: skip
    built = {name: value.clone() for name, value in phase2.models.trainable["head"].state_dict().items()}
    phase2.load(str(tmp_path / "ckpt"), 1)
    for name, value in phase1.models.denoiser.state_dict().items():
        assert torch.equal(phase2.models.denoiser.state_dict()[name], value), name
    assert all(torch.equal(phase2.models.trainable["head"].state_dict()[name], value) for name, value in built.items())
    by_name = dict(phase1.models.trainable.named_parameters())
    compared = 0
    for name, param in phase2.models.trainable.named_parameters():
        if name in by_name and param.requires_grad:
            old, new = phase1.models.optimizer.state[by_name[name]], phase2.models.optimizer.state[param]
            assert torch.equal(old["exp_avg"], new["exp_avg"]) and torch.equal(old["exp_avg_sq"], new["exp_avg_sq"])
            compared += 1
    assert compared == len(adapter_parameters(phase1.models.denoiser, ADAPTER_NAME))
    ema = phase2.models.ema
    assert ema.num_updates == 0
    live = dict(phase2.models.trainable.named_parameters())
    assert all(torch.equal(shadow, live[name].detach()) for name, shadow in zip(ema.names, ema.shadows))
    # Its next save holds the head and the EMA: a later resume of phase 2 loads them.
    phase2.save(str(tmp_path / "ckpt2"), 2)
    saved = checkpoint.saved_entries(tmp_path / "ckpt2", 2)
    assert any(key.startswith("train.model.head.") for key in saved) and any(key.startswith("ema.") for key in saved)
