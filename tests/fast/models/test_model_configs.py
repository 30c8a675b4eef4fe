"""The real transformer configs in miles/models/configs are well-formed diffusers configs with their sources.

The memory planner builds them on the meta device; here each file is checked without building it: the class is a
diffusers class, every key is an argument of its ``__init__``, the sources are addresses, and the shapes agree with
each other the way the pipelines need (rope axes summing to the head dim, ``in_channels`` = 2×2-packed VAE latent
channels). The values themselves come from the files named in ``_source``; docs/families.md lists the parameter
counts they give (a match for the published sizes).
"""

import inspect
import json
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[3] / "miles" / "models" / "configs"
NAMES = sorted(path.stem for path in CONFIGS.glob("*.json"))
# VAE latent channels per model (name prefix); FLUX.1, FLUX.2 and Qwen-Image take them packed 2×2 into tokens, SD3
# and Wan patch them in their own embedding layer
LATENT_CHANNELS = {"sd35": 16, "flux1": 16, "flux2": 32, "qwen": 16, "wan21": 16, "wan22_t2v": 16, "wan22_ti2v": 48}
PACKED = ("flux1", "flux2", "qwen")


def test_every_model_the_planner_needs_has_a_config():
    assert NAMES == [
        "flux1_dev",
        "flux1_schnell",
        "flux2_klein_4b",
        "qwen_image",
        "sd35_large",
        "sd35_medium",
        "wan21_t2v_14b",
        "wan21_t2v_1_3b",
        "wan22_t2v_a14b",
        "wan22_ti2v_5b",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_config_is_a_sourced_diffusers_config(name):
    import diffusers

    config = json.loads((CONFIGS / f"{name}.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    arguments = set(inspect.signature(cls.__init__).parameters)
    assert {key for key in config if not key.startswith("_")} <= arguments
    assert config["_source"] and all(source.startswith("https://") for source in config["_source"])
    if "axes_dims_rope" in config:
        assert sum(config["axes_dims_rope"]) == config["attention_head_dim"]
    family = next(prefix for prefix in LATENT_CHANNELS if name.startswith(prefix))
    assert config["in_channels"] == LATENT_CHANNELS[family] * (4 if family in PACKED else 1)
