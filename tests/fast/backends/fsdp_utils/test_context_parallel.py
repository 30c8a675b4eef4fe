"""Context parallelism (``--context-parallel-size``, issue 33 item 4) through diffusers' Ulysses implementation, on
the CPU over gloo: the tiny Wan pipeline's ``WanTransformer3DModel`` (8 video tokens, 2 heads) at 2 ranks of one CP
group (DP 1 × CP 2, FSDP2 sharded over both) against the same work at 1 rank.

The 2-rank run is real torch.distributed (gloo), real FSDP2, real diffusers ``enable_parallelism`` with the
all-to-alls of Ulysses. One thing is mocked: ``torch.accelerator.device_count``. diffusers 0.42.1 places its parallel
config on ``torch.device(accelerator, rank % torch.accelerator.device_count())``, which is one GPU per rank on a CUDA
cluster and a division by zero on a CPU-only torch; the mock (1) stands in for that GPU condition, one accelerator
per rank.
"""

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles.backends.fsdp_utils.context_parallel import (
    build_meshes,
    check_context_parallel,
    dp_rank_of,
    enable_context_parallel,
    splits_text,
)
from miles.backends.fsdp_utils.loss_hub.sft import sft_loss_formula
from miles.utils.misc import make_generator
from miles.utils.types import TrainPair
from tests.support.trainer import free_port, make_args, make_trainer

PAIRS = 4  # one optimizer step of 2 micro-batches of 2
LATENTS = (4, 2, 4, 4)  # the tiny Wan pipeline's latents: 2 × 2 × 2 = 8 tokens of patch (1, 2, 2)
TEXT = (8, 16)
# float32 on the CPU: the split, the all-to-alls and the sharded reduction change only the rounding. Measured: the loss
# equal, the gradient norm to 1e-7 relative, the trained velocity to 2.4e-7; the weights after one AdamW step (lr 1e-3)
# to 1.2e-6, where AdamW's first step (lr · g / (|g| + eps)) magnifies the rounding of a near-zero gradient. Without
# the DP divide factor the gradient norm was half the 1-rank one and the weights 8e-5 apart.
ATOL = 1e-6
WEIGHTS_ATOL = 5e-6  # 0.5 % of the step's learning rate


def _pairs() -> list[TrainPair]:
    gen = make_generator("test_context_parallel", 0)
    return [
        TrainPair(
            sample_index=i,
            x0=torch.randn(LATENTS, generator=gen),
            pos_cond={"encoder_hidden_states": torch.randn(TEXT, generator=gen)},
        )
        for i in range(PAIRS)
    ]


def _probe():
    gen = make_generator("test_context_parallel_probe", 0)
    return torch.randn(2, *LATENTS, generator=gen), torch.tensor([750.0, 250.0]), torch.randn(2, *TEXT, generator=gen)


def _args(pipeline, run_dir, ranks: int, cp: int):
    return make_args(
        pipeline,
        Path(run_dir),
        "--actor-num-gpus-per-node", str(ranks),
        "--context-parallel-size", str(cp),
        "--rollout-batch-size", str(PAIRS),
        "--global-batch-size", str(PAIRS),
        "--num-steps-per-rollout", "1",
    )  # fmt: skip


