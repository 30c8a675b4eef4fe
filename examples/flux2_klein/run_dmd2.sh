#!/usr/bin/env bash
# DMD2 phase 2: distill FLUX.2-klein-base-4B into a 4-step student, full weights, on one node of 8 GPUs
# (docs/cluster.md, docs/families.md). No line of it has run on a GPU yet.
#
#   export MODEL_DIR=/models/FLUX.2-klein-base-4B PROMPTS=/data/prompts.jsonl IMAGES=/data/images
#   bash examples/flux2_klein/run_dmd2.sh prepare     # once: the prompt cache and the real images' latents
#   DRY_RUN=1 bash examples/flux2_klein/run_dmd2.sh   # check every input; print groups, time and memory plan
#   bash examples/flux2_klein/run_dmd2.sh             # train; a rerun resumes from $OUT/ckpt
#
# MODEL_DIR must be the undistilled klein *base*: a step-distilled klein ("is_distilled": true) takes no CFG, and
# preflight refuses --dmd2-teacher-guidance-scale above 1 for it.
#
# Memory (the planner, `python benchmarks/memory_plan.py --detail flux2_klein_4b --gpus 8 --ema`): full weights fit
# one node of 80 GB GPUs: 39.4 GiB peak per GPU (actor group, 1024 px, 3.88B trainable), so no LoRA.
#
# Choices and where they come from: FLUX.2-klein has no public DMD2 recipe (docs/families.md). 4 steps, K = 5,
# GAN weights 1e-2 / 5e-3, student lr 2e-6 and critic lr 8e-6 follow examples/sd35_medium/run_dmd2.sh (a model of
# similar size); teacher true CFG 4.0 against "" (the klein-base pipeline's default guidance scale); the flow shift
# is the family's e^mu at the sample size (the dry run says the value it took).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/common/dmd2_phase2.sh
source examples/common/dmd2_phase2.sh

FAMILY=flux2
MODEL_DIR=${MODEL_DIR:-/models/FLUX.2-klein-base-4B}
OUT=${OUT:-outputs/flux2_klein_dmd2}
NEGATIVE_PROMPT=""
SAMPLE_SIZE=${SAMPLE_SIZE-""}
RECIPE_FLAGS=(
  --num-rollout 3000 --rollout-batch-size 80 --n-samples-per-prompt 1 --micro-batch-size 1
  --diffusion-num-steps 4 --diffusion-step-rule dmd2
  --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale 4.0
  --dmd2-gan-disc-weight 1e-2 --dmd2-gan-gen-weight 5e-3
  --lr 2e-6 --critic-lr 8e-6
)
dmd2_recipe "$@"
