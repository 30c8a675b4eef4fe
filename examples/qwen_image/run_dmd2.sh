#!/usr/bin/env bash
# DMD2 phase 2: distill Qwen-Image (20B) into a 4-step student at 512 px, LoRA student and critic on one node of
# 8 GPUs (docs/cluster.md, docs/families.md). No line of it has run on a GPU yet.
#
#   export MODEL_DIR=/models/Qwen-Image PROMPTS=/data/prompts.jsonl IMAGES=/data/images
#   bash examples/qwen_image/run_dmd2.sh prepare      # once: sample size, prompt cache, real images' latents
#   DRY_RUN=1 bash examples/qwen_image/run_dmd2.sh    # check every input; print groups, time and memory plan
#   bash examples/qwen_image/run_dmd2.sh              # train; a rerun resumes from $OUT/ckpt
#
# Memory (the planner, `python benchmarks/memory_plan.py --detail qwen_image --gpus 8 --lora --ema --resolution
# 512`): full weights do not fit 8 GPUs of 80 GB in the default sharding mode (192.6 / 197.3 GiB per GPU at
# 1024 px), so this recipe trains LoRA adapters: 47.7 GiB peak per GPU (actor group: the 20.4B base gathered in bf16
# through a phase, 425M adapter parameters). --fsdp-reshard-every-microbatch lowers it further (9.2 GiB at 1024 px).
#
# Choices and where they come from (docs/families.md, "Public DMD2-style distillation settings"):
# - 4 student steps at 512 px, teacher true CFG 4.0 against the negative prompt " ", learning rates 1e-5, GAN
#   weight 0.03 for the student: NVlabs/FastGen's Qwen-Image DMD2 recipe; disc weight 1e-2 as tianweiy/DMD2.
#   The teacher's CFG carries the stock sampler's per-token norm rescale (the qwen_image default), so 4.0 is what
#   the model card's true_cfg_scale 4.0 samples; FastGen's teacher guides plainly: add
#   --no-dmd2-teacher-cfg-norm-rescale for exactly its teacher. 4.0 and " " are also the family's defaults.
# - The flow shift is left to the family: e^mu of the stock pipeline's dynamic shift at the sample size (the dry run
#   says the value it took).
# - Student LoRA rank 64, critic rank 32: the public dmdr ranks (SD3.5-Large), untuned for Qwen-Image.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/common/dmd2_phase2.sh
source examples/common/dmd2_phase2.sh

FAMILY=qwen_image
MODEL_DIR=${MODEL_DIR:-/models/Qwen-Image}
OUT=${OUT:-outputs/qwen_image_dmd2}
NEGATIVE_PROMPT=" "
SAMPLE_SIZE=${SAMPLE_SIZE-"512 512"}
RECIPE_FLAGS=(
  --num-rollout 3000 --rollout-batch-size 80 --n-samples-per-prompt 1 --micro-batch-size 1
  --diffusion-num-steps 4 --diffusion-step-rule dmd2
  --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale 4.0
  --dmd2-gan-disc-weight 1e-2 --dmd2-gan-gen-weight 3e-2
  --lora-rank 64 --critic-lora-rank 32 --save-hf-lora
  --lr 1e-5 --critic-lr 1e-5
)
dmd2_recipe "$@"
