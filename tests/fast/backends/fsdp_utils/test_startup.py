"""Start-up memory (issue 30, item 1): a denoiser is built on the meta device, converted, sharded, and then each rank
reads only its own rows of each tensor from the safetensors files (``miles.backends.fsdp_utils.weights``).

What the 2-rank tests stand in for: on 3ea913a every rank loaded the whole unsharded model (a full float32 copy in
its host memory) and moved it to its GPU before ``fully_shard``, so at start-up every GPU held the whole model
(FLUX.1-dev: 44 GiB per group on an 80 GB card) and a node of 8 GPUs held 8 full float32 copies in host memory. On
the CPU the shards live in host memory, so a rank's peak RSS during the load is what its GPU would hold: real
torch.distributed over gloo, real FSDP2, a real diffusers checkpoint written with ``save_pretrained``.
"""

import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles.backends.fsdp_utils.converters import build_converters
from miles.backends.fsdp_utils.model import load_frozen_denoiser, load_trainable_denoiser
from miles.backends.fsdp_utils.model_set import build_model_set, shares_teacher_base
from miles.models import get_model_family
from miles.models.base import DENOISER
from miles.models.precision import cast_buffers
from tests.support.tiny_pipelines import write_tiny_wan
from tests.support.trainer import free_port, make_args, make_pipeline, run_spec

CPU = torch.device("cpu")
# An SD3 transformer of 208.7M parameters (0.83 GB in float32): 10 joint blocks of width 768.
SD3_200M = dict(
    sample_size=32, patch_size=2, in_channels=4, out_channels=4, num_layers=10, attention_head_dim=64,
    num_attention_heads=12, joint_attention_dim=768, caption_projection_dim=768, pooled_projection_dim=768,
    pos_embed_max_size=32,
)  # fmt: skip


@pytest.fixture(scope="module")
def big_pipeline(tmp_path_factory):
    """``<dir>/transformer``: the 200M SD3 transformer with seeded random weights, saved as a sharded checkpoint
    (three safetensors files and their index), the layout of every large diffusers model."""
    from diffusers import SD3Transformer2DModel

    folder = tmp_path_factory.mktemp("sd3_200m")
    torch.manual_seed(0)
    SD3Transformer2DModel(**SD3_200M).save_pretrained(folder / DENOISER, max_shard_size="300MB")
    return folder


def _status_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, from /proc/self/status. Not
    ``getrusage``'s ``ru_maxrss``: Linux carries it across fork and exec, so a spawned rank would start from the
    test process's own peak."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def _chunk(full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``full`` as FSDP2 shards dim 0 (torch.chunk into 2; an empty tail past the end)."""
    chunks = torch.chunk(full, 2) if full.dim() else [full]
    return chunks[rank] if rank < len(chunks) else full[:0]


def _measure_rank(rank: int, port: int, pipeline: str, results) -> None:
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        family = get_model_family(pipeline, "sd3")
        import accelerate  # noqa: F401  (imports are the process's, not the load's: ~150 MB before the baseline)
        from diffusers import SD3Transformer2DModel  # noqa: F401
        from safetensors import safe_open  # noqa: F401

        # The increase is the peak after the load over the resident size before it: an upper bound of what the
        # load held at once (an earlier, higher peak can only make it look larger).
        before = _status_bytes("VmRSS")
        student = load_trainable_denoiser(family, pipeline, mesh, CPU, torch.bfloat16)
        trainable_increase = _status_bytes("VmHWM") - before
        before = _status_bytes("VmRSS")
        teacher = load_frozen_denoiser(family, pipeline, mesh, CPU, torch.bfloat16)
        frozen_increase = _status_bytes("VmHWM") - before
        # The files' values, read whole by safetensors itself, against each rank's shards.
        full = {}
        for file in sorted((Path(pipeline) / DENOISER).glob("*.safetensors")):
            full.update(load_file(file))
        wrong = []
        for model, dtype in ((student, torch.float32), (teacher, torch.bfloat16)):
            for name, param in model.named_parameters():
                local = param.to_local()
                if local.dtype != dtype or not torch.equal(local, _chunk(full[name], rank).to(dtype)):
                    wrong.append(name)
            # Buffers are stored in the compute dtype in every role (miles.models.precision; SD3 keeps none in
            # float32).
            for name, buffer in model.named_buffers():
                if not torch.equal(buffer, full[name].to(torch.bfloat16)):
                    wrong.append(name)
        results[rank] = {"trainable": trainable_increase, "frozen": frozen_increase, "wrong": wrong}
    except Exception:  # noqa: BLE001 (reported to the test process)
        results[rank] = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()


