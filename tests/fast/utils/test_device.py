"""A worker's device: Ray's GPU id mapped through ``CUDA_VISIBLE_DEVICES`` in each of the three ways Ray hands GPUs out.

There is no GPU here: ``torch.cuda`` and ``ray.get_gpu_ids`` are mocked. They stand in for one 8-GPU node on which
each of 8 ranks (actors) is given one GPU by Ray, so every rank of the node must end on its own ``cuda:<i>``.
"""

import pytest
import ray
import torch

from miles.utils.device import cuda_index, worker_device

NODE_GPUS = 8


@pytest.fixture
def fake_node(monkeypatch):
    """A node with CUDA and Ray: set ``gpu_ids`` (what ``ray.get_gpu_ids`` answers) and ``count`` (the GPUs the
    process sees); ``current`` records ``torch.cuda.set_device``."""
    node = {"gpu_ids": [], "count": NODE_GPUS, "current": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: node["count"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: node["current"].append(index))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: list(node["gpu_ids"]))
    return node


def _rank_devices(node, monkeypatch, visible: str | None, ids_seen: list, count: int) -> list[torch.device]:
    """The device each rank of the node picks, rank r being given Ray's GPU ``ids_seen[r]``."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = []
    for gpu_id in ids_seen:
        if visible is not None:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible.format(id=gpu_id))
        node["gpu_ids"], node["count"] = [gpu_id], count
        devices.append(worker_device())
    return devices


def test_ray_narrows_the_visible_list_to_the_actors_gpu(fake_node, monkeypatch):
    # Ray's default: each actor sees only its GPU, as cuda:0; Ray's id is that one entry.
    devices = _rank_devices(fake_node, monkeypatch, "{id}", list(range(NODE_GPUS)), count=1)
    assert devices == [torch.device("cuda", 0)] * NODE_GPUS
    assert fake_node["current"] == [0] * NODE_GPUS


def test_not_narrowed_with_a_visible_list_maps_the_id_through_the_list(fake_node, monkeypatch):
    # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 on a node started with CUDA_VISIBLE_DEVICES=4,5,6,7,0,1,2,3: Ray's
    # ids are the list's entries (strings), torch numbers the devices by their position in it.
    visible = "4,5,6,7,0,1,2,3"
    devices = _rank_devices(fake_node, monkeypatch, visible, visible.split(","), count=NODE_GPUS)
    assert devices == [torch.device("cuda", i) for i in range(NODE_GPUS)]
    assert fake_node["current"] == list(range(NODE_GPUS))


def test_not_narrowed_and_unset_uses_the_id_as_the_index(fake_node, monkeypatch):
    # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 and the variable unset: every GPU is visible and Ray's id is the
    # device index. The base commit gave every rank cuda:0 here (NCCL then sees one GPU eight times).
    ids = [3, 0, 7, 1, 6, 2, 5, 4]
    devices = _rank_devices(fake_node, monkeypatch, None, ids, count=NODE_GPUS)
    assert devices == [torch.device("cuda", i) for i in ids]
    assert len(set(devices)) == NODE_GPUS


def test_an_id_the_process_cannot_see_is_a_clear_error(fake_node, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    fake_node["gpu_ids"], fake_node["count"] = ["5"], 2
    with pytest.raises(RuntimeError, match=r"Ray assigned GPU 5 .*\(CUDA_VISIBLE_DEVICES='0,1'\)"):
        worker_device()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match="GPU 9 .*unset, 8 GPUs"):
        cuda_index(9, None, NODE_GPUS)
    assert fake_node["current"] == []


def test_outside_ray_or_without_a_ray_gpu_it_is_the_first_visible_gpu(fake_node, monkeypatch):
    fake_node["gpu_ids"] = []
    assert worker_device() == torch.device("cuda", 0)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert worker_device() == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_device() == torch.device("cpu")
