"""Tiny random-weight stock diffusers pipelines of the families miles is adding (Qwen-Image, FLUX.1-dev / schnell,
FLUX.2-klein, Wan 2.x T2V), written offline for the family tests.

Each ``write_tiny_*(folder, seed)`` writes a complete pipeline directory (``model_index.json``, the transformer, the
VAE, the text encoders, tokenizers trained with the ``tokenizers`` library, the scheduler config) in a second or
so: the stock ``XxxPipeline.from_pretrained(folder)`` opens it with ``HF_HUB_OFFLINE=1``. The component sizes are
tiny, the layouts real: latent channels packed 2×2 into the transformer's ``in_channels``, rope axes summing to the
head dim, the VAE's spatial factor 8 (and Wan's temporal factor 4), the real scheduler settings. docs/families.md
describes what each pipeline does with them.
"""

from tests.support.tiny_pipelines.flux import write_tiny_flux
from tests.support.tiny_pipelines.flux2 import write_tiny_flux2_klein
from tests.support.tiny_pipelines.qwen_image import write_tiny_qwen_image
from tests.support.tiny_pipelines.qwen_image_edit import write_tiny_qwen_image_edit
from tests.support.tiny_pipelines.wan import write_tiny_wan

__all__ = [
    "write_tiny_flux",
    "write_tiny_flux2_klein",
    "write_tiny_qwen_image",
    "write_tiny_qwen_image_edit",
    "write_tiny_wan",
]