def test_each_rank_holds_well_under_one_full_copy_at_start_up_and_its_shards_equal_the_files(big_pipeline):
    results = mp.Manager().dict()
    mp.spawn(_measure_rank, args=(free_port(), str(big_pipeline), results), nprocs=2)
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        numel = sum(p.numel() for p in SD3Transformer2DModel(**SD3_200M).parameters())
    fp32_copy, bf16_copy = 4 * numel, 2 * numel
    for rank in (0, 1):
        result = results[rank]
        assert "error" not in result, result.get("error")
        assert result["wrong"] == []
        # A rank keeps half of the model (its shards): 0.52 measured; 3ea913a's ranks 0.93 (the whole model).
        assert result["trainable"] < 0.65 * fp32_copy, (rank, result["trainable"] / fp32_copy)
        # The frozen teacher in the compute dtype goes the same way: 0.53 of one bf16 copy measured.
        assert result["frozen"] < 0.65 * bf16_copy, (rank, result["frozen"] / bf16_copy)


# -- the values: bit-identical to loading the whole model in one process --------------------------------------------
def _todays_load(spec, args, family, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module | None, dict]:
    """What 3ea913a's ``build_model_set`` loaded, in one process: the whole denoiser from ``family.load_denoiser``,
    frozen where unused, converted, the separate teacher in the compute dtype, then the method's built modules."""
    converters = build_converters(spec)
    torch.manual_seed(spec.seed)
    model = family.load_denoiser(spec.init, dtype=torch.float32)
    model.train().requires_grad_(True)
    for name in family.unused_parameters(model):
        model.get_parameter(name).requires_grad_(False)
    for converter in converters:
        converter.convert(DENOISER, model)
    # The one deliberate change since: the trainable model's buffers in the compute dtype (miles.models.precision).
    cast_buffers(model, dtype)
    teacher = None
    if spec.teacher and not shares_teacher_base(spec, converters):
        teacher = family.load_denoiser(spec.teacher, dtype=dtype).eval().requires_grad_(False)
    built = spec.hooks.build_modules(args, {DENOISER: model})
    return model, teacher, built


def _differences(reference: torch.nn.Module, model: torch.nn.Module) -> list[str]:
    """Names whose value, dtype or requires_grad differ (sharded tensors gathered whole first)."""
    ours = dict(model.named_parameters())
    differ = sorted(set(ours) ^ {name for name, _ in reference.named_parameters()})
    for name, param in reference.named_parameters():
        if name in ours:
            other = ours[name].full_tensor() if hasattr(ours[name], "full_tensor") else ours[name]
            same = param.dtype == other.dtype and param.requires_grad == ours[name].requires_grad
            if not (same and torch.equal(param.detach(), other.detach())):
                differ.append(name)
    buffers = dict(model.named_buffers())
    differ += [name for name, buffer in reference.named_buffers() if not torch.equal(buffer, buffers[name])]
    return differ


