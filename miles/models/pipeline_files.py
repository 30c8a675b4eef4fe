"""The files of a diffusers pipeline directory that miles reads: ``model_index.json``, the component configs, the
scheduler config and the denoiser's safetensors headers.

A leaf of :mod:`miles.models`: it imports nothing of miles, so the families, the registry and the export's schedule
(:mod:`miles.models.sampling_schedule`) all read a pipeline through it without importing one another.
"""

import json
from pathlib import Path
from typing import Any

__all__ = [
    "DENOISER",
    "SECOND_EXPERT",
    "denoiser_weight_index",
    "is_component",
    "pipeline_class_name",
    "read_json",
    "read_model_index",
    "read_scheduler_config",
]

# The denoiser's component name: its folder in a diffusers pipeline directory, its key among a trainer group's
# trainable modules (TrainContext.models, PreparedBatch.component, checkpoints) and among the frozen teacher's.
DENOISER = "transformer"
# The low-noise expert of a two-expert pipeline (Wan 2.2 A14B's ``WanPipeline``): its folder and its component name.
SECOND_EXPERT = "transformer_2"


def read_json(path: str | Path, what: str) -> dict:
    """Read a JSON file of a pipeline directory; the error names the file and what it should hold.

    Raises:
        FileNotFoundError: if the file is missing.
        ValueError: if it is not valid JSON.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path} (is the pipeline directory complete?)")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} {path} is not valid JSON ({exc}); is the file truncated?") from exc


def read_model_index(path: str | Path) -> dict:
    """``<path>/model_index.json``. Raises as :func:`read_json`."""
    return read_json(Path(path) / "model_index.json", "pipeline model_index.json")


def is_component(entry: Any) -> bool:
    """Whether a ``model_index.json`` entry names a component that was saved (``["library", "Class"]``; a component
    saved as ``None`` is ``[null, null]``)."""
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None


def pipeline_class_name(path: str | Path) -> str | None:
    """The pipeline class ``<path>/model_index.json`` names (``_class_name``; the class of diffusers' custom-pipeline
    form ``["<module file>", "<class>"]``), None when it names none.

    Raises:
        FileNotFoundError: when ``model_index.json`` is missing.
        ValueError: when it is not a JSON object.
    """
    model_index = read_model_index(path)
    if not isinstance(model_index, dict):
        raise ValueError(
            f"{path}/model_index.json holds {type(model_index).__name__} {model_index!r:.40}, not a JSON object "
            "naming the pipeline's _class_name and components"
        )
    class_name = model_index.get("_class_name")
    if isinstance(class_name, list) and len(class_name) == 2:
        # diffusers' custom-pipeline form ["<module file in the directory>", "<class>"] (the digits exports).
        class_name = class_name[1]
    return class_name


def read_scheduler_config(path: str | Path) -> dict:
    """``{"shift": float, "num_train_timesteps": int}`` of ``<path>/scheduler/scheduler_config.json``; any
    flow-matching scheduler config of diffusers holds both."""
    config = read_json(Path(path) / "scheduler" / "scheduler_config.json", "scheduler config")
    return {
        "shift": float(config.get("shift", 1.0)),
        "num_train_timesteps": int(config.get("num_train_timesteps", 1000)),
    }


def denoiser_weight_index(files: list[Path]) -> dict[str, Path]:
    """``{tensor name: file}`` of safetensors ``files``, read from their headers only (no tensor data).

    Raises:
        ValueError: if two files hold a tensor of the same name.
    """
    from safetensors import safe_open

    index: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key in index:
                    raise ValueError(f"tensor {key!r} is in both {index[key]} and {file}")
                index[key] = Path(file)
    return index
