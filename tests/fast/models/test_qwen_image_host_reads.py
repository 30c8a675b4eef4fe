"""A Qwen-Image forward reads the prompts' lengths from the host, never from the GPU.

The ``meta`` device stands in for the GPU: its tensors hold no values, so any host read of a value on it (``int``,
``bool``, ``.item()``) fails, where on CUDA it would wait for the GPU to finish its queue (a sync in every forward of
the sampler, which is what the base commit did twice per forward). The denoiser is a stand-in on ``meta`` that
records what it is called with.
"""

import torch
from torch import nn

from miles.models.qwen_image import QwenImageFamily

GPU = torch.device("meta")
# The forward reads no file of the pipeline: any path will do.
qwen_image_velocity = QwenImageFamily("unused").predict_velocity


class RecordingDenoiser(nn.Module):
    """Records its keyword arguments and returns zeros shaped like its packed input, on its own device."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, device=GPU))
        self.calls: list[dict] = []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return (torch.zeros_like(kwargs["hidden_states"]),)


def _cond(lengths: list[int], total: int = 12, width: int = 8) -> dict[str, torch.Tensor]:
    mask = torch.zeros(len(lengths), total)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1.0
    return {"encoder_hidden_states": torch.randn(len(lengths), total, width), "encoder_hidden_states_mask": mask}


def test_the_cut_and_the_mask_come_from_the_host_mask_without_reading_the_gpu():
    denoiser = RecordingDenoiser()
    latents = torch.zeros(2, 4, 4, 4, device=GPU)  # the sampler's latents live on the GPU
    v = qwen_image_velocity(denoiser, latents, torch.full((2,), 500.0), _cond([3, 5]))
    assert v.shape == (2, 4, 4, 4) and v.device == GPU
    (call,) = denoiser.calls
    # cut to the batch's longest prompt (5 of 12 positions); the shorter one is padded, so the mask goes along
    assert call["encoder_hidden_states"].shape == (2, 5, 8)
    mask = call["encoder_hidden_states_mask"]
    assert mask.device == GPU and mask.shape == (2, 5) and mask.dtype == torch.bool

    # Prompts of one length: no padding, no mask (the stock pipeline's fast path).
    qwen_image_velocity(denoiser, latents, torch.full((2,), 500.0), _cond([4, 4]))
    assert denoiser.calls[-1]["encoder_hidden_states_mask"] is None
    assert denoiser.calls[-1]["encoder_hidden_states"].shape == (2, 4, 8)