def _parity_rank(rank: int, port: int, cases: dict, wan: str, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        out = {}
        # Sharded over the 2 ranks, and unwrapped as a group of one is (the whole model on its device).
        for (case, (spec, args)), group_mesh in ((item, m) for item in cases.items() for m in (mesh, None)):
            case = case if group_mesh is not None else f"{case}, unwrapped"
            family = get_model_family(spec.init)
            reference, teacher, built = _todays_load(spec, args, family, torch.bfloat16)
            reference_rng = torch.get_rng_state()
            torch.manual_seed(spec.seed)
            models = build_model_set(spec, family, CPU, torch.bfloat16, group_mesh, build_converters(spec), args)
            out[case] = {
                "denoiser": _differences(reference, models.denoiser),
                "teacher": _differences(teacher, models.frozen[DENOISER]) if teacher is not None else [],
                "built": [n for name, module in built.items() for n in _differences(module, models.trainable[name])],
                "rng": torch.equal(torch.get_rng_state(), reference_rng),
                "adapters": sum(".lora_A." in name for name, _ in models.denoiser.named_parameters()),
            }
        # Wan keeps _keep_in_fp32_modules in float32 when from_pretrained loads it in bf16: the frozen load must too.
        family = get_model_family(wan)
        torch.manual_seed(1)
        reference = family.load_denoiser(wan, dtype=torch.bfloat16).requires_grad_(False)
        reference_rng = torch.get_rng_state()  # Wan draws its scale_shift_table from the global RNG as it is built
        torch.manual_seed(1)
        frozen = load_frozen_denoiser(family, wan, mesh, CPU, torch.bfloat16)
        float32 = sorted(name for name, param in frozen.named_parameters() if param.dtype == torch.float32)
        out["wan_frozen"] = {
            "teacher": _differences(reference, frozen),
            "float32": float32,
            "rng": torch.equal(torch.get_rng_state(), reference_rng),
        }
        results[rank] = out
    except Exception:  # noqa: BLE001 (reported to the test process)
        results[rank] = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()


def test_the_sharded_load_equals_todays_whole_model_load_bit_for_bit(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    (tmp_path / "real.jsonl").write_text('{"prompt": "a digit 3", "image": "3.png"}\n')
    dmd2 = ["--loss-type", "dmd2", "--teacher-load", str(pipeline), "--train-dtype", "bfloat16", "--dmd2-critic-steps-per-rollout", "2",
            "--dmd2-gan-disc-weight", "0.01", "--dmd2-gan-real-data", str(tmp_path / "real.jsonl")]  # fmt: skip
    cases = {}
    for case, extra in {"full": [], "lora": ["--critic-lora-rank", "4"]}.items():
        run = run_spec(make_args(pipeline, tmp_path, *dmd2, *extra, train_only=False))
        critic = run.groups[0]
        assert critic.role == "critic"
        cases[case] = (critic, run.args)
    wan = write_tiny_wan(tmp_path / "wan")
    results = mp.Manager().dict()
    mp.spawn(_parity_rank, args=(free_port(), cases, str(wan), results), nprocs=2)
    for rank in (0, 1):
        assert "error" not in results[rank], results[rank]["error"]
        for case in ("full", "lora", "full, unwrapped", "lora, unwrapped"):
            result = results[rank][case]
            # Weights, dtypes and requires_grad of the denoiser (LoRA: base and adapter initial values), the
            # separate teacher, and the GAN head the method builds after them; the global RNG left where it was.
            assert result["denoiser"] == result["teacher"] == result["built"] == [], (rank, case, result)
            assert result["rng"], (rank, case)
        assert results[rank]["lora"]["adapters"] > 0 and results[rank]["full"]["adapters"] == 0
        assert results[rank]["wan_frozen"]["teacher"] == [] and results[rank]["wan_frozen"]["rng"]
        assert results[rank]["wan_frozen"]["float32"], "no float32-kept module: the rule was not exercised"


# -- the files: what a family names, and what a bad checkpoint says --------------------------------------------------
def test_weight_files_are_the_single_file_or_the_index_shards_and_a_bad_checkpoint_fails_in_one_line(tmp_path):
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file, save_file

    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    folder = pipeline / DENOISER
    assert family.denoiser_weight_files(pipeline) == [folder / "diffusion_pytorch_model.safetensors"]
    assert family.denoiser_class(pipeline) is SD3Transformer2DModel
    # A sharded checkpoint: the files its index lists, each once, and the same weights once loaded.
    sharded = tmp_path / "sharded"
    family.load_denoiser(pipeline).save_pretrained(sharded / DENOISER, max_shard_size="200KB")
    files = family.denoiser_weight_files(sharded)
    assert len(files) > 1 and all(file.parent == sharded / DENOISER for file in files)
    whole = load_trainable_denoiser(family, str(pipeline), None, CPU, torch.float32).state_dict()
    again = load_trainable_denoiser(family, str(sharded), None, CPU, torch.float32).state_dict()
    assert all(torch.equal(whole[name], again[name]) for name in whole)
    files[-1].unlink()
    with pytest.raises(FileNotFoundError, match=r"index.json lists weight files that are missing: \[.*"):
        family.denoiser_weight_files(sharded)
    # Pickled weights only: the error says how to re-save (preflight refuses them before Ray with the same advice).
    (folder / "diffusion_pytorch_model.safetensors").rename(folder / "diffusion_pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no diffusion_pytorch_model.safetensors .* safe_serialization=True"):
        family.denoiser_weight_files(pipeline)
    (folder / "diffusion_pytorch_model.bin").rename(folder / "diffusion_pytorch_model.safetensors")
    # A tensor missing from the files, or of another shape, is named before training starts.
    state = load_file(folder / "diffusion_pytorch_model.safetensors")
    bad = {name: value for name, value in state.items() if name != "proj_out.bias"}
    save_file(bad, folder / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"the weight files hold no value for proj_out.bias"):
        load_trainable_denoiser(family, str(pipeline), None, CPU, torch.float32)
    save_file({**state, "proj_out.bias": state["proj_out.bias"][:1]}, folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'proj_out.bias' has shape \(1,\), the model's is \(\d+,\)"):
        load_trainable_denoiser(family, str(pipeline), None, CPU, torch.float32)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_class_name": "NoSuchTransformer"}))
    with pytest.raises(ValueError, match=r"names _class_name 'NoSuchTransformer', which is not a diffusers model"):
        family.build_meta_denoiser(pipeline)
