"""Which device a worker process computes on: the one place that decides it."""

import os

import torch

__all__ = ["DEFAULT_DEVICE", "PEAK_TFLOPS", "cuda_index", "worker_device"]

# Dense bf16 peak TFLOP/s by GPU name (vendor data sheets): the time estimate's (``--gpu-type``) and the GPU check's
# MFU denominator.
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}
# The GPU the time estimate assumes on a machine without a known one.
DEFAULT_DEVICE = "H100"


def _visible_devices() -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (indices or ``GPU-<uuid>``), or None when it is unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def cuda_index(gpu_id: str | int, visible: list[str] | None, device_count: int) -> int:
    """The CUDA device index (as torch numbers the devices this process sees) of the GPU Ray calls ``gpu_id``.

    Ray hands a GPU to an actor in one of three ways, and this maps all three:

    - it narrows ``CUDA_VISIBLE_DEVICES`` to the actor's GPU (the default): the id is the one visible entry, index 0;
    - it leaves the variable alone (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``) and the variable lists the
      node's GPUs: Ray's ids are then entries of that list (``ray.get_gpu_ids`` maps its slots through the list the
      worker started with), and the index is the entry's position;
    - it leaves it alone and the variable is unset: every GPU is visible and Ray's id is the device index itself.

    Args:
        gpu_id: one of ``ray.get_gpu_ids()``.
        visible: the entries of ``CUDA_VISIBLE_DEVICES``, or None when it is unset.
        device_count: ``torch.cuda.device_count()``.

    Returns:
        An index in ``[0, device_count)``.

    Raises:
        RuntimeError: if the id is not among the visible GPUs (the actor's GPU is hidden from its process), naming
            the id and ``CUDA_VISIBLE_DEVICES``.
    """
    gpu_id = str(gpu_id).strip()
    if visible is None:
        index = int(gpu_id) if gpu_id.isdigit() else -1
        where = f"CUDA_VISIBLE_DEVICES unset, {device_count} GPUs"
    else:
        index = visible.index(gpu_id) if gpu_id in visible else -1
        where = f"CUDA_VISIBLE_DEVICES={','.join(visible)!r}"
    if not 0 <= index < device_count:
        raise RuntimeError(
            f"Ray assigned GPU {gpu_id} to this process, but it is not among the GPUs the process sees ({where}); "
            "set CUDA_VISIBLE_DEVICES to include it, or leave it to Ray (unset RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)"
        )
    return index


def worker_device() -> torch.device:
    """The CUDA device Ray assigned to this process (made the current device), or the CPU on a machine without CUDA.

    The GPU is found by its Ray id through ``CUDA_VISIBLE_DEVICES`` (:func:`cuda_index`), whichever way Ray handed it
    out, so that no two ranks of a node pick the same GPU. Outside Ray, or in a process Ray gave no GPU (a test, a
    plain script), it is the first visible GPU.

    Raises:
        RuntimeError: if Ray's GPU is not visible to the process (:func:`cuda_index`).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    import ray

    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    index = cuda_index(gpu_ids[0], _visible_devices(), torch.cuda.device_count()) if gpu_ids else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
