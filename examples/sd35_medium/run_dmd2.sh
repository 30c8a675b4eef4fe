#!/usr/bin/env bash
# DMD2: distill Stable Diffusion 3.5 Medium into a 4-step student on one node of 8 GPUs.
#
#   MODEL_DIR=/models/stable-diffusion-3.5-medium PROMPTS=/data/prompts.jsonl bash examples/sd35_medium/run_dmd2.sh
#   DRY_RUN=1 bash examples/sd35_medium/run_dmd2.sh      # validate the flags and print groups/placement/schedule
#
# MODEL_DIR is a diffusers StableDiffusion3Pipeline directory (the checkpoint is gated: download it yourself).
# PROMPTS is a JSONL file with one {"prompt": "..."} per line.
#
# Choices and where they come from:
# - 4-step student on the shift-3 schedule (sigmas 1, 0.9, 0.75, 0.5), DMD2 re-noising sampler (Yin et al. 2024).
# - K = 5 critic updates per student update: DMD2's two-time-scale rule (tianweiy/DMD2 dfake_gen_update_ratio 5).
# - Student lr 2e-6, critic lr 8e-6: FastVideo's DMD2 recipe (generator vs fake-score learning rates).
# - Teacher CFG 4.5: SD3.5 Medium's recommended guidance scale; the critic scores unguided (tianweiy/DMD2).
# - Scoring noise levels within 2-98% of the 1000 train timesteps (tianweiy/DMD2 min_step/max_step).
# - 80 prompts per rollout over 8 ranks = 10 pairs per rank: the critic's 5 steps take 2 pairs each.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL_DIR=${MODEL_DIR:-/models/stable-diffusion-3.5-medium}
PROMPTS=${PROMPTS:-/data/prompts.jsonl}
OUT=${OUT:-outputs/sd35m_dmd2}

extra=()
if [ "${DRY_RUN:-0}" = "1" ]; then
  extra+=(--dry-run)
fi

python train_diffusion.py \
  --loss-type dmd2 \
  --hf-checkpoint "$MODEL_DIR" \
  --teacher-load "$MODEL_DIR" \
  --diffusion-model-family sd3 \
  --prompt-data "$PROMPTS" --input-key prompt \
  --actor-num-nodes 1 --actor-num-gpus-per-node 8 \
  --train-dtype bfloat16 \
  --num-rollout 3000 \
  --rollout-batch-size 80 --n-samples-per-prompt 1 --micro-batch-size 1 \
  --diffusion-num-steps 4 --diffusion-flow-shift 3.0 --diffusion-step-rule dmd2 \
  --fsdp-flow-shift 3.0 \
  --dmd2-critic-steps-per-rollout 5 \
  --dmd2-teacher-guidance-scale 4.5 \
  --dmd2-critic-scoring fused \
  --lr 2e-6 --critic-lr 8e-6 --clip-grad 1.0 \
  --save "$OUT/ckpt" --save-interval 250 --save-hf "$OUT/student" \
  --output-dir "$OUT/run" --eval-interval 250 --eval-n-samples-per-prompt 1 \
  --use-wandb --wandb-project miles-dmd2 \
  "${extra[@]}" "$@"
