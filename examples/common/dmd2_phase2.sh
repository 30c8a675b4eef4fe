# Shared steps of the GPU recipes: sourced by examples/<model>/run_dmd2.sh, never run on its own.
#
# A recipe sets these, then calls `dmd2_recipe "$@"`:
#   FAMILY          the --diffusion-model-family of its pipelines (sd3, qwen_image, flux, flux2, wan)
#   MODEL_DIR       the stock diffusers pipeline directory (teacher, student init, text encoders, VAE)
#   OUT             the run's outputs; DATA (default $OUT/data) where `prepare` writes
#   NEGATIVE_PROMPT the negative prompt the teacher's CFG runs against (cached once by `prepare`)
#   SAMPLE_SIZE     optional "H W" (video: "F H W"): the size `prepare` records in MODEL_DIR/model_index.json as
#                   _miles_sample_size (the stock pipelines ignore keys that start with "_"); empty keeps the stock
#                   default size. Checked first against the family's rule (multiples of 16; Wan: F = 4k + 1), so a
#                   wrong size stops `prepare` before it writes anything or runs the prompt cache
#   RECIPE_FLAGS    (array) the model's own flags: schedule, guidance, learning rates, LoRA, batch
# and the user may set PROMPTS, IMAGES (or REAL for ready latent records), CAPTIONS, NODES, GPUS_PER_NODE, DEVICE,
# WANDB_MODE, DRY_RUN=1 (docs/cluster.md).
#
# `prepare` encodes the prompts once (no text encoder on the training GPUs) and the real images into VAE latents
# with their captions' conds (the GAN head's real data); a run then trains phase 2 (GAN head, EMA), resuming from
# $OUT/ckpt when it holds a commit.

dmd2_prepare() {
  if [ -n "${SAMPLE_SIZE:-}" ]; then
    # shellcheck disable=SC2086
    python -m miles.models.stock_defaults "$MODEL_DIR" $SAMPLE_SIZE --diffusion-model-family "$FAMILY"
  fi
  python -m miles.rollout.prompt_cache "$MODEL_DIR" "$PROMPTS" "$DATA/prompts" --diffusion-model-family "$FAMILY" \
    --negative-prompt "$NEGATIVE_PROMPT" --device "$DEVICE" --dtype bfloat16 "$@"
  if [ -n "${REAL:-}" ]; then
    echo "using the latent records of REAL=$REAL as they are (no encode_images)" >&2
  else
    python -m miles.rollout.encode_images "$MODEL_DIR" "$IMAGES" "$DATA/real" --diffusion-model-family "$FAMILY" \
      ${CAPTIONS:+--captions "$CAPTIONS"}
    python -m miles.rollout.prompt_cache "$MODEL_DIR" "$DATA/real/data.jsonl" "$DATA/real" \
      --diffusion-model-family "$FAMILY" --negative-prompt "$NEGATIVE_PROMPT" --device "$DEVICE" --dtype bfloat16
  fi
  echo "prepared $DATA; next: DRY_RUN=1 bash $0"
}

dmd2_recipe() {
  DATA=${DATA:-$OUT/data}
  PROMPTS=${PROMPTS:-/data/prompts.jsonl}
  IMAGES=${IMAGES:-/data/images}
  NODES=${NODES:-1}
  GPUS_PER_NODE=${GPUS_PER_NODE:-8}
  DEVICE=${DEVICE:-cuda}
  WANDB_MODE=${WANDB_MODE:-offline}
  local real_data=${REAL:-$DATA/real/prompts.jsonl}

  if [ "${1:-}" = "prepare" ]; then
    shift
    dmd2_prepare "$@"
    return 0
  fi

  local extra=()
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
    --diffusion-model-family "$FAMILY" \
    --prompt-data "$DATA/prompts/prompts.jsonl" --input-key prompt \
    --negative-cond "$DATA/prompts/negative.safetensors" \
    --actor-num-nodes "$NODES" --actor-num-gpus-per-node "$GPUS_PER_NODE" \
    --train-dtype bfloat16 --gradient-checkpointing \
    --dmd2-critic-scoring fused \
    --dmd2-gan-real-data "$real_data" \
    --ema-decay 0.99 \
    --clip-grad 1.0 \
    --save "$OUT/ckpt" --save-interval 250 --save-keep-last 2 --save-keep-every 1000 --save-hf "$OUT/student" \
    --output-dir "$OUT/run" --eval-interval 250 --eval-max-prompts 64 --eval-n-samples-per-prompt 1 \
    --eval-prompt-data "$DATA/prompts/prompts.jsonl" \
    --use-wandb --wandb-project miles-dmd2 --wandb-mode "$WANDB_MODE" \
    "${RECIPE_FLAGS[@]}" "${extra[@]}" "$@"
}
