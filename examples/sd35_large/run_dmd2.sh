#!/usr/bin/env bash
# DMD2 phase 2: distill Stable Diffusion 3.5 Large into a 4-step student, LoRA student and critic on one node of
# 8 GPUs (docs/cluster.md). No line of it has run on a GPU yet.
#
#   export MODEL_DIR=/models/stable-diffusion-3.5-large PROMPTS=/data/prompts.jsonl IMAGES=/data/images
#   bash examples/sd35_large/run_dmd2.sh prepare      # once: the prompt cache and the real images' latents
#   DRY_RUN=1 bash examples/sd35_large/run_dmd2.sh    # check every input; print groups, time and memory plan
#   bash examples/sd35_large/run_dmd2.sh              # train; a rerun resumes from $OUT/ckpt
#
# Memory (the planner, `python benchmarks/memory_plan.py --detail sd35_large --gpus 8 --lora --ema`): full weights
# need 76.6 / 78.7 GiB per GPU (student / critic group) in the default sharding mode, over an 80 GB GPU's 72 GiB
# budget, so this recipe trains LoRA adapters: 20.4 GiB peak per GPU (actor group, 1024 px, 8.06B frozen base in
# bf16, 211M adapter parameters). With 141 GB GPUs, or --fsdp-reshard-every-microbatch (18.9 / 20.9 GiB), full
# weights fit too: drop the --lora-* flags.
#
# Choices and where they come from:
# - Student LoRA rank 64, critic LoRA rank 32, both on the teacher's weights: vvvvvjdy/dmdr's SD3.5-Large setting
#   (train_t2i/sd3/train_sd3_refl_deepspeed.py); miles adapts the attention and MLP projections by default.
# - 4 steps on the shift-3 grid, K = 5 critic steps, teacher CFG 3.5 (SD3.5-Large's recommended scale), scoring
#   within 2-98% of the timesteps, GAN weights 1e-2 / 5e-3: as examples/sd35_medium/run_dmd2.sh.
# - Learning rates 1e-5 (student) and 4e-5 (critic): LoRA adapters take larger steps than full weights; the 1:4
#   ratio is the medium recipe's (FastVideo), the scale untuned.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/common/dmd2_phase2.sh
source examples/common/dmd2_phase2.sh

FAMILY=sd3
MODEL_DIR=${MODEL_DIR:-/models/stable-diffusion-3.5-large}
OUT=${OUT:-outputs/sd35l_dmd2}
NEGATIVE_PROMPT=""
SAMPLE_SIZE=${SAMPLE_SIZE-""}
RECIPE_FLAGS=(
  --num-rollout 3000 --rollout-batch-size 80 --n-samples-per-prompt 1 --micro-batch-size 1
  --diffusion-num-steps 4 --diffusion-flow-shift 3.0 --diffusion-step-rule dmd2 --fsdp-flow-shift 3.0
  --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale 3.5
  --dmd2-gan-disc-weight 1e-2 --dmd2-gan-gen-weight 5e-3
  --lora-rank 64 --critic-lora-rank 32 --save-hf-lora
  --lr 1e-5 --critic-lr 4e-5
)
dmd2_recipe "$@"
