"""Shared pieces of the trainer tests: a digits pipeline, real parsed args, real train pairs, and test hooks.

The hooks below are loaded by dotted path (``tests.support.trainer.echo_output``) inside Ray workers, which find
this module through the ``PYTHONPATH`` that :mod:`tests.support.ray` exports.
"""

import json
import socket
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from miles.utils.misc import make_generator
from miles.utils.types import TrainPair

SFT_PREPARE = "miles.backends.fsdp_utils.loss_hub.sft.prepare_sft_batch"
SFT_LOSS = "miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula"
TEXT_LEN, TEXT_DIM = 16, 384


def make_pipeline(out_dir: Path, seed: int = 0) -> Path:
    """A 2-layer digits pipeline (patch 2, 4 heads × 8): ~0.1M parameters, fast on CPU."""
    from miles.models.digits import init_digits_pipeline

    return init_digits_pipeline(out_dir, seed=seed, num_layers=2, attention_head_dim=8)


def make_args(pipeline: Path, run_dir: Path, *extra: str, train_only: bool = True, **overrides):
    """Real parsed args for an SFT trainer group of 2 CPU ranks; ``overrides`` are set on the result."""
    from miles.driver.arguments import parse_args

    argv = [
        *(["--train-only"] if train_only else []),
        "--hf-checkpoint", str(pipeline),
        "--prompt-data", str(run_dir / "data.jsonl"),
        "--actor-num-gpus-per-node", "2",
        "--rollout-batch-size", "8",
        "--num-rollout", "4",
        "--micro-batch-size", "2",
        "--lr", "1e-3",
        "--output-dir", str(run_dir / "out"),
        *extra,
    ]  # fmt: skip
    if "--loss-type" not in extra:
        argv += ["--loss-type", "sft_loss"]
    args = parse_args(argv)
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def run_spec(args):
    """The run's specs of parsed ``args`` as the driver builds them (every hook path imported once)."""
    from miles.driver.specs import build_run_spec

    return build_run_spec(args)


def make_trainer(
    args,
    role: str = "actor",
    *,
    family=None,
    device=None,
    collectives=None,
    mesh=None,
    cp_mesh=None,
    trainer_class=None,
    converters=None,
    **hooks,
):
    """The ``GroupTrainer`` of ``role`` in the run ``args`` describe, as one rank builds it (``LocalCollectives`` on
    the CPU by default); ``hooks`` replace hooks of its spec (``loss=fn``); ``cp_mesh`` turns on context
    parallelism."""
    from miles.backends.fsdp_utils.trainer import GroupTrainer
    from miles.methods.base import replace_hooks
    from miles.utils.collectives import LocalCollectives

    run = run_spec(args)
    spec = run.group(role)
    if hooks:
        spec = replace_hooks(spec, **hooks)
    cls = trainer_class or spec.hooks.trainer or GroupTrainer
    return cls(
        spec,
        family if family is not None else run.engine.make_family(spec.init),
        device=torch.device("cpu") if device is None else device,
        collectives=LocalCollectives() if collectives is None else collectives,
        mesh=mesh,
        **({"cp_mesh": cp_mesh} if cp_mesh is not None else {}),
        args=run.args,
        profile=run.profile,
        converters=converters,
    )


