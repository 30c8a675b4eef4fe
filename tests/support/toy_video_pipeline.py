"""A tiny random pipeline directory of the toy video family (:mod:`tests.support.toy_video_family`) and latent-file
records for it, written with ``save_pretrained`` (nothing is downloaded)."""

import json
from pathlib import Path

import torch

CLIP = {"frames": 2, "height": 8, "width": 8, "text_length": 8}
CHANNELS = 4
PROMPTS = ["a ball rolls left", "a ball rolls right", "rain falls", "a door opens"]


def write_toy_inputs(root: str | Path) -> Path:
    """Everything the toy run of docs/customization.md reads: ``root/pipeline`` (:func:`write_toy_video_pipeline`),
    ``root/prompts.jsonl`` (:data:`PROMPTS`) and ``root/real/real.jsonl`` (:func:`write_latent_records`)."""
    root = Path(root)
    write_toy_video_pipeline(root / "pipeline")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    write_latent_records(root / "real", PROMPTS)
    return root


def write_toy_video_pipeline(out_dir: Path, seed: int = 0) -> Path:
    """A 2-block ``WanTransformer3DModel`` (2 heads × 12, patch (1, 2, 2), text width 16) over (4, 2, 8, 8)
    latents, a flow-matching scheduler config with shift 3, and ``toy_video.json``. Returns ``out_dir``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # diffusers initialises weights from the global RNG: fork it, so the caller's stays untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=CHANNELS,
            out_channels=CHANNELS,
            text_dim=16,
            freq_dim=16,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=32,
        )
    transformer.save_pretrained(out_dir / "transformer")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(out_dir / "scheduler")
    model_index = {
        "_class_name": "ToyVideoPipeline",
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (out_dir / "model_index.json").write_text(json.dumps(model_index, indent=2) + "\n")
    (out_dir / "toy_video.json").write_text(json.dumps(CLIP, indent=2) + "\n")
    return out_dir


def write_latent_records(out_dir: Path, prompts: list[str], seed: int = 0) -> Path:
    """``out_dir/real.jsonl``: one record per prompt naming a ``.safetensors`` latent ``(4, 2, 8, 8)`` beside it:
    a smooth random clip in [-1, 1] whose second frame is the first shifted by one pixel (a toy "motion")."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    lines = []
    for index, prompt in enumerate(prompts):
        coarse = torch.rand(1, CHANNELS, 4, 4, generator=generator) * 2 - 1
        frame = torch.nn.functional.interpolate(coarse, size=(CLIP["height"], CLIP["width"]), mode="bilinear")[0]
        latent = torch.stack([frame, frame.roll(1, dims=-1)], dim=1).contiguous()  # (C, F, H, W)
        save_file({"latent": latent}, str(out_dir / f"real_{index}.safetensors"))
        lines.append(json.dumps({"prompt": prompt, "latent": f"real_{index}.safetensors"}))
    (out_dir / "real.jsonl").write_text("\n".join(lines) + "\n")
    return out_dir / "real.jsonl"
