"""DMD2 phase 2 end to end through ``train_diffusion.main``: the critic group trains its GAN head on the tiny digits
pipeline against real digits, the student takes the GAN gradient, an EMA is kept and exported, and a resume from
a mid-run commit repeats the uninterrupted run's figures exactly (the head, the EMA and the real-data cursor are
all in the checkpoint). 2 DP ranks on CPU, inside the session's Ray cluster."""

import json
import logging
import math

import pytest
import torch

from miles.driver.run_dir import read_latest
from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.memory import assert_plan_agrees
from tests.support.trainer import make_pipeline

GAN_ACTOR = ["train/dmd2_gan_grad_abs_mean", "train/dmd2_gan_dm_grad_ratio"]
GAN_CRITIC = [
    "train/critic-gan_disc_loss",
    "train/critic-gan_logit_real",
    "train/critic-gan_logit_fake",
    "train/critic-sft_loss",
]


def _argv(root, out, *extra):
    return [
        "--loss-type", "dmd2", "--hf-checkpoint", str(root / "digits"), "--teacher-load", str(root / "digits"),
        "--prompt-data", str(root / "prompts.jsonl"), "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "4",
        "--micro-batch-size", "1", "--dmd2-critic-steps-per-rollout", "2", "--dmd2-teacher-guidance-scale", "2",
        "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-gen-weight", "3e-3",
        "--dmd2-gan-real-data", str(root / "real.jsonl"), "--ema-decay", "0.9",
        "--num-rollout", "3", "--lr", "1e-3", "--critic-lr", "1e-3", "--output-dir", str(out), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_cluster):
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("gan_e2e")
    make_pipeline(root / "digits")
    digits = load_digits()
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"a digit {d}"}) + "\n" for d in range(10)))
    real = [
        {"prompt": f"a digit {int(label)}", "image": (image * 255 / 16).round().astype(int).tolist()}
        for image, label in zip(digits.images[:40], digits.target[:40])
    ]
    (root / "real.jsonl").write_text("".join(json.dumps(record) + "\n" for record in real))
    save, export, out = root / "ckpt", root / "student", root / "full"
    run_main(_argv(root, out, "--save", str(save), "--save-interval", "1", "--save-hf", str(export)))
    return {"root": root, "save": save, "export": export, "records": read_metrics(out), "argv": _argv(root, out)}


def _train_records(records, key):
    return [r for r in records if key in r]


def test_the_critic_trains_its_head_and_the_student_takes_the_gan_gradient(run):
    records = run["records"]
    critic = _train_records(records, "train/critic-loss")
    actor = _train_records(records, "train/loss")
    assert len(critic) == 6 and len(actor) == 3  # K = 2 critic steps per rollout, one student step
    for record in critic:
        assert all(math.isfinite(record[key]) for key in GAN_CRITIC)
        # softplus(D(fake)) + softplus(−D(real)) of a fresh head: near 2·ln 2
        assert 0.5 < record["train/critic-gan_disc_loss"] < 3.0
    for record in actor:
        assert all(math.isfinite(record[key]) and record[key] > 0 for key in GAN_ACTOR)
    memory = [r for r in records if "memory/critic-parameters_bytes" in r]
    assert memory and memory[-1]["memory/critic-parameters_bytes"] > memory[-1]["memory/actor-parameters_bytes"]


def test_the_memory_plan_matches_the_bytes_each_group_logged(run):
    # 2 ranks, the GAN head in the critic group, the student's EMA (not among the logged figures): within 5%.
    figures = assert_plan_agrees(run["argv"], run["records"])
    assert len(figures) == 8 and figures["critic-parameters"][1] > figures["actor-parameters"][1]


def test_the_head_and_the_ema_are_checkpointed_and_the_export_differs_from_the_live_weights(run):
    from torch.distributed.checkpoint import FileSystemReader

    save = run["save"]
    assert read_latest(save) == 2
    critic_keys = FileSystemReader(str(save.parent / "ckpt_critic" / "rollout_2" / "dcp")).read_metadata()
    assert any(key.startswith("train.model.disc_head.") for key in critic_keys.state_dict_metadata)
    actor_keys = FileSystemReader(str(save / "rollout_2" / "dcp")).read_metadata()
    assert any(key.startswith("ema.shadow.") for key in actor_keys.state_dict_metadata)
    assert not any("disc_head" in key for key in actor_keys.state_dict_metadata)  # the actor never holds the critic
    from diffusers import SD3Transformer2DModel

    exported = SD3Transformer2DModel.from_pretrained(run["export"] / "transformer").state_dict()
    initial = SD3Transformer2DModel.from_pretrained(run["root"] / "digits" / "transformer").state_dict()
    assert all(torch.isfinite(value).all() for value in exported.values())
    assert any(not torch.equal(exported[key], initial[key]) for key in initial)


