"""Model families by name, by dotted path, or by a pipeline's ``model_index.json``.

``--diffusion-model-family`` takes a registered name (``sd3``, ``digits``) or a dotted path to a family class
(``my_pkg.family.MyFamily``, imported like the hooks, in every process that needs it). Without the flag, a pipeline
directory's ``model_index.json`` ``_class_name`` picks the registered family that lists it in its
``pipeline_classes``. A family registers itself with the :func:`register_family` class decorator; the built-in
families' modules are imported on the first look-up (they import no diffusers model at import time), so ``import
miles.models`` stays light.

The shape of torchtitan's ``register_train_spec`` (one record per model, found by name); the check that a class is
a complete family runs once per class, so a bad one fails with one line before Ray starts.
"""

import importlib
from pathlib import Path
from typing import Any

from miles.models.base import ModelFamily
from miles.models.capabilities import GUIDANCE_FORMS
from miles.models.pipeline_files import pipeline_class_name
from miles.utils.misc import load_function

__all__ = [
    "BUILTIN_FAMILY_MODULES",
    "check_family_class",
    "family_class",
    "family_class_for_pipeline",
    "get_model_family",
    "pipeline_class_name",
    "register_family",
    "registered_families",
]

# Imported on the first look-up; each registers its families.
BUILTIN_FAMILY_MODULES = (
    "miles.models.sd3",
    "miles.models.digits",
    "miles.models.qwen_image",
    "miles.models.qwen_image_edit",
    "miles.models.flux",
    "miles.models.flux2",
    "miles.models.wan",
)

_FAMILIES: dict[str, type] = {}


def _origin(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_family_class(cls: Any, where: str) -> type:
    """Return ``cls`` if it is a complete model family class.

    A family class subclasses :class:`~miles.models.base.ModelFamily` and exactly one guidance form of
    :data:`~miles.models.capabilities.GUIDANCE_FORMS`, implements every abstract method of the protocols it
    subclasses, and sets ``name`` (an identifier) and ``pipeline_classes`` (a tuple of ``_class_name`` strings).

    Args:
        where: names the class in the error, e.g. ``"--diffusion-model-family my_pkg.family.MyFamily"``.

    Raises:
        ValueError: one line starting with ``where`` that says what is missing.
    """
    if not isinstance(cls, type) or ModelFamily not in cls.__mro__:
        raise ValueError(
            f"{where} is {cls!r}, not a subclass of miles.models.ModelFamily; a family class subclasses ModelFamily "
            "and the capability protocols it implements (miles.models.capabilities)"
        )
    forms = [form.__name__ for form in GUIDANCE_FORMS if form in cls.__mro__]
    if len(forms) != 1:
        raise ValueError(
            f"{where} declares the guidance forms {forms}; subclass exactly one of "
            f"{[form.__name__ for form in GUIDANCE_FORMS]} (miles.models.capabilities)"
        )
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise ValueError(f"{where} does not implement {missing}, which the protocols it subclasses require")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{where} has name {name!r}; a family's name is an identifier such as 'sd3'")
    classes = getattr(cls, "pipeline_classes", None)
    if not isinstance(classes, tuple) or not all(isinstance(each, str) for each in classes):
        raise ValueError(
            f"{where} has pipeline_classes {classes!r}; expected a tuple of model_index.json _class_name strings"
        )
    return cls


def register_family(cls: type) -> type:
    """Class decorator: register a family under ``cls.name`` and its ``pipeline_classes``.

    Registering a class again from the same module (a reload) replaces it.

    Raises:
        ValueError: if the class is incomplete (:func:`check_family_class`), or another family already holds its
            name or one of its pipeline classes.
    """
    check_family_class(cls, f"model family {_origin(cls)}")
    for other in _FAMILIES.values():
        if _origin(other) == _origin(cls):
            continue
        if other.name == cls.name:
            raise ValueError(f"model family {_origin(cls)}: the name {cls.name!r} is taken by {_origin(other)}")
        shared = set(other.pipeline_classes) & set(cls.pipeline_classes)
        if shared:
            raise ValueError(
                f"model family {_origin(cls)}: pipeline classes {sorted(shared)} are read by {_origin(other)}"
            )
    _FAMILIES.pop(next((key for key, value in _FAMILIES.items() if _origin(value) == _origin(cls)), None), None)
    _FAMILIES[cls.name] = cls
    return cls


def registered_families() -> dict[str, type]:
    """``{name: family class}`` of every registered family, the built-in ones imported first."""
    for module in BUILTIN_FAMILY_MODULES:
        importlib.import_module(module)
    return dict(_FAMILIES)


def family_class(name: str) -> type:
    """The family class of ``--diffusion-model-family name``: a registered name, or a dotted path to a class.

    Raises:
        ValueError: one line naming the flag and the value: an unknown name, or a path that does not import or
            does not name a complete family class.
    """
    where = f"--diffusion-model-family {name}"
    if "." in name:
        return check_family_class(load_function(name, what="--diffusion-model-family"), where)
    families = registered_families()
    if name not in families:
        raise ValueError(
            f"{where} is unknown; pass a registered name ({', '.join(sorted(families))}) or a dotted path to a "
            "family class ('my_pkg.family.MyFamily')"
        )
    return families[name]


def family_class_for_pipeline(path: str | Path) -> type:
    """The registered family whose ``pipeline_classes`` hold the ``_class_name`` of ``<path>/model_index.json``.

    Raises:
        FileNotFoundError: when ``model_index.json`` is missing.
        ValueError: when ``model_index.json`` is not a JSON object, or no registered family reads that pipeline
            class.
    """
    class_name = pipeline_class_name(path)
    families = registered_families()
    for cls in families.values():
        if class_name in cls.pipeline_classes:
            return cls
    known = sorted(each for cls in families.values() for each in cls.pipeline_classes)
    raise ValueError(
        f"{path}/model_index.json has _class_name {class_name!r}; the registered families read {known} (or pass "
        f"--diffusion-model-family a registered name ({', '.join(sorted(families))}) or a dotted path to a family "
        "class)"
    )


def get_model_family(path: str | Path, override: str | None = None) -> ModelFamily:
    """The family instance for the pipeline directory ``path``.

    Args:
        path: a diffusers pipeline directory (``--hf-checkpoint``).
        override: ``--diffusion-model-family`` (a registered name or a dotted path); None reads
            ``model_index.json``.

    Raises:
        ValueError: on an unknown or broken override, a ``model_index.json`` that is not a JSON object, or an
            unregistered ``_class_name``.
        FileNotFoundError: when ``path/model_index.json`` is missing and no override is given.
    """
    cls = family_class(override) if override else family_class_for_pipeline(path)
    return cls(path)
