"""Model families: how to load, condition and run one kind of diffusers pipeline.

``get_model_family(path)`` picks the family from the pipeline's ``model_index.json`` among the registered ones
(``--diffusion-model-family`` overrides it with a registered name or a dotted path to a family class; see
:mod:`miles.models.registry`). What a family must implement is :class:`ModelFamily`; what it may add is declared
with the protocols of :mod:`miles.models.capabilities`; a family over a stock diffusers pipeline subclasses
:class:`DiffusersFamily` and declares only what differs. Families are imported lazily so that ``python -m
miles.models.digits`` and light imports stay fast.
"""

from miles.models.base import DENOISER, ModelFamily, PromptEncoder
from miles.models.capabilities import (
    DifferentiablePixels,
    EmbeddedGuidance,
    ImageConditioned,
    MemoryLayout,
    PixelCodec,
    TokenFeatures,
    TrueCFG,
    require,
    supports,
)
from miles.models.diffusers_family import DiffusersFamily
from miles.models.registry import family_class, get_model_family, register_family, registered_families

__all__ = [
    "DENOISER",
    "DifferentiablePixels",
    "DiffusersFamily",
    "EmbeddedGuidance",
    "ImageConditioned",
    "MemoryLayout",
    "ModelFamily",
    "PixelCodec",
    "PromptEncoder",
    "TokenFeatures",
    "TrueCFG",
    "family_class",
    "get_model_family",
    "register_family",
    "registered_families",
    "require",
    "supports",
]