def _after_one_step(trainer) -> dict:
    """The step's loss, the full weights after it, and the trained model's velocity on a fixed probe."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    _, metrics, _ = trainer.train(0, _pairs(), {})
    denoiser = trainer.models.denoiser
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    weights = {name: value.detach().clone() for name, value in get_model_state_dict(denoiser, options=options).items()}
    latents, timestep, text = _probe()
    with torch.no_grad():
        velocity = trainer.family.predict_velocity(denoiser, latents, timestep, {"encoder_hidden_states": text})
    return {"metrics": metrics, "weights": weights, "velocity": velocity, "seen": list(SEEN)}


SEEN: list[tuple[int, int]] = []  # (dp_rank, dp_size) of each micro-batch the loss hook saw, in this process


def _recording_loss(ctx, pairs, prepared, **kwargs):
    """The SFT loss, noting the DP rank and size the hook sees."""
    SEEN.append((ctx.dp_rank, ctx.dp_size))
    return sft_loss_formula(ctx, pairs, prepared, **kwargs)


def _cp_rank(rank: int, port: int, pipeline: str, run_dir: str, results) -> None:
    from miles.utils.collectives import ProcessGroupCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # The mocked GPU condition (module docstring): one accelerator per rank, as on a CUDA cluster.
        with mock.patch.object(torch.accelerator, "device_count", return_value=1):
            mesh, cp_mesh = build_meshes("cpu", 2, 2)
            torch.manual_seed(0)
            trainer = make_trainer(
                _args(pipeline, run_dir, 2, 2),
                collectives=ProcessGroupCollectives(torch.device("cpu")),
                mesh=mesh,
                cp_mesh=cp_mesh,
                loss=_recording_loss,
            )
            out = _after_one_step(trainer)
        out["mesh"] = (mesh.mesh_dim_names, mesh.size(), cp_mesh.mesh_dim_names, tuple(cp_mesh.shape))
        out["parallel"] = trainer.models.denoiser._parallel_config is not None
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from tests.support.tiny_pipelines import write_tiny_wan

    return str(write_tiny_wan(tmp_path_factory.mktemp("cp") / "wan"))


@pytest.fixture(scope="module")
def runs(pipeline, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cp_run")
    results = mp.Manager().dict()
    mp.spawn(_cp_rank, args=(free_port(), pipeline, str(run_dir), results), nprocs=2)
    torch.manual_seed(0)
    one = _after_one_step(make_trainer(_args(pipeline, run_dir, 1, 1), loss=_recording_loss))
    return one, dict(results)


def test_a_cp_group_of_two_trains_as_one_rank(runs):
    """DP 1 × CP 2 (FSDP over both ranks, Ulysses over both) takes the step one rank takes: the loss, the gradient
    norm, every weight after one AdamW step and the trained model's velocity agree (tolerances above). The gradient is
    the DP mean: the CP ranks' gradients (each of its own tokens) are summed, the DP ranks' averaged."""
    one, cp = runs
    assert sorted(cp) == [0, 1]
    for rank in (0, 1):
        assert cp[rank]["parallel"]
        assert cp[rank]["mesh"] == (("dp_cp",), 2, ("ring", "ulysses"), (1, 2))
        # Both ranks of the CP group are DP rank 0 of 1: the same pairs, the same noise (seeded by DP rank).
        assert cp[rank]["seen"] == [(0, 1), (0, 1)]
        torch.testing.assert_close(cp[rank]["velocity"], one["velocity"], atol=ATOL, rtol=0)
        assert cp[rank]["weights"].keys() == one["weights"].keys()
        for name, value in one["weights"].items():
            torch.testing.assert_close(cp[rank]["weights"][name], value, atol=WEIGHTS_ATOL, rtol=0, msg=name)
    (record,) = cp[0]["metrics"]
    (expected,) = one["metrics"]
    assert record["train/loss"] == pytest.approx(expected["train/loss"], abs=ATOL)
    # The gradient itself (before clipping): FSDP's default mean over dp × cp gave half of it.
    assert expected["train/grad_norm"] > 0.1
    assert record["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-6)


def test_the_dp_rank_of_a_cp_group_is_its_first_rank_over_cp():
    assert [dp_rank_of(rank, 2) for rank in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [dp_rank_of(rank, 1) for rank in range(3)] == [0, 1, 2]


def test_a_family_without_a_cp_plan_or_an_indivisible_sequence_is_refused_in_one_line():
    from diffusers import SD3Transformer2DModel, WanTransformer3DModel

    with pytest.raises(ValueError, match=r"--context-parallel-size 2: SD3Transformer2DModel has no context-parallel"):
        check_context_parallel(SD3Transformer2DModel, 64, 4, 2)
    with pytest.raises(
        ValueError, match=r"--context-parallel-size 4 must divide the sequence length: one sample has 6"
    ):
        check_context_parallel(WanTransformer3DModel, 6, 4, 4)
    with pytest.raises(ValueError, match=r"--context-parallel-size 4 must divide the denoiser's 2 attention heads"):
        check_context_parallel(WanTransformer3DModel, 8, 2, 4)
    check_context_parallel(WanTransformer3DModel, 8, 2, 2, text_tokens=7)  # Wan's plan leaves the text whole
    from diffusers import FluxTransformer2DModel

    with pytest.raises(
        ValueError, match=r"must divide the text sequence too \(FluxTransformer2DModel splits it\): one "
    ):
        check_context_parallel(FluxTransformer2DModel, 8, 2, 2, text_tokens=7)
    check_context_parallel(FluxTransformer2DModel, 8, 2, 2, text_tokens=512)
    assert splits_text(FluxTransformer2DModel) and not splits_text(WanTransformer3DModel)
    check_context_parallel(SD3Transformer2DModel, 7, 3, 1)  # no CP: nothing to check
    assert enable_context_parallel(torch.nn.Linear(2, 2), None) is None


def test_the_preflight_refuses_a_denoiser_diffusers_cannot_split_naming_the_flag_and_the_pipeline(pipeline, tmp_path):
    """Before Ray starts: the digits pipeline (an SD3 transformer, no ``_cp_plan``) and a CP size that does not divide
    the tiny Wan's 2 heads are refused in one line; the tiny Wan at CP 2 passes."""
    from types import SimpleNamespace

    from miles.driver.preflight import _check_context_parallel
    from miles.models import get_model_family
    from miles.utils.validation import ArgumentValidationError
    from tests.support.trainer import make_pipeline

    def preflight(args, pipelines):
        families = {path: get_model_family(path) for _, path in pipelines}
        _check_context_parallel(args, pipelines, families)

    digits = str(make_pipeline(tmp_path / "digits"))
    args = SimpleNamespace(diffusion_model_family=None, context_parallel_size=2)
    with pytest.raises(ArgumentValidationError) as refused:
        preflight(args, [("--hf-checkpoint", digits)])
    assert str(refused.value) == (
        f"--hf-checkpoint {digits}: --context-parallel-size 2: SD3Transformer2DModel has no context-parallel plan in "
        "diffusers (_cp_plan); use a family that has one (Wan, FLUX, FLUX.2, Qwen-Image) or --context-parallel-size 1"
    )
    preflight(args, [("--hf-checkpoint", pipeline), ("--teacher-load", pipeline)])
    args.context_parallel_size = 4
    with pytest.raises(
        ArgumentValidationError, match=r"--teacher-load .*: --context-parallel-size 4 must divide the "
    ):
        preflight(args, [("--teacher-load", pipeline)])
    args.context_parallel_size = 1
    preflight(args, [("--hf-checkpoint", digits)])  # without CP nothing is read
