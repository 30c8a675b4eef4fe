#!/usr/bin/env bash
# DMD2 phase 2: distill Wan 2.1 T2V 1.3B into a 4-step video student, full weights, on one node of 8 GPUs
# (docs/cluster.md, docs/families.md). No line of it has run on a GPU yet.
#
#   export MODEL_DIR=/models/Wan2.1-T2V-1.3B-Diffusers PROMPTS=/data/prompts.jsonl REAL=/data/real/prompts.jsonl
#   bash examples/wan/run_dmd2.sh prepare             # once: sample size and the prompt cache
#   DRY_RUN=1 bash examples/wan/run_dmd2.sh           # check every input; print groups and time estimate
#   bash examples/wan/run_dmd2.sh                     # train; a rerun resumes from $OUT/ckpt
#
# REAL is a JSONL of real video latent records, one {"prompt": caption, "latent": file} per clip, each file a
# .safetensors holding `latent`, the family's normalised (C, F, H, W) latent (`family.images_to_latents` of uint8
# (F, H, W, 3) frames; docs/families.md). After `prepare` (which records the clip size), write them from a folder
# of clips (.mp4 / .mkv / .webm / .mov, each with a <name>.txt caption; pip install 'miles[video]' for PyAV):
#   python -m miles.rollout.encode_images $MODEL_DIR /data/clips /data/real   # REAL=/data/real/data.jsonl
#
# Memory (the dry run's planner on the real 1.3B config, docs/cluster.md; an estimate, not a GPU measurement): full
# weights plan 21.6 GiB per GPU (critic group) at 33 x 480 x 832: they fit 80 GB. For Wan 2.1 14B start from
# examples/wan22_a14b/run_dmd2.sh (LoRA roles, --fsdp-reshard-every-microbatch).
#
# Choices and where they come from (docs/families.md): 4 steps at flow shift 5, teacher CFG 5.0, learning rates
# 1e-5: NVlabs/FastGen's Wan 2.1 T2V 1.3B DMD2 recipe; the negative prompt is empty (set NEGATIVE_PROMPT to the
# long one of diffusers' WanPipeline example if you prefer); 33 frames of 480 x 832 (the pipeline default is 81) to
# keep the first runs short; K = 5 critic steps and GAN weights 1e-2 / 5e-3 as the SD3.5 recipes; 40 prompts per
# rollout over 8 ranks = 5 pairs per rank, one per critic step.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/common/dmd2_phase2.sh
source examples/common/dmd2_phase2.sh

FAMILY=wan
MODEL_DIR=${MODEL_DIR:-/models/Wan2.1-T2V-1.3B-Diffusers}
OUT=${OUT:-outputs/wan_dmd2}
NEGATIVE_PROMPT=${NEGATIVE_PROMPT:-""}
SAMPLE_SIZE=${SAMPLE_SIZE-"33 480 832"}
REAL=${REAL:-/data/real/prompts.jsonl}
RECIPE_FLAGS=(
  --num-rollout 3000 --rollout-batch-size 40 --n-samples-per-prompt 1 --micro-batch-size 1
  --diffusion-num-steps 4 --diffusion-flow-shift 5.0 --diffusion-step-rule dmd2 --fsdp-flow-shift 5.0
  --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale 5.0
  --dmd2-gan-disc-weight 1e-2 --dmd2-gan-gen-weight 5e-3
  --lr 1e-5 --critic-lr 1e-5
)
dmd2_recipe "$@"
