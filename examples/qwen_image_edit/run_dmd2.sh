#!/usr/bin/env bash
# DMD2 phase 2: distill Qwen-Image-Edit (20B) into a 4-step image editor, LoRA student and critic on one node of
# 8 GPUs (docs/cluster.md, docs/families.md "Qwen-Image-Edit"). No line of it has run on a GPU yet.
#
#   export MODEL_DIR=/models/Qwen-Image-Edit PROMPTS=/data/edits.jsonl IMAGES=/data/edited CAPTIONS=/data/edited.jsonl
#   bash examples/qwen_image_edit/run_dmd2.sh prepare      # once: sample size, prompt cache, real images' latents
#   DRY_RUN=1 bash examples/qwen_image_edit/run_dmd2.sh    # check every input; print groups, time and memory plan
#   bash examples/qwen_image_edit/run_dmd2.sh              # train; a rerun resumes from $OUT/ckpt
#
# Every record carries the image to edit under "condition_image" (--condition-image-key): PROMPTS holds one
# {"prompt": instruction, "condition_image": "refs/cat.png"} per edit (paths relative to the JSONL file); `prepare`
# caches each (instruction, reference) pair once: the prompt states and the reference's latents. The GAN head's real
# data are edited images (IMAGES) with their instruction and reference in CAPTIONS, one {"file_name": "cat.png",
# "prompt": instruction, "condition_image": "/data/refs/cat.png"} per image (absolute reference paths: encode_images
# copies the key into the image's record, and the prompt cache then reads it relative to $DATA/real). The negative
# prompt " " is encoded once, without an image; the unconditional branch takes each sample's reference latents.
#
# Memory (the dry run's planner on the real configs, docs/cluster.md "Wan 2.2 T2V A14B and Qwen-Image-Edit": the
# planner's estimates, not GPU measurements): each sample's sequence is the target's 4096 tokens and the
# reference's 4096 (1024² each, a square reference). Full weights do not fit in the default sharding mode (210 GiB
# per GPU), so the student and the critic are LoRA adapters (rank 64 / 32) on one frozen 20.4B base each: 60.2 GiB
# peak per GPU (critic group: the base gathered in bf16 through a phase), which fits 8 x 80 GB and 8 x 141 GB.
# --fsdp-reshard-every-microbatch lowers it to 21.9 GiB (full weights with it: 61.7 GiB). Host memory per node
# while the groups sleep: 46.1 GiB.
#
# Choices and where they come from (docs/families.md): 4 student steps, teacher true CFG 4.0 against " " with the
# stock per-token norm rescale: QwenImageEditPipeline's own call defaults (true_cfg_scale 4.0) and the family's; no
# public DMD recipe for Qwen-Image-Edit was found, so learning rates 1e-5, GAN weights 1e-2 / 3e-2 and LoRA ranks
# 64 / 32 are those of examples/qwen_image/run_dmd2.sh (NVlabs/FastGen's Qwen-Image DMD2, the dmdr ranks). The flow
# shift is left to the family: e^mu of the stock pipeline at the target's token count (the reference's tokens do not
# count); the dry run says the value it took. 1024² is the size the stock pipeline gives a square reference
# (calculate_dimensions(1024², 1)). 40 prompts per rollout over 8 ranks = 5 pairs per rank, one per critic step.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/common/dmd2_phase2.sh
source examples/common/dmd2_phase2.sh

FAMILY=qwen_image_edit
MODEL_DIR=${MODEL_DIR:-/models/Qwen-Image-Edit}
OUT=${OUT:-outputs/qwen_image_edit_dmd2}
NEGATIVE_PROMPT=" "
SAMPLE_SIZE=${SAMPLE_SIZE-"1024 1024"}
RECIPE_FLAGS=(
  --condition-image-key condition_image
  --num-rollout 3000 --rollout-batch-size 40 --n-samples-per-prompt 1 --micro-batch-size 1
  --diffusion-num-steps 4 --diffusion-step-rule dmd2
  --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale 4.0
  --dmd2-gan-disc-weight 1e-2 --dmd2-gan-gen-weight 3e-2
  --lora-rank 64 --critic-lora-rank 32 --save-hf-lora
  --lr 1e-5 --critic-lr 1e-5
)
dmd2_recipe "$@"
