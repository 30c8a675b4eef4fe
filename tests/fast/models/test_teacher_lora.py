"""``--teacher-lora PATH[:WEIGHT]`` on the digits pipeline: two LoRAs made with peft on its transformer and saved
with diffusers' ``save_lora_weights`` are fused into the teacher; the fused teacher predicts as the transformer with
the same LoRAs loaded (unfused) through diffusers' adapter API at the same weights, the student and the critic
start from the fused weights (peft's merge, ``W + Σ w·(alpha/r)·B·A``, checked by hand) unless
``--teacher-lora-teacher-only``, and a LoRA diffusers cannot read stops the command before Ray starts.
"""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.backends.fsdp_utils.model import load_frozen_denoiser, load_trainable_denoiser
from miles.models import get_model_family
from miles.models.teacher_lora import FUSED_DIR, LORA_WEIGHTS, apply_teacher_loras, parse_teacher_lora
from miles.utils.tracking import read_metrics
from tests.support.trainer import make_args, make_pipeline, run_spec

# (rank, alpha, targets, weight): two adapters of their own shapes and scales, one at a negative weight
LORAS = [(4, 8.0, ["to_q", "to_v"], 0.7), (2, 2.0, ["to_k", "to_out.0"], -0.5)]


def _write_lora(family, pipeline, folder, seed, rank, alpha, targets):
    """A random LoRA (peft, B not zero) on the digits transformer, saved as a user's fine-tune is."""
    from diffusers.loaders import SD3LoraLoaderMixin
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = family.load_denoiser(pipeline)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(config, adapter_name="style")
    layers = get_peft_model_state_dict(model, adapter_name="style")
    SD3LoraLoaderMixin.save_lora_weights(
        folder, transformer_lora_layers=layers, transformer_lora_adapter_metadata=config.to_dict()
    )
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher_lora")
    pipeline = make_pipeline(root / "digits")
    family = get_model_family(pipeline)
    loras = [
        _write_lora(family, pipeline, root / f"lora{index}", index, rank, alpha, targets)
        for index, (rank, alpha, targets, _) in enumerate(LORAS)
    ]
    flags = [f"{lora}:{weight}" for lora, (*_, weight) in zip(loras, LORAS)]
    return {"root": root, "pipeline": pipeline, "family": family, "loras": loras, "flags": flags}


def _dmd2_args(world, run_dir, *extra):
    flags = [arg for flag in world["flags"] for arg in ("--teacher-lora", flag)]
    return make_args(
        world["pipeline"], run_dir, "--loss-type", "dmd2", "--teacher-load", str(world["pipeline"]),
        "--dmd2-critic-steps-per-rollout", "2", *flags, *extra, train_only=False,
    )  # fmt: skip


def test_the_weight_is_read_after_the_last_colon():
    assert parse_teacher_lora("a/b") == ("a/b", 1.0)
    assert parse_teacher_lora("a/b:0.5") == ("a/b", 0.5)
    assert parse_teacher_lora("c:/x:-2") == ("c:/x", -2.0)
    assert parse_teacher_lora("dir:name") == ("dir:name", 1.0)  # not a number: part of the path
    with pytest.raises(ValueError, match="finite"):
        parse_teacher_lora("a:nan")


def test_the_fused_teacher_predicts_as_diffusers_with_the_loras_loaded(world, tmp_path):
    """The reference: the transformer with both LoRAs loaded by ``load_lora_adapter`` and weighted by
    ``set_adapters``, not fused (peft adds ``w·(alpha/r)·B(A(x))`` in the forward)."""
    from diffusers import SD3Transformer2DModel

    family, pipeline = world["family"], world["pipeline"]
    args = _dmd2_args(world, tmp_path)
    fused = apply_teacher_loras(args)
    assert fused == tmp_path / "out" / FUSED_DIR and args.teacher_load == str(fused)
    teacher = load_frozen_denoiser(family, args.teacher_load, None, torch.device("cpu"), torch.float32)
    base = family.load_denoiser(pipeline)
    stock = SD3Transformer2DModel.from_pretrained(pipeline / "transformer").eval()
    for index, lora in enumerate(world["loras"]):
        stock.load_lora_adapter(str(lora), adapter_name=f"a{index}", weight_name=LORA_WEIGHTS)
    stock.set_adapters(["a0", "a1"], [weight for *_, weight in LORAS])

    generator = torch.Generator().manual_seed(0)
    shape = family.latent_shape(pipeline)
    latents = torch.randn(3, *shape, generator=generator)
    timestep = torch.tensor([900.0, 500.0, 60.0])
    cond = family.encode_prompts(family.load_text_encoder(pipeline), ["a 3", "a 7", "a 0"])
    with torch.no_grad():
        ours = family.predict_velocity(teacher, latents, timestep, cond)
        reference = family.predict_velocity(stock, latents, timestep, cond)
        plain = family.predict_velocity(base, latents, timestep, cond)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
    assert (ours - plain).abs().max() > 1e-2  # the LoRAs change the teacher


