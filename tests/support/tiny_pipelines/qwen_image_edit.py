"""A tiny random ``QwenImageEditPipeline`` (Qwen-Image-Edit's layout, nothing downloaded): the tiny Qwen-Image
pipeline's transformer, VAE, text encoder and tokenizer (:mod:`tests.support.tiny_pipelines.qwen_image`; the real
Qwen/Qwen-Image-Edit shares Qwen-Image's architecture) under the edit pipeline class.

Saved without its ``processor``: transformers' ``Qwen2VLProcessor`` builds a ``Qwen2VLVideoProcessor`` beside the
image processor, which imports torchvision, and the offline test machines have none. The ``qwen_image_edit`` family
then encodes prompts without the reference's vision tokens (text only, as ``QwenImagePipeline``); the reference's
VAE latents, which join the transformer's sequence, are built as the stock pipeline builds them.
"""

from pathlib import Path

from tests.support.tiny_pipelines.common import write_pipeline
from tests.support.tiny_pipelines.qwen_image import write_tiny_qwen_image

__all__ = ["write_tiny_qwen_image_edit"]


def write_tiny_qwen_image_edit(folder: str | Path, seed: int = 0, plus: bool = False) -> Path:
    """Write a tiny random ``QwenImageEditPipeline`` directory (no processor) to ``folder``.

    Args:
        plus: write a ``QwenImageEditPlusPipeline`` instead (Qwen-Image-Edit-2509 / 2511: the same components).

    Returns:
        ``folder`` as a ``Path``; ``QwenImageEditPipeline.from_pretrained(folder, processor=None)`` (or the Plus
        class) opens it offline.
    """
    import tempfile

    import diffusers
    from diffusers import QwenImagePipeline

    pipeline_class = getattr(diffusers, "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline")

    with tempfile.TemporaryDirectory() as scratch:
        base = QwenImagePipeline.from_pretrained(write_tiny_qwen_image(Path(scratch) / "qwen_image", seed))
        pipe = pipeline_class(
            scheduler=base.scheduler,
            vae=base.vae,
            text_encoder=base.text_encoder,
            tokenizer=base.tokenizer,
            processor=None,
            transformer=base.transformer,
        )
        return write_pipeline(pipe, folder)
