"""``--dry-run`` (``miles.driver.plan``): the groups, their placement and each DP rank's work per rollout, printed
without starting Ray; the input args stay untouched."""

import copy
import logging

import torch

from miles.driver.arguments import parse_args
from miles.driver.plan import groups_table, log_plan, work_per_rank
from miles.methods.base import PhaseWork

BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "4"]
# DMD2 on 2 DP ranks: 12 prompts, 6 pairs per rank; K = 3 critic steps.
DMD2 = [*BASE, "--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--dmd2-critic-steps-per-rollout", "3"]
DMD2 += ["--actor-num-gpus-per-node", "2", "--rollout-batch-size", "12"]


def test_dmd2_work_per_rank_counts_every_phase_divided_by_the_dp_size():
    args = parse_args([*DMD2, "--dmd2-teacher-guidance-scale", "3"])
    assert work_per_rank(args) == [
        # 6 samples in micro-batches of 1, each up to the 4 steps of the schedule
        ("actor", PhaseWork("rollout (at most)", 24, 0, 1)),
        ("critic", PhaseWork("3 optimizer steps", 6, 6, 1)),
        # the teacher's CFG doubles its batch: [uncond; cond] in one forward
        ("critic", PhaseWork("scoring: teacher", 6, 0, 2)),
        ("critic", PhaseWork("scoring: critic", 6, 0, 1)),
        ("actor", PhaseWork("1 optimizer steps", 6, 6, 1)),
    ]
    # Dedicated engine replicas: each generates the shards of DP / N ranks.
    engines = work_per_rank(parse_args([*DMD2, "--rollout-num-gpus", "1", "--micro-batch-size", "2"]))
    assert engines[0] == ("engine replica", PhaseWork("rollout (at most)", 2 * 3 * 4, 0, 2))


def test_sft_train_only_has_no_rollout_phase():
    args = parse_args([*BASE, "--train-only", "--rollout-batch-size", "8", "--num-steps-per-rollout", "2"])
    assert work_per_rank(args) == [("actor", PhaseWork("2 optimizer steps", 8, 8, 1))]


def test_the_groups_are_a_table_with_each_groups_hooks_one_per_line():
    args = parse_args([*DMD2, "--save", "/ckpt/run", "--critic-lr", "4e-5", "--ema-decay", "0.9"])
    assert groups_table(args) == [
        "trainer groups (2, in training order):",
        "  group   init             teacher          lr     steps/rollout  save              load",
        "  critic  /models/teacher  /models/teacher  4e-05  3              /ckpt/run_critic  -",
        "  actor   /models/student  -                1e-05  1              /ckpt/run         -",
        "  group critic:",
        "    --custom-prepare-train-batch-path    miles.backends.fsdp_utils.loss_hub.dmd2.prepare_critic_batch",
        "    --custom-loss-function-path          miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula",
        "    --custom-train-output-function-path  miles.backends.fsdp_utils.loss_hub.dmd2.predict_teacher_and_critic_x0",
        "  group actor:",
        "    --custom-prepare-train-batch-path  miles.backends.fsdp_utils.loss_hub.dmd2.prepare_generator_batch",
        "    --custom-loss-function-path        miles.backends.fsdp_utils.loss_hub.dmd2.dmd2_loss_formula",
        "    --ema-decay                        0.9",
    ]


def test_a_frozen_group_shows_no_learning_rate():
    # The DMDR reward group (miles.methods.dmd2_reward) takes no optimizer step: its row reads "-" for the lr.
    reward = ["--dmd2-reward-weight", "0.5", "--dmd2-reward-function-path", "miles.eval.digits.reward.digit_log_prob"]
    rows = groups_table(parse_args([*DMD2, *reward]))
    assert rows[0] == "trainer groups (3, in training order):"
    cells = {row.split()[0]: row.split() for row in rows[2:5]}
    assert cells["reward"][3:5] == ["-", "0"] and cells["actor"][3:5] == ["1e-05", "1"]


def test_log_plan_prints_groups_in_training_order_and_leaves_the_args_untouched(caplog):
    args = parse_args([*DMD2, "--save", "/ckpt/run", "--save-interval", "2", "--profile-rollouts", "2:9"])
    snapshot = copy.deepcopy(vars(args))
    with caplog.at_level(logging.INFO, logger="miles.driver"):
        log_plan(args)
    assert vars(args) == snapshot
    text = caplog.text
    assert text.index("  critic  /models/teacher") < text.index("  actor   /models/student")
    assert "profile: rollouts 2..3 on every rank, traces in outputs/run/profiles" in text  # cut at --num-rollout 4
    # Neither pipeline exists here: the estimate and the memory plan each say why they have no figure.
    assert "time estimate: none (" in text and "memory plan: not available (FileNotFoundError: " in text
    # The cluster's placement, with the GPUs the command asks for, on this machine without GPUs too (issue 34 item 5).
    assert (
        "placement: 2 bundles of {GPU: 1, CPU: c} (one per trainer rank: --actor-num-nodes 1 x "
        "--actor-num-gpus-per-node 2 GPUs" in text
    )
    assert "the 2 trainer groups share them" in text
    here = "placement: planned for GPUs; this machine has none (a run here would take 2 bundles of {CPU: c}"
    assert (here in text) == (not torch.cuda.is_available())
    assert "rollout: each of the 2 actor ranks generates its own shard on its student" in text
    assert "work per DP rank per rollout (DP size 2, 6 pairs per rank)" in text
    assert "scoring: teacher" in text
    assert (
        "schedule: rollouts 0..3, sleep between groups on GPUs: True" in text and "saves after rollouts [1, 3]" in text
    )