def _merged(pipeline, loras) -> dict[str, torch.Tensor]:
    """The transformer's weights with the LoRAs merged by hand: ``W += w · (alpha / r) · B @ A``."""
    from diffusers import SD3Transformer2DModel

    weights = SD3Transformer2DModel.from_pretrained(pipeline / "transformer").state_dict()
    for lora, (rank, alpha, _, weight) in zip(loras, LORAS):
        state = load_file(lora / LORA_WEIGHTS)
        for key in [k for k in state if k.endswith("lora_A.weight")]:
            module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            delta = state[key.replace("lora_A", "lora_B")] @ state[key]
            weights[f"{module}.weight"] = weights[f"{module}.weight"] + weight * (alpha / rank) * delta
    return weights


@pytest.mark.parametrize("teacher_only", [False, True])
def test_the_student_and_the_critic_start_from_the_fused_weights(world, tmp_path, teacher_only):
    family, pipeline = world["family"], world["pipeline"]
    args = _dmd2_args(world, tmp_path, *(["--teacher-lora-teacher-only"] if teacher_only else []))
    fused = str(apply_teacher_loras(args))
    groups = {group.role: group for group in run_spec(args).groups}
    start = str(pipeline) if teacher_only else fused
    assert groups["actor"].init == start and groups["critic"].init == start
    assert groups["critic"].teacher == fused
    student = load_trainable_denoiser(family, groups["actor"].init, None, torch.device("cpu"), torch.float32)
    expected = _merged(pipeline, world["loras"])
    initial = family.load_denoiser(pipeline).state_dict()
    for key, value in student.state_dict().items():
        torch.testing.assert_close(value, initial[key] if teacher_only else expected[key], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("teacher_only_alone", "--teacher-lora-teacher-only changes where --teacher-lora goes: add --teacher-lora"),
        ("no_teacher", "is fused into the teacher: add --teacher-load"),
    ],
)
def test_bad_teacher_lora_flags_are_named(world, tmp_path, capsys, case, message):
    with pytest.raises(SystemExit) as exc:
        if case == "missing":
            _dmd2_args(world, tmp_path, "--teacher-lora", str(tmp_path / "missing"))
        elif case == "teacher_only_alone":
            make_args(world["pipeline"], tmp_path, "--teacher-lora-teacher-only")
        else:
            make_args(world["pipeline"], tmp_path, "--teacher-lora", str(world["loras"][0]))
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_lora_diffusers_cannot_read_stops_the_command_before_ray(world, tmp_path, capsys):
    from tests.support.driver import run_main

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    argv = [
        "--loss-type", "dmd2", "--hf-checkpoint", str(world["pipeline"]), "--teacher-load", str(world["pipeline"]),
        "--teacher-lora", str(bad), "--prompt-data", str(tmp_path / "data.jsonl"),
        "--rollout-batch-size", "2", "--num-rollout", "1", "--dmd2-critic-steps-per-rollout", "1",
        "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    (tmp_path / "data.jsonl").write_text('{"prompt": "a 3"}\n')
    # A file that is no safetensors file, then one of no LoRA's tensors (the teacher's own weights): refused when the
    # flags are checked, so a dry run refuses them too.
    weights = next((Path(world["pipeline"]) / "transformer").glob("*.safetensors"))
    for lora, message in ((bad, "is not a readable safetensors file"), (weights, "holds no LoRA tensors")):
        for dry_run in ([], ["--dry-run"]):
            argv[argv.index("--teacher-lora") + 1] = str(lora)
            with pytest.raises(SystemExit) as exc:
                run_main([*argv, *dry_run])
            assert exc.value.code == 2
            assert f"--teacher-lora {lora}: {lora} {message}" in capsys.readouterr().err
    assert not (tmp_path / "out" / FUSED_DIR).exists()


def test_a_dmd2_run_distills_from_the_fused_teacher_and_its_student_starts_there(world, tmp_path, ray_cluster):
    """One rollout on 2 CPU ranks through ``train_diffusion.main`` with the student's learning rate 0: its export
    holds the weights it started from, the fused ones; the run trained against the fused teacher."""
    from diffusers import SD3Transformer2DModel

    from tests.support.driver import run_main

    (tmp_path / "data.jsonl").write_text("".join(f'{{"prompt": "a {digit}"}}\n' for digit in range(4)))
    flags = [arg for flag in world["flags"] for arg in ("--teacher-lora", flag)]
    run_main([
        "--loss-type", "dmd2", "--hf-checkpoint", str(world["pipeline"]), "--teacher-load", str(world["pipeline"]),
        *flags, "--prompt-data", str(tmp_path / "data.jsonl"), "--actor-num-gpus-per-node", "2",
        "--rollout-batch-size", "4", "--micro-batch-size", "1", "--dmd2-critic-steps-per-rollout", "1",
        "--num-rollout", "1", "--lr", "0", "--critic-lr", "1e-3", "--output-dir", str(tmp_path / "out"),
        "--save-hf", str(tmp_path / "student"),
    ])  # fmt: skip
    exported = SD3Transformer2DModel.from_pretrained(tmp_path / "student" / "transformer").state_dict()
    expected = _merged(world["pipeline"], world["loras"])
    for key, value in exported.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6)
    records = [r for r in read_metrics(tmp_path / "out") if "train/critic-loss" in r]
    assert records and all(math.isfinite(r["train/critic-loss"]) for r in records)
