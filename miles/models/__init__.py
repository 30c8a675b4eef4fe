"""Model families: how to load, condition and run one kind of diffusers pipeline.

``get_model_family(path)`` picks the family from the pipeline's ``model_index.json`` (``--diffusion-model-family``
overrides it). Families are imported lazily so that ``python -m miles.models.digits`` and light imports stay fast.
"""

from pathlib import Path

from miles.models.base import ModelFamily, PromptEncoder, read_json

__all__ = ["ModelFamily", "PromptEncoder", "FAMILIES", "get_model_family"]

# model_index.json "_class_name" → family name
PIPELINE_CLASSES = {"StableDiffusion3Pipeline": "sd3", "DigitsPipeline": "digits"}
FAMILIES = ("sd3", "digits")


def get_model_family(path: str | Path, override: str | None = None) -> ModelFamily:
    """Return the family instance for the pipeline directory ``path``.

    Args:
        path: a diffusers pipeline directory (``--hf-checkpoint``).
        override: ``"sd3"`` or ``"digits"`` (``--diffusion-model-family``); None reads ``model_index.json``.

    Raises:
        ValueError: on an unknown override, a ``model_index.json`` that is not a JSON object, or an unsupported
            ``_class_name``.
        FileNotFoundError: when ``path/model_index.json`` is missing and no override is given.
    """
    name = override
    if name is None:
        model_index = read_json(Path(path) / "model_index.json", "pipeline model_index.json")
        if not isinstance(model_index, dict):
            raise ValueError(
                f"{path}/model_index.json holds {type(model_index).__name__} {model_index!r:.40}, not a JSON object "
                "naming the pipeline's _class_name and components"
            )
        class_name = model_index.get("_class_name")
        if isinstance(class_name, list) and len(class_name) == 2:
            # diffusers' custom-pipeline form ["<module file in the directory>", "<class>"] (the digits exports).
            class_name = class_name[1]
        name = PIPELINE_CLASSES.get(class_name) if isinstance(class_name, str) else None
        if name is None:
            raise ValueError(
                f"{path}/model_index.json has _class_name {class_name!r}; supported pipelines are "
                f"{sorted(PIPELINE_CLASSES)} (or pass --diffusion-model-family {{{','.join(FAMILIES)}}})"
            )
    if name == "sd3":
        from miles.models.sd3 import SD3Family

        return SD3Family(path)
    if name == "digits":
        from miles.models.digits import DigitsFamily

        return DigitsFamily(path)
    raise ValueError(f"--diffusion-model-family {name!r} is unknown; choose one of {list(FAMILIES)}")
