"""The family registry and the capability protocols: look-up by name, by dotted path and by ``model_index.json``,
the one-line errors of a bad family, nominal capabilities, the two guidance forms, and the compatibility
signatures preflight compares."""

import ast
import json
from pathlib import Path

import pytest
import torch

from miles.models import (
    DENOISER,
    EmbeddedGuidance,
    ModelFamily,
    PixelCodec,
    TokenFeatures,
    TrueCFG,
    family_class,
    get_model_family,
    register_family,
    registered_families,
    supports,
)
from miles.models.capabilities import decode_latents
from miles.models.digits import DigitsFamily
from miles.models.registry import check_family_class, family_class_for_pipeline
from miles.models.sd3 import SD3Family
from miles.utils.sampling import guided_velocity
from tests.support.toy_video_family import ToyVideoFamily

REPO = Path(__file__).resolve().parents[3]
TOY = "tests.support.toy_video_family.ToyVideoFamily"


class _Stub(ModelFamily):
    """Every abstract method of ModelFamily, no guidance form yet."""

    name = "minimal_test"
    pipeline_classes = ("MinimalTestPipeline",)

    def load_denoiser(self, path, dtype=torch.float32):
        raise NotImplementedError

    def load_text_encoder(self, path, device="cpu", dtype=torch.float32):
        raise NotImplementedError

    def encode_prompts(self, encoder, prompts):
        raise NotImplementedError

    def latent_shape(self, path):
        return (2, 3, 4, 4)

    def predict_velocity(self, denoiser, latents, timestep, cond):
        raise NotImplementedError

    def blocks(self, denoiser):
        return []


class _Minimal(_Stub, TrueCFG):
    """A complete true-CFG family that loads nothing."""


def test_the_builtin_families_are_registered_with_their_pipeline_classes(tmp_path):
    families = registered_families()
    assert families["sd3"] is SD3Family and families["digits"] is DigitsFamily
    assert SD3Family.pipeline_classes == ("StableDiffusion3Pipeline",)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "DigitsPipeline"}))
    assert family_class_for_pipeline(tmp_path) is DigitsFamily
    assert get_model_family(tmp_path).pipeline_path == tmp_path
    # the flag wins over model_index.json, by name or by path
    assert type(get_model_family(tmp_path, "sd3")) is SD3Family
    assert type(get_model_family(tmp_path, TOY)) is ToyVideoFamily


def test_an_unknown_pipeline_class_names_the_registered_ones_and_the_flag(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideoPipeline"}))
    registered = (
        r"\['DigitsPipeline', .*'Flux2KleinPipeline', .*'FluxPipeline', .*'QwenImagePipeline', "
        r".*'StableDiffusion3Pipeline', .*'WanPipeline'\]"
    )
    with pytest.raises(ValueError, match=rf"'HunyuanVideoPipeline'.*{registered}"):
        get_model_family(tmp_path)
    with pytest.raises(ValueError, match="^--diffusion-model-family hunyuan is unknown; pass a registered name"):
        family_class("hunyuan")


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_pkg.family.Fam", "--diffusion-model-family 'no_such_pkg.family.Fam': cannot import module"),
        ("tests.support.toy_video_family.Nope", "has no attribute 'Nope'"),
        ("miles.models.base.DENOISER", "'DENOISER' is a str, not a callable"),
        ("tests.support.toy_video_family.ToyPromptEncoder", "not a subclass of miles.models.ModelFamily"),
    ],
)
def test_a_bad_dotted_path_is_one_line_naming_the_path(path, message):
    with pytest.raises(ValueError, match=message) as info:
        family_class(path)
    assert "\n" not in str(info.value) and path in str(info.value)


def test_an_incomplete_family_class_is_refused_with_what_it_lacks():
    class NoGuidance(ModelFamily):
        name, pipeline_classes = "x", ()

    class BothForms(_Minimal, EmbeddedGuidance):
        def guidance_cond(self, guidance_scale, batch):
            return {}

    class NoBlocks(ModelFamily, TrueCFG, TokenFeatures):
        name, pipeline_classes = "y", ()

    class BadName(_Minimal):
        name = "my.family"

    with pytest.raises(ValueError, match=r"declares the guidance forms \[\]"):
        check_family_class(NoGuidance, "w")
    with pytest.raises(ValueError, match=r"\['TrueCFG', 'EmbeddedGuidance'\]; subclass exactly one"):
        check_family_class(BothForms, "w")
    with pytest.raises(ValueError, match=r"does not implement \[.*'blocks'.*'image_tokens'.*'token_width'"):
        check_family_class(NoBlocks, "w")
    with pytest.raises(ValueError, match="name 'my.family'"):
        check_family_class(BadName, "w")
    assert check_family_class(_Minimal, "w") is _Minimal