def test_resume_from_a_mid_run_commit_repeats_the_figures_exactly(run):
    root, save = run["root"], run["save"]
    (save / "latest").write_text("1\n")  # as if the run had died during rollout 2
    out = root / "resumed"
    run_main(_argv(root, out, "--save", str(save), "--load", str(save)))
    resumed = read_metrics(out)
    keys = ["train/loss", "train/critic-loss", *GAN_ACTOR, *GAN_CRITIC]
    for key in keys:
        full = [r[key] for r in _train_records(run["records"], key) if r["rollout_id"] == 2]
        again = [r[key] for r in _train_records(resumed, key) if r["rollout_id"] == 2]
        assert full and again == full, key


def test_phase_two_on_an_engine_replica_repeats_the_figures(run):
    """``--rollout-num-gpus 1``: a replica generates both DP shards and hands each pair its real sample, so the
    critic's GAN steps run (they once failed at the first one) and every figure equals the actor-generated run's to
    float32 rounding: the replica samples with an unsharded module and its own torch thread count, so its matmuls
    may sum in another order than the gathered FSDP2 module of a rank (seen: 4e-7 relative on a loaded machine)."""
    out = run["root"] / "replica"
    run_main(_argv(run["root"], out, "--rollout-num-gpus", "1"))
    records = read_metrics(out)
    for key in ["train/loss", "train/critic-loss", *GAN_ACTOR, *GAN_CRITIC]:
        expected = [r[key] for r in _train_records(run["records"], key)]
        assert expected and [r[key] for r in _train_records(records, key)] == pytest.approx(
            expected, rel=1e-5, abs=1e-6
        ), key


def test_a_prompt_judging_head_logs_its_quality_on_held_out_reals_at_every_evaluation(run):
    """The projection head with matching-aware and R1 rows trains, and each evaluation scores held-out reals with
    their own and a wrong prompt and the student's fakes (miles.methods.dmd2_disc_eval)."""
    root = run["root"]
    out = root / "judge"
    extra = ["--dmd2-gan-projection", "--dmd2-gan-mismatch-weight", "1", "--dmd2-gan-r1-weight", "10"]
    extra += ["--dmd2-gan-eval-real-data", str(root / "real.jsonl"), "--eval-interval", "1", "--num-rollout", "1"]
    # the wrong prompts of the matching-aware rows come from the micro-batch: one critic step of 2 pairs per rank
    extra += ["--micro-batch-size", "2", "--dmd2-critic-steps-per-rollout", "1"]
    run_main(_argv(root, out, *extra))
    records = read_metrics(out)
    critic = _train_records(records, "train/critic-gan_r1")
    assert len(critic) == 1 and all(r["train/critic-gan_r1"] >= 0 for r in critic)
    assert all(math.isfinite(r["train/critic-gan_logit_mismatch"]) for r in critic)
    (evaluation,) = _train_records(records, "eval/disc_prompt_auc")
    assert 0 <= evaluation["eval/disc_prompt_auc"] <= 1 and 0 <= evaluation["eval/disc_real_fake_auc"] <= 1
    gap = evaluation["eval/disc_logit_real"] - evaluation["eval/disc_logit_fake"]
    assert evaluation["eval/disc_real_minus_fake"] == pytest.approx(gap)


def _phase1(argv: list[str]) -> list[str]:
    """``argv`` without the phase-2 flags (the GAN head, its real data, the EMA)."""
    phase2 = {"--dmd2-gan-disc-weight", "--dmd2-gan-gen-weight", "--dmd2-gan-real-data", "--ema-decay"}
    kept, skip = [], False
    for part in argv:
        if skip:
            skip = False
        elif part in phase2:
            skip = True
        else:
            kept.append(part)
    return kept


def test_phase_two_resumes_a_phase_one_checkpoint_with_a_fresh_head_and_ema(run, tmp_path, caplog):
    """Issue 34 item 4 (docs/dmd2.md "From phase 1 to phase 2"): the phase-1 checkpoint has no head, no EMA and no
    real-data cursor; the resume that adds them trains them from rollout 1 on and checkpoints them."""
    root, save, out = run["root"], tmp_path / "ckpt", tmp_path / "run"
    phase2 = _argv(root, out, "--save", str(save), "--num-rollout", "2")
    run_main([*_phase1(phase2)[:-2], "--num-rollout", "1"])
    assert read_latest(save) == 0
    with caplog.at_level(logging.INFO, logger="train_diffusion"):
        run_main([*phase2, "--load", str(save)])
    lines = [record.getMessage() for record in caplog.records if record.name == "train_diffusion"]
    assert any(
        line.startswith(
            "resume starts fresh what the checkpoint lacks (phase 1 -> phase 2): the actor group's EMA (--ema-decay), "
            "the critic group's GAN head (--dmd2-gan-disc-weight)"
        )
        for line in lines
    ), lines
    critic = [r for r in _train_records(read_metrics(out), "train/critic-gan_disc_loss") if r["rollout_id"] == 1]
    assert len(critic) == 2 and all(0.5 < r["train/critic-gan_disc_loss"] < 3.0 for r in critic)  # a fresh head
    from miles.backends.fsdp_utils.checkpoint import saved_entries

    assert any(key.startswith("train.model.disc_head.") for key in saved_entries(tmp_path / "ckpt_critic", 1))
    assert any(key.startswith("ema.shadow.") for key in saved_entries(save, 1))
