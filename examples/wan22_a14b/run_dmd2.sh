#!/usr/bin/env bash
# DMD2 phase 2: distill Wan 2.2 T2V A14B (two 14B experts) into a one-network 4-step video student, LoRA student
# and critic, on one node of 8 GPUs (docs/cluster.md, docs/families.md "Two experts"). No line of it has run on a
# GPU yet.
#
#   export MODEL_DIR=/models/Wan2.2-T2V-A14B-Diffusers PROMPTS=/data/prompts.jsonl REAL=/data/real/prompts.jsonl
#   bash examples/wan22_a14b/run_dmd2.sh prepare          # once: sample size and the prompt cache
#   DRY_RUN=1 bash examples/wan22_a14b/run_dmd2.sh        # check every input; print groups, time and memory plan
#   bash examples/wan22_a14b/run_dmd2.sh                  # train; a rerun resumes from $OUT/ckpt
#
# REAL is a JSONL of real video latent records, as for examples/wan/run_dmd2.sh. After `prepare` (which records the
# clip size), write them from a folder of clips with <name>.txt captions (pip install 'miles[video]') and cache
# their prompts, so that no rank loads the UMT5 text encoder:
#   python -m miles.rollout.encode_images $MODEL_DIR /data/clips /data/real
#   python -m miles.rollout.prompt_cache $MODEL_DIR /data/real/data.jsonl /data/real   # REAL=/data/real/prompts.jsonl
#
# What trains (docs/families.md, "Two experts"): the teacher is both experts, frozen, each σ scored by the expert
# the stock WanPipeline runs at σ·1000 (boundary_ratio 0.875); the student is one network started from
# `transformer` (the high-noise expert), the critic one network likewise; the export is a one-network WanPipeline.
#
# Memory (the dry run's planner on the real configs, docs/cluster.md "Wan 2.2 T2V A14B and Qwen-Image-Edit": the
# planner's estimates, not GPU measurements). The critic group holds the teacher's two experts and its own base
# (42.9B frozen parameters) and scores on a doubled batch; in the default sharding mode a phase gathers them whole,
# 90.4 GiB per GPU with LoRA at 33 x 480 x 832, so this recipe reshards every micro-batch
# (--fsdp-reshard-every-microbatch, ZeRO-3 per block). With LoRA adapters (rank 64 / 32) on one frozen base each,
# the planned peak is then 40.3 GiB per GPU (critic group): it fits 8 x 80 GB and 8 x 141 GB. Full weights would
# plan 66.5 GiB (14.3B trainable parameters in the student and in the critic, 16 bytes each, over 8 ranks): within
# the 72 GiB the planner allows on an 80 GB GPU, with little to spare. The stock 81 frames plan 77.4 GiB with LoRA:
# over 72 GiB on 80 GB, within 127 GiB on 141 GB (SAMPLE_SIZE="81 480 832" on 8 x H200). 720p (81 x 720 x 1280)
# fits neither (163 GiB): context parallelism would split it, but the GAN head reads the block features it splits,
# so phase 2 refuses --context-parallel-size > 1; without the GAN head (--dmd2-gan-disc-weight 0, no
# --dmd2-gan-real-data) --context-parallel-size 4 plans 24.6 GiB at 720p. The groups sleep in host memory in turn
# (automatic on GPUs): 85.3 GiB of host memory per node while they sleep, 90.6 GiB while the actor group loads.
#
# Choices and where they come from (docs/families.md): no public DMD recipe for A14B was found; 4 steps at flow shift
# 5 and learning rates 1e-5 are NVlabs/FastGen's Wan 2.1 T2V DMD2 settings (as examples/wan/run_dmd2.sh); teacher
# CFG 4.0 is the model card's guidance_scale (the high-noise expert's; its guidance_scale_2 3.0 for the low-noise
# expert is not taken: one scale guides both); the negative prompt is empty (the family's default); K = 5 critic
# steps and GAN weights 1e-2 / 5e-3 as the other recipes; LoRA ranks 64 / 32 as the image recipes (the public dmdr
# ranks, untuned here); 40 prompts per rollout over 8 ranks = 5 pairs per rank, one per critic step.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/common/dmd2_phase2.sh
source examples/common/dmd2_phase2.sh

FAMILY=wan
MODEL_DIR=${MODEL_DIR:-/models/Wan2.2-T2V-A14B-Diffusers}
OUT=${OUT:-outputs/wan22_a14b_dmd2}
NEGATIVE_PROMPT=${NEGATIVE_PROMPT:-""}
SAMPLE_SIZE=${SAMPLE_SIZE-"33 480 832"}
REAL=${REAL:-/data/real/prompts.jsonl}
RECIPE_FLAGS=(
  --num-rollout 3000 --rollout-batch-size 40 --n-samples-per-prompt 1 --micro-batch-size 1
  --diffusion-num-steps 4 --diffusion-flow-shift 5.0 --diffusion-step-rule dmd2 --fsdp-flow-shift 5.0
  --dmd2-critic-steps-per-rollout 5 --dmd2-teacher-guidance-scale 4.0
  --dmd2-gan-disc-weight 1e-2 --dmd2-gan-gen-weight 5e-3
  --lora-rank 64 --critic-lora-rank 32
  --fsdp-reshard-every-microbatch
  --lr 1e-5 --critic-lr 1e-5
)
dmd2_recipe "$@"
