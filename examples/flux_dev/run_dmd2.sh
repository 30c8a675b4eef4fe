#!/usr/bin/env bash
# DMD2 phase 2: distill FLUX.1-dev (12B, guidance-distilled) into a 4-step student at 512 px, LoRA student and
# critic on one node of 8 GPUs (docs/cluster.md, docs/families.md). No line of it has run on a GPU yet.
#
#   export MODEL_DIR=/models/FLUX.1-dev PROMPTS=/data/prompts.jsonl IMAGES=/data/images
#   bash examples/flux_dev/run_dmd2.sh prepare        # once: sample size, prompt cache, real images' latents
#   DRY_RUN=1 bash examples/flux_dev/run_dmd2.sh      # check every input; print groups, time and memory plan
#   bash examples/flux_dev/run_dmd2.sh                # train; a rerun resumes from $OUT/ckpt
#
# Memory (the planner, `python benchmarks/memory_plan.py --detail flux1_dev --gpus 8 --lora --ema --resolution
# 512`): full weights need 113.1 / 115.8 GiB per GPU at 1024 px in the default sharding mode, so this recipe trains
# LoRA adapters: 27.8 GiB peak per GPU (actor group: the 11.9B base gathered in bf16, 217M adapter parameters).
#
# Choices and where they come from (docs/families.md):
# - FLUX.1-dev is guidance-distilled: --dmd2-teacher-guidance-scale 3.5 is the teacher's `guidance` input (one
#   forward, no negative branch, so no sample carries a negative cond; the family declares embedded guidance; 3.5 is
#   also its default, FluxPipeline's guidance_scale); the student and critic run at guidance 1.
# - 4 steps at 512 px, learning rates 1e-5, student GAN weight 0.03: NVlabs/FastGen's FLUX.1-dev DMD2 recipe.
# - The flow shift is the family's: e^mu of the stock dynamic shift at the sample size (1.88 at 512 px).
# - Student LoRA rank 64, critic rank 32: the public dmdr ranks, untuned for FLUX.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/common/dmd2_phase2.sh
source examples/common/dmd2_phase2.sh

FAMILY=flux
MODEL_DIR=${MODEL_DIR:-/models/FLUX.1-dev}
OUT=${OUT:-outputs/flux_dev_dmd2}
NEGATIVE_PROMPT=""
SAMPLE_SIZE=${SAMPLE_SIZE-"512 512"}
RECIPE_FLAGS=(
  --num-rollout 3000 --rollout-batch-size 80 --n-samples-per-prompt 1 --micro-batch-size 1
  --diffusion-num-steps 4 --diffusion-step-rule dmd2
  --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale 3.5
  --dmd2-gan-disc-weight 1e-2 --dmd2-gan-gen-weight 3e-2
  --lora-rank 64 --critic-lora-rank 32 --save-hf-lora
  --lr 1e-5 --critic-lr 1e-5
)
dmd2_recipe "$@"
