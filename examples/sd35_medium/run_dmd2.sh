#!/usr/bin/env bash
# DMD2 phase 2: distill Stable Diffusion 3.5 Medium into a 4-step student with the GAN head and an EMA, on one node
# of 8 GPUs or several (docs/cluster.md). No line of it has run on a GPU yet: read docs/cluster.md first.
#
#   export MODEL_DIR=/models/stable-diffusion-3.5-medium PROMPTS=/data/prompts.jsonl IMAGES=/data/images
#   bash examples/sd35_medium/run_dmd2.sh prepare      # once: the prompt cache and the real images' latents
#   DRY_RUN=1 bash examples/sd35_medium/run_dmd2.sh    # check every input; print groups, work and time estimate
#   bash examples/sd35_medium/run_dmd2.sh              # train (extra flags are passed on, e.g. --ray-address);
#                                                      # rerun, it resumes from $OUT/ckpt's newest commit
#
# MODEL_DIR  a diffusers StableDiffusion3Pipeline directory (the checkpoint is gated: download it yourself).
# PROMPTS    JSONL, one {"prompt": "..."} per line: the student's training prompts.
# IMAGES     a folder of real images (.png/.jpg/.webp, at least 1024 px on the short side) for the GAN head, each
#            captioned by a sidecar <name>.txt, or by CAPTIONS=<JSONL of {"file_name", "prompt"}>.
# DATA       where `prepare` writes (default $OUT/data); OUT the run's outputs (default outputs/sd35m_dmd2).
# NODES      nodes of GPUS_PER_NODE GPUs each (default 1 x 8); several nodes join one Ray cluster (--ray-address).
# DEVICE     where `prepare` runs the text encoders (default cuda; cpu works, slowly). The VAE encodes on the CPU.
# WANDB_MODE offline (default; `wandb sync` later) or online (after `wandb login`): the run's wandb mode.
#
# Choices and where they come from:
# - 4-step student on the shift-3 schedule (sigmas 1, 0.9, 0.75, 0.5), DMD2 re-noising sampler (Yin et al. 2024).
# - K = 5 critic updates per student update: DMD2's two-time-scale rule (tianweiy/DMD2 dfake_gen_update_ratio 5).
# - Student lr 2e-6, critic lr 8e-6: FastVideo's DMD2 recipe (generator vs fake-score learning rates).
# - Teacher CFG 4.5: SD3.5 Medium's recommended guidance scale; the critic scores unguided (tianweiy/DMD2).
# - Scoring noise levels within 2-98% of the 1000 train timesteps (tianweiy/DMD2 min_step/max_step).
# - Phase 2: GAN head on the critic, disc weight 1e-2 and student weight 5e-3 (tianweiy/DMD2's SDXL values,
#   docs/dmd2.md), trained against the real images' VAE latents; an EMA of the student at 0.99 (the digits recipe's
#   value, untuned at this scale) for the evaluation and the export.
# - Prompts encoded once by `prepare` (no T5 on the training GPUs); the eval draws 64 of them every 250 rollouts.
# - 80 prompts per rollout over 8 ranks = 10 pairs per rank: the critic's 5 steps take 2 pairs each.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL_DIR=${MODEL_DIR:-/models/stable-diffusion-3.5-medium}
PROMPTS=${PROMPTS:-/data/prompts.jsonl}
IMAGES=${IMAGES:-/data/images}
OUT=${OUT:-outputs/sd35m_dmd2}
DATA=${DATA:-$OUT/data}
NODES=${NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DEVICE=${DEVICE:-cuda}
WANDB_MODE=${WANDB_MODE:-offline}

if [ "${1:-}" = "prepare" ]; then
  shift
  # The training prompts and the negative prompt, encoded once: the training ranks read each prompt's cond from disk.
  python -m miles.rollout.prompt_cache "$MODEL_DIR" "$PROMPTS" "$DATA/prompts" \
    --negative-prompt "" --device "$DEVICE" --dtype bfloat16 "$@"
  # The real images as VAE latents, then their captions encoded into the same folder (data.jsonl -> prompts.jsonl
  # with both the latent and the cond of each record).
  python -m miles.rollout.encode_images "$MODEL_DIR" "$IMAGES" "$DATA/real" ${CAPTIONS:+--captions "$CAPTIONS"}
  python -m miles.rollout.prompt_cache "$MODEL_DIR" "$DATA/real/data.jsonl" "$DATA/real" \
    --negative-prompt "" --device "$DEVICE" --dtype bfloat16
  echo "prepared $DATA; next: DRY_RUN=1 bash $0"
  exit 0
fi

extra=()
if [ "${DRY_RUN:-0}" = "1" ]; then
  extra+=(--dry-run)
fi
# A rerun (a requeued Slurm job, a crash) continues from the newest commit instead of refusing the used --save.
if [ -f "$OUT/ckpt/latest" ]; then
  echo "resuming from $OUT/ckpt (rollout $(cat "$OUT/ckpt/latest") committed)" >&2
  extra+=(--load "$OUT/ckpt")
fi

python train_diffusion.py \
  --loss-type dmd2 \
  --hf-checkpoint "$MODEL_DIR" \
  --teacher-load "$MODEL_DIR" \
  --diffusion-model-family sd3 \
  --prompt-data "$DATA/prompts/prompts.jsonl" --input-key prompt \
  --negative-cond "$DATA/prompts/negative.safetensors" \
  --actor-num-nodes "$NODES" --actor-num-gpus-per-node "$GPUS_PER_NODE" \
  --train-dtype bfloat16 \
  --num-rollout 3000 \
  --rollout-batch-size 80 --n-samples-per-prompt 1 --micro-batch-size 1 \
  --diffusion-num-steps 4 --diffusion-flow-shift 3.0 --diffusion-step-rule dmd2 \
  --fsdp-flow-shift 3.0 \
  --dmd2-critic-steps-per-rollout 5 \
  --dmd2-teacher-guidance-scale 4.5 \
  --dmd2-critic-scoring fused \
  --dmd2-gan-disc-weight 1e-2 --dmd2-gan-gen-weight 5e-3 \
  --dmd2-gan-real-data "$DATA/real/prompts.jsonl" \
  --ema-decay 0.99 \
  --lr 2e-6 --critic-lr 8e-6 --clip-grad 1.0 \
  --save "$OUT/ckpt" --save-interval 250 --save-keep-last 2 --save-keep-every 1000 --save-hf "$OUT/student" \
  --output-dir "$OUT/run" --eval-interval 250 --eval-max-prompts 64 --eval-n-samples-per-prompt 1 \
  --eval-prompt-data "$DATA/prompts/prompts.jsonl" \
  --use-wandb --wandb-project miles-dmd2 --wandb-mode "$WANDB_MODE" \
  "${extra[@]}" "$@"
