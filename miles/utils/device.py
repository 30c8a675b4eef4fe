"""Which device a worker process computes on: the one place that decides it."""

import os

import torch

__all__ = ["worker_device"]


def worker_device() -> torch.device:
    """The CUDA device Ray assigned to this process (made the current device), or the CPU on a machine without CUDA.

    Ray narrows ``CUDA_VISIBLE_DEVICES`` to an actor's GPUs unless told not to; when it did not, the actor's GPU is
    found among the visible ones by its Ray id. Outside Ray (a test, a plain script) it is the first visible GPU.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    import ray

    index = 0
    gpu_ids = [str(i) for i in ray.get_gpu_ids()] if ray.is_initialized() else []
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if gpu_ids and gpu_ids[0] in visible:
        index = visible.index(gpu_ids[0])
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