def digits_pairs(family, rollout_id: int, count: int) -> list[TrainPair]:
    """``count`` SFT pairs of real sklearn digits (a different slice per rollout) with seeded cond tensors."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    start = (rollout_id * count) % (len(digits.images) - count)
    images = np.floor(digits.images[start : start + count] * (255.0 / 16.0) + 0.5).astype(np.uint8)
    latents = family.images_to_latents(torch.from_numpy(images))
    pairs = []
    for i in range(count):
        gen = make_generator("test_cond", int(digits.target[start + i]))
        cond = {
            "encoder_hidden_states": torch.randn(TEXT_LEN, TEXT_DIM, generator=gen),
            "pooled_projections": torch.randn(TEXT_DIM, generator=gen),
        }
        pairs.append(TrainPair(sample_index=i, x0=latents[i], pos_cond=cond))
    return pairs


def dmd2_args(**values) -> SimpleNamespace:
    """Hook args of ``values`` whose ``method_settings`` are the ``DMD2Settings`` of its ``dmd2_*`` entries (the
    flags' defaults for the others), as ``--loss-type dmd2`` builds them."""
    from miles.backends.fsdp_utils.loss_hub.dmd2_types import DMD2Settings

    settings = {name.removeprefix("dmd2_"): value for name, value in values.items() if name.startswith("dmd2_")}
    if settings.get("gan_feature_blocks"):
        settings["gan_feature_blocks"] = tuple(settings["gan_feature_blocks"])
    return SimpleNamespace(**values, method_settings=DMD2Settings(**settings))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- hooks loaded by path in the Ray workers ------------------------------------------------------------------------
def echo_output(ctx, train_pairs):
    """Train-output hook: what this rank trained on and what it received from earlier groups."""
    return {
        "rollout_id": ctx.rollout_id,
        "dp_rank": ctx.dp_rank,
        "sample_indices": [pair.sample_index for pair in train_pairs],
        "external": ctx.external_data,
    }


def _record(ctx, train_pairs, name: str):
    record = {
        "group": name,
        "rollout_id": ctx.rollout_id,
        "dp_rank": ctx.dp_rank,
        "external": {role: value for role, value in ctx.external_data.items()},
    }
    with open(Path(ctx.args.output_dir) / "handoff.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return train_pairs


def record_input_first(ctx, train_pairs):
    """Train-input hook of the driver test's first group: log what it received."""
    return _record(ctx, train_pairs, "first")


def record_input_second(ctx, train_pairs):
    """Train-input hook of the driver test's second group: log what it received."""
    return _record(ctx, train_pairs, "second")


def dmd2_pairs_without_sample_99(args, samples):
    """Converter that breaks the equal-count rule: the DMD2 pairs, less the one of sample index 99 (if any)."""
    from miles.ray.data_conversion_hub.dmd2 import expand_samples_to_train_pairs

    return [pair for pair in expand_samples_to_train_pairs(args, samples) if pair.sample_index != 99]


def drop_pairs_on_rank1(ctx, train_pairs):
    """Train-input hook that breaks the equal-count rule: rank 1 loses a pair."""
    return train_pairs[:-1] if ctx.dp_rank == 1 else train_pairs


def failing_eval_hook(args, images, records, rollout_id):
    """``--eval-function-path`` hook that fails, as a user's broken evaluation would."""
    raise RuntimeError(f"eval hook failed after rollout {rollout_id}")


def list_eval_hook(args, images, records, rollout_id):
    """``--eval-function-path`` hook that returns its figures as a list instead of a dict."""
    return [0.5, 0.25]


def tensor_eval_hook(args, images, records, rollout_id):
    """``--eval-function-path`` hook whose figures are 0-d tensors and ints (both are numbers to the tracker)."""
    return {"mean": images.float().mean(), "count": len(records)}


# The figure scripted_eval_hook reports after each rollout: rollout 1 scores best (lowest), rollout 2 worse.
SCRIPTED_SCORES = {0: 3.0, 1: 1.0, 2: 2.0, 3: 4.0}


def scripted_eval_hook(args, images, records, rollout_id):
    """``--eval-function-path`` hook whose ``score`` is :data:`SCRIPTED_SCORES` of the rollout (``--keep-best``
    tests: which rollout is the best does not depend on what a tiny model draws)."""
    return {"score": SCRIPTED_SCORES[rollout_id], "images": len(images)}


@contextmanager
def single_process_group(backend: str = "gloo", device_type: str = "cpu"):
    """A 1-rank process group (gloo) and device mesh (``"cpu"``) in this process (FSDP2 and DCP need one)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh(device_type, (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def sharded_denoiser(family, pipeline: Path, mesh, trainable: bool = True, shard: bool = True, device="cpu"):
    """The pipeline's denoiser as the trainer loads it, wrapped in FSDP2 in the trainer's default layout: one unit
    (the root) whose parameters stay gathered after a forward until :func:`~miles.backends.fsdp_utils.model.reshard`
    (ZeRO-2-like, ``miles.backends.fsdp_utils.model``).

    The trainer leaves a 1-rank model unwrapped; ``shard=True`` (default) wraps it anyway, as every rank of a
    multi-rank group is, so the 1-rank tests exercise FSDP2 and DCP. ``shard=False`` gives the plain module of a
    DP-1 run."""
    from miles.backends.fsdp_utils.model import is_sharded, load_frozen_denoiser, load_trainable_denoiser, shard_model

    load = load_trainable_denoiser if trainable else load_frozen_denoiser
    model = load(family, str(pipeline), mesh, torch.device(device), torch.float32, reshard_after_forward=False)
    if shard and not is_sharded(model):
        shard_model(model, [], mesh, torch.float32 if trainable else None, reshard_after_forward=False)
    return model


def denoiser_loss(family, model, seed: int) -> torch.Tensor:
    """A real forward of ``model`` on seeded inputs: mean squared velocity, a scalar to backprop."""
    gen = make_generator("test_forward", seed)
    latents = torch.randn(2, 1, 8, 8, generator=gen)
    cond = {
        "encoder_hidden_states": torch.randn(2, TEXT_LEN, TEXT_DIM, generator=gen),
        "pooled_projections": torch.randn(2, TEXT_DIM, generator=gen),
    }
    timestep = torch.tensor([250.0, 750.0])
    return family.predict_velocity(model, latents, timestep, cond).pow(2).mean()
