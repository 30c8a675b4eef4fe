"""``clip_grad_norm_`` on FSDP2 gradients at 2 ranks (two processes over gloo, no Ray): the norm and the clipped
gradients are bit for bit those of torch's own route on the DTensors (``get_total_norm`` + ``full_tensor``, then
``clip_grads_with_norm_``), on the digits denoiser's real gradients, with and without a clip that engages."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles.backends.fsdp_utils.optimizer import clip_grad_norm_
from miles.models import get_model_family
from tests.support.trainer import denoiser_loss, free_port, make_pipeline, sharded_denoiser


def _grads(model) -> list:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _rank(rank: int, port: int, pipeline: str, failures) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        family = get_model_family(pipeline)
        models = [sharded_denoiser(family, pipeline, mesh) for _ in range(2)]
        for max_norm in (None, 1e-3):  # the digits gradient's norm is far above 1e-3: the clip engages
            for seed, model in enumerate(models):
                model.zero_grad()
                (denoiser_loss(family, model, seed=rank) * (seed + 1)).backward()
            # Both models hold the same gradients times 1 and 2; the second one's are halved back before comparing.
            reference, ours = models
            for g in _grads(ours):
                g.div_(2)
            expected = torch.nn.utils.get_total_norm(_grads(reference), norm_type=2.0, foreach=True).full_tensor()
            if max_norm:
                torch.nn.utils.clip_grads_with_norm_(list(reference.parameters()), max_norm, expected, foreach=True)
            norm = clip_grad_norm_(_grads(ours), max_norm)
            if not torch.equal(norm, expected) or expected <= 1e-3:
                failures.append(f"rank {rank} max_norm {max_norm}: {float(norm)!r} != {float(expected)!r}")
            for a, b in zip(_grads(reference), _grads(ours)):
                if not torch.equal(a.to_local(), b.to_local()):
                    failures.append(f"rank {rank} max_norm {max_norm}: a clipped gradient differs")
                    break
    finally:
        dist.destroy_process_group()


def test_the_local_shard_norm_and_clip_equal_torchs_dtensor_route_bit_for_bit(tmp_path):
    pipeline = str(make_pipeline(tmp_path / "digits"))
    failures = mp.Manager().list()
    mp.spawn(_rank, args=(free_port(), pipeline, failures), nprocs=2)
    assert list(failures) == []
