"""The memory plan of DMD2 on the models people distill, at 1, 8 and 64 GPUs of 80 and 141 GB (docs/performance.md).

    python benchmarks/memory_plan.py                    # the markdown table of docs/performance.md (about a minute)
    python benchmarks/memory_plan.py --detail sd35_medium --gpus 8      # one setting's per-group breakdown

Each model's transformer is built on the meta device from its sourced config (``miles/models/configs/<name>.json``;
no weights, no GPU) and planned by :mod:`miles.driver.memory_plan` as ``--loss-type dmd2`` runs it: the student
(actor) group and the critic group with the teacher, bf16 compute with float32 master weights, 1024 px, micro-batch
1, ``--gradient-checkpointing``, teacher CFG (scoring runs the teacher on a doubled batch, which the inference
phase's gathered models do not depend on). Two weight settings:

* **full**: the student and the critic train every weight; the critic group also holds the teacher (bf16);
* **LoRA**: a student adapter of rank 64 and a critic adapter of rank 32 on one frozen bf16 base per group, the
  public dmdr setting for SD3.5-Large (vvvvvjdy/dmdr ``train_t2i/sd3/train_sd3_refl_deepspeed.py``: the critic's
  ``--lora-rank 32``, the generator's ``2 * lora_rank``), on miles' default target modules (attention and MLP
  projections, :data:`miles.models.lora.DEFAULT_LORA_TARGET_MODULES`; dmdr adapts the attention projections only).

Each row gives both sharding modes: miles' default (ZeRO-2-like: each model whole in bf16 through a phase) and
``--fsdp-reshard-every-microbatch`` (ZeRO-3 per block). A GPU fits a setting when the larger group's peak leaves
10% free (:data:`miles.driver.memory_plan.HEADROOM`). Not counted: the GAN head of phase 2 (small), the EMA
(``--ema`` adds it: 4 bytes per trainable parameter over the DP size), text encoders (use the prompt cache), the VAE.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from miles.driver.memory_plan import GIB, GroupSpec, LoraSpec, PlanSetting, fit_line, memory_table, plan_group
from miles.models import family_class

CONFIGS = Path(__file__).resolve().parents[1] / "miles" / "models" / "configs"
MODELS = {
    "sd35_medium": "SD3.5-Medium",
    "sd35_large": "SD3.5-Large",
    "flux1_dev": "FLUX.1-dev",
    "flux2_klein_4b": "FLUX.2-klein-4B",
    "qwen_image": "Qwen-Image",
}
# The model family of each config: it lays out the activations and says the tokens per sample.
FAMILIES = {"sd35_medium": "sd3", "sd35_large": "sd3", "flux1_dev": "flux", "flux2_klein_4b": "flux2",
            "qwen_image": "qwen_image"}  # fmt: skip
# Pixels per image-token side of every model of the table: the VAE's 8×, then a patch of 2 (SD3.5) or the 2×2 packing
# (FLUX.1, Qwen-Image) or patchify (FLUX.2) of the pipeline: 4096 tokens at 1024 px.
PIXELS_PER_TOKEN = 16
GPUS = (1, 8, 64)
GPU_GB = (80, 141)
# vvvvvjdy/dmdr: generator LoRA rank 2 × 32, critic ("guidance") rank 32
STUDENT_RANK, CRITIC_RANK = 64, 32


def load_config(name: str) -> dict:
    """``miles/models/configs/<name>.json`` (its ``_source`` list says where each value was read)."""
    path = CONFIGS / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no sourced config {path}; the table leaves {name} out")
    return json.loads(path.read_text())


def group_specs(config: dict, lora: bool, ema: bool) -> list[GroupSpec]:
    """DMD2's groups in training order: the critic (with the teacher), then the student."""
    return [
        GroupSpec("critic", config, teacher=config, lora=LoraSpec(CRITIC_RANK) if lora else None),
        GroupSpec("actor", config, lora=LoraSpec(STUDENT_RANK) if lora else None, ema=ema),
    ]


def setting(name: str, config: dict, gpus: int, resolution: int, zero3: bool) -> PlanSetting:
    """The plan's setting for model ``name`` at ``resolution`` × ``resolution`` pixels: its family's activation
    layout and the stock pipeline's text tokens (the family's), :data:`PIXELS_PER_TOKEN` per image-token side.

    Raises:
        ValueError: for a resolution that is not a whole number of tokens.
    """
    family = family_class(FAMILIES[name])(CONFIGS)
    if resolution % PIXELS_PER_TOKEN:
        raise ValueError(f"resolution {resolution} is not a multiple of {PIXELS_PER_TOKEN} pixels per token side")
    return PlanSetting(
        dp_size=gpus,
        compute_dtype=torch.bfloat16,
        image_tokens=(resolution // PIXELS_PER_TOKEN) ** 2,
        text_tokens=family.text_tokens(CONFIGS),
        gradient_checkpointing=True,
        reshard_every_microbatch=zero3,
        ranks_per_node=min(gpus, 8),  # nodes of 8 GPUs
        family=family,
    )


def _verdicts(plans) -> str:
    return " / ".join("yes" if all(plan.fits(gb * GIB) for plan in plans) else "no" for gb in GPU_GB)


def table(resolution: int, ema: bool) -> list[str]:
    """The markdown table: one row per model, GPU count and weight setting."""
    lines = [
        "| model | params | GPUs | weights | default: student / critic GiB | fits 80 / 141 GB "
        "| ZeRO-3: student / critic GiB | fits 80 / 141 GB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, label in MODELS.items():
        try:
            config = load_config(name)
        except FileNotFoundError as exc:
            print(f"memory_plan: {exc}", file=sys.stderr)
            continue
        for gpus in GPUS:
            for lora in (False, True):
                cells = []
                for zero3 in (False, True):
                    plans = {
                        spec.role: plan_group(spec, setting(name, config, gpus, resolution, zero3))
                        for spec in group_specs(config, lora, ema)
                    }
                    peaks = f"{plans['actor'].peak / GIB:.1f} / {plans['critic'].peak / GIB:.1f}"
                    cells += [peaks, _verdicts(plans.values())]
                params = plans["actor"].trainable_numel if not lora else plans["actor"].frozen_numel
                weights = f"LoRA r{STUDENT_RANK} + r{CRITIC_RANK}" if lora else "full"
                lines.append(f"| {label} | {params / 1e9:.2f}B | {gpus} | {weights} | " + " | ".join(cells) + " |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resolution", type=int, default=1024, help="Image side in pixels.")
    parser.add_argument("--ema", action="store_true", help="Add the student's EMA (--ema-decay).")
    parser.add_argument("--detail", choices=sorted(MODELS), default=None, help="One model's per-group breakdown.")
    parser.add_argument("--gpus", type=int, default=8, help="DP size of --detail.")
    parser.add_argument("--lora", action="store_true", help="--detail with the LoRA setting.")
    parser.add_argument("--zero3", action="store_true", help="--detail with --fsdp-reshard-every-microbatch.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.detail:
        config = load_config(args.detail)
        plan_setting = setting(args.detail, config, args.gpus, args.resolution, args.zero3)
        plans = [plan_group(spec, plan_setting) for spec in group_specs(config, args.lora, args.ema)]
        print("\n".join([*memory_table(plan_setting, plans), *(fit_line(plans, gb * GIB) for gb in GPU_GB)]))
        return 0
    print("\n".join(table(args.resolution, args.ema)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
