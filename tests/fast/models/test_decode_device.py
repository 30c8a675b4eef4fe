"""Eval images are decoded on the worker's device, not on a CPU core, and come back as CPU uint8.

There is no GPU here. The ``meta`` device stands in for the worker's GPU (a device other than the CPU, on which
nothing is computed), and a spy VAE stands in for each family's VAE: it records where it is moved and the device of
the latents it decodes, and returns CPU zeros. On a GPU node this is a VAE decoding 1024 px eval images on the rank's
``cuda:<i>``; the base commit moved the latents to the CPU first in every family and decoded there (minutes a grid).
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from miles.models.capabilities import decode_latents, module_on
from miles.models.flux import FluxFamily
from miles.models.flux2 import Flux2Family
from miles.models.qwen_image import QwenImageFamily
from miles.models.sd3 import SD3Family
from miles.models.wan import WanFamily

GPU = torch.device("meta")  # the worker's GPU, see the module docstring
CHANNELS = 4


class DeviceSpyVAE(nn.Module):
    """A VAE that records the device it is moved to and the device of what it decodes; ``to`` gives its tensors
    that device without their values (meta holds none), and ``decode`` returns CPU zeros of the pixels' shape."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))  # loaded on the CPU, like every family's VAE
        self.bn = nn.BatchNorm2d(4 * CHANNELS)  # FLUX.2's latent statistics live in the VAE
        self.config = SimpleNamespace(
            scaling_factor=1.5,
            shift_factor=0.1,
            z_dim=CHANNELS,
            latents_mean=[0.0] * CHANNELS,
            latents_std=[1.0] * CHANNELS,
            batch_norm_eps=1e-4,
        )
        self.moves: list[torch.device] = []
        self.decoded_on: list[tuple[torch.device, torch.device]] = []

    def to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        self.moves.append(device)
        return self._apply(lambda tensor: torch.empty_like(tensor, device=device))

    def decode(self, z: torch.Tensor, return_dict: bool = False):
        self.decoded_on.append((z.device, self.weight.device))
        return (torch.zeros(z.shape[0], 3, *z.shape[2:]),)


# (family, latents of one sample): images (C, h, w), FLUX.2's patched (4C, h, w), Wan's video (C, F, h, w)
FAMILIES = {
    "sd3": (SD3Family, (CHANNELS, 4, 4)),
    "flux": (FluxFamily, (CHANNELS, 4, 4)),
    "qwen_image": (QwenImageFamily, (CHANNELS, 4, 4)),
    "wan": (WanFamily, (CHANNELS, 2, 4, 4)),
    "flux2": (Flux2Family, (4 * CHANNELS, 2, 2)),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_latents_decode_on_the_workers_device_and_the_vae_leaves_it_after(name):
    family_class, shape = FAMILIES[name]
    family = family_class("/no/pipeline")
    family._vae = spy = DeviceSpyVAE()
    latents = torch.randn(2, *shape)

    images = decode_latents(family, latents, GPU)

    assert spy.decoded_on == [(GPU, GPU)], "the VAE must decode on the worker's device"
    assert spy.moves == [GPU, torch.device("cpu")]  # there for the decode, home after it
    assert spy.weight.device.type == "cpu"
    assert images.device.type == "cpu" and images.dtype == torch.uint8
    # zeros decode to mid-grey, (0 + 1) / 2 · 255 rounded
    assert images.shape[0] == 2 and images.shape[-1] == 3 and bool((images == 128).all())


def test_latents_already_on_the_device_decode_there_without_a_move():
    family = SD3Family("/no/pipeline")
    family._vae = spy = DeviceSpyVAE()
    latents = torch.randn(2, CHANNELS, 4, 4)
    decode_latents(family, latents)  # no device: where the latents are (the CPU here)
    assert spy.decoded_on == [(torch.device("cpu"), torch.device("cpu"))]


def test_module_on_returns_a_module_to_its_device_even_after_an_error():
    module = DeviceSpyVAE()
    with pytest.raises(RuntimeError, match="decode failed"):
        with module_on(module, GPU):
            assert module.weight.device == GPU
            raise RuntimeError("decode failed")
    assert module.weight.device.type == "cpu" and module.moves == [GPU, torch.device("cpu")]