def test_registration_refuses_a_taken_name_or_pipeline_class_and_accepts_a_reload():
    class Clash(_Minimal):
        name = "digits"

    class ClashPipeline(_Minimal):
        name = "clash_pipeline_test"
        pipeline_classes = ("DigitsPipeline",)

    with pytest.raises(ValueError, match="the name 'digits' is taken by miles.models.digits.DigitsFamily"):
        register_family(Clash)
    with pytest.raises(ValueError, match=r"pipeline classes \['DigitsPipeline'\] are read by"):
        register_family(ClashPipeline)
    assert register_family(DigitsFamily) is DigitsFamily  # the same class again (a module reload)
    assert "clash_pipeline_test" not in registered_families()


def test_capabilities_are_declared_not_guessed():
    assert supports(SD3Family, PixelCodec) and supports(DigitsFamily, TokenFeatures)
    assert supports(ToyVideoFamily, TokenFeatures) and not supports(ToyVideoFamily, PixelCodec)

    class HasTokensButSaysNothing(_Minimal):
        def image_tokens(self, block_output):
            return block_output

    assert not supports(HasTokensButSaysNothing("."), TokenFeatures)


def _predict(calls):
    def predict(latents, timestep, cond):
        calls.append({key: value.clone() for key, value in cond.items()})
        return latents * cond["scale"].view(-1, *([1] * (latents.ndim - 1))) + timestep.view(-1, 1, 1, 1, 1)

    return predict


def test_true_cfg_is_the_sampling_module_formula_and_embedded_guidance_is_one_forward_with_the_scale():
    latents, timestep = torch.randn(2, 2, 3, 4, 4), torch.tensor([500.0, 20.0])
    cond, neg = {"scale": torch.tensor([2.0, 3.0])}, {"scale": torch.tensor([0.5, 0.5])}
    calls = []
    cfg = _Minimal(".").guided_velocity(_predict(calls), latents, timestep, cond, neg, 4.0)
    assert torch.equal(cfg, guided_velocity(_predict([]), latents, timestep, cond, neg, 4.0))
    assert len(calls) == 1 and calls[0]["scale"].tolist() == [0.5, 0.5, 2.0, 3.0]  # one batched [uncond; cond]

    class Distilled(_Stub, EmbeddedGuidance):
        def guidance_cond(self, guidance_scale, batch):
            return {"guidance": torch.full((batch,), guidance_scale)}

    assert check_family_class(Distilled, "w") is Distilled
    calls = []
    v = Distilled(".").guided_velocity(_predict(calls), latents, timestep, cond, None, 4.0)
    assert len(calls) == 1 and calls[0]["guidance"].tolist() == [4.0, 4.0]  # no negative branch
    assert torch.equal(v, latents * cond["scale"].view(-1, 1, 1, 1, 1) + timestep.view(-1, 1, 1, 1, 1))


def test_the_compatibility_signatures_are_the_families_own(tmp_path):
    from tests.support.toy_video_pipeline import write_toy_video_pipeline
    from tests.support.trainer import make_pipeline

    digits = make_pipeline(tmp_path / "digits")
    signature = get_model_family(digits).compatibility_signature(digits)
    assert signature == {
        "latent channels (in_channels)": 1,
        "output channels (out_channels)": 1,
        "latent sample size (sample_size)": 8,
        "text-encoder width (joint_attention_dim)": 384,
        "pooled text width (pooled_projection_dim)": 384,
        "text token length (max_length)": 16,
    }
    toy = write_toy_video_pipeline(tmp_path / "toy")
    assert ToyVideoFamily(toy).compatibility_signature(toy) == {
        "latent shape": (4, 2, 8, 8),
        "text width (text_dim)": 16,
    }
    assert (toy / DENOISER / "config.json").is_file()


def test_decode_latents_uses_the_codec_or_draws_the_raw_latent():
    raw = torch.tensor([-1.0, 0.0, 1.0, 2.0]).view(1, 1, 1, 2, 2).expand(1, 4, 3, 2, 2)  # (B, C, F, H, W)
    pixels = decode_latents(_Minimal("."), raw)
    assert pixels.shape == (1, 3, 2, 2, 3) and pixels.dtype == torch.uint8  # (B, F, H, W, first 3 channels)
    assert pixels[0, 0, :, :, 0].flatten().tolist() == [0, 128, 255, 255]


def _top_level_imports(module: str) -> set[str]:
    """The modules ``module``'s body imports when it is imported (imports inside functions are lazy: left out)."""
    path = REPO / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_importing_the_models_package_imports_no_family_module_and_no_diffusers():
    # The import closure of miles.models within miles, read from the sources (no second interpreter to start).
    seen, todo = set(), ["miles.models"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += [name for name in _top_level_imports(module) if name.startswith("miles")]
    outside = {name for module in seen for name in _top_level_imports(module) if not name.startswith("miles")}
    assert not [name for name in outside if name.split(".")[0] == "diffusers"]
    assert {m for m in seen if m.startswith("miles.models")} == {
        "miles.models",
        "miles.models.base",
        "miles.models.capabilities",
        "miles.models.diffusers_family",
        "miles.models.memory",
        "miles.models.pipeline_files",
        "miles.models.precision",
        "miles.models.registry",
    }
