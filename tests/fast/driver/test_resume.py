"""A resume checked against the run it continues (issue 34 item 4), before Ray starts and without it: the run record
keeps each trainer group's LoRA, EMA and built modules, and the settings a resume may change; the preflight of
``--load`` (:func:`miles.driver.preflight_checkpoint.check_load`) refuses on one line what the checkpoint cannot fill
and the driver's resume line lists what it accepts.

Real parsing and validation of the command, real DCP checkpoints (``tests.support.inputs.checkpoint_layout``) and the
run records the saving command writes; the digits pipeline.
"""

from pathlib import Path

import pytest

from miles.driver.preflight_checkpoint import check_load
from miles.driver.resume import read_run_record, resumed_line
from miles.driver.validators import group_layout
from miles.utils.validation import ArgumentValidationError
from tests.support.arguments import validated
from tests.support.inputs import checkpoint_layout, write_digit_records
from tests.support.trainer import make_pipeline


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    pipeline = make_pipeline(root / "digits")
    prompts = write_digit_records(root / "prompts.jsonl", 8, images=False)
    return root, pipeline, prompts


def dmd2(world, ckpt: Path, *extra: str) -> list[str]:
    _, pipeline, prompts = world
    return [
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", str(prompts), "--rollout-batch-size", "4", "--micro-batch-size", "2",
        "--dmd2-critic-steps-per-rollout", "2", "--num-rollout", "4", "--save", str(ckpt), *extra,
    ]  # fmt: skip


def saved_run(world, d: Path, *extra: str, data_state=None) -> Path:
    """A committed rollout 1 of the DMD2 command with ``extra``, in both groups' directories, with its run record."""
    ckpt = d / "ckpt"
    checkpoint_layout(ckpt, 1, command=dmd2(world, ckpt, *extra), data_state=data_state)
    checkpoint_layout(d / "ckpt_critic", 1, commit=False, role="critic")
    return ckpt


def resume(world, ckpt: Path, *extra: str):
    """Check the resume of ``ckpt`` with the DMD2 command with ``extra``, as the preflight does; returns the args."""
    args = validated([*dmd2(world, ckpt, *extra), "--load", str(ckpt)])
    check_load(args, group_layout(args))
    return args


LORA = ("--lora-rank", "4", "--lora-alpha", "4", "--lora-target-modules", "to_q,to_v")


@pytest.mark.parametrize(
    "saved, now, message",
    [
        # a new alpha would silently scale the learned update (16x for 4 -> 64)
        (LORA, (*LORA, "--lora-alpha", "64"),
         "--lora-alpha 64: --load {ckpt} (rollout 1) holds the actor group's adapter trained with --lora-alpha 4; "),
        (LORA, ("--lora-rank", "8", "--lora-alpha", "4", "--lora-target-modules", "to_q,to_v"),
         "--lora-rank 8: --load {ckpt} (rollout 1) holds the actor group's adapter trained with --lora-rank 4"),
        (LORA, (*LORA, "--lora-target-modules", "to_q"),
         "--lora-target-modules to_q: --load {ckpt} (rollout 1) holds the actor group's adapter trained with "
         "--lora-target-modules to_q,to_v"),
        (LORA, (),
         "--lora-rank 0 (full weights): --load {ckpt} (rollout 1) holds the actor group as a LoRA adapter "
         "(--lora-rank 4), this command trains full weights"),
        ((), ("--lora-rank", "4"),
         "--lora-rank 4: --load {ckpt} (rollout 1) holds the actor group as full weights (--lora-rank 0 (full "
         "weights)), this command trains a LoRA adapter"),
        # the critic's own adapter, the student's full weights
        (("--critic-lora-rank", "4"), ("--critic-lora-rank", "2"),
         "--critic-lora-rank 2: --load {ckpt} (rollout 1) holds the critic group's adapter trained with "
         "--critic-lora-rank 4"),
    ],
    ids=["lora-alpha", "lora-rank", "lora-targets", "lora-to-full", "full-to-lora", "critic-rank"],
)  # fmt: skip
def test_a_resume_that_the_checkpoint_cannot_fill_is_refused_on_one_line(world, tmp_path, saved, now, message):
    ckpt = saved_run(world, tmp_path, *saved)
    with pytest.raises(ArgumentValidationError) as exc:
        resume(world, ckpt, *now)
    text = str(exc.value)
    assert "\n" not in text and message.format(ckpt=ckpt) in text, text
    assert "latest" not in text  # no earlier rollout fits a command better: nothing to offer


def test_the_same_command_resumes_and_a_removed_ema_or_a_new_batch_is_listed(world, tmp_path):
    ckpt = saved_run(world, tmp_path, *LORA, "--ema-decay", "0.99")
    resume(world, ckpt, *LORA, "--ema-decay", "0.99")  # nothing to refuse
    args = resume(world, ckpt, *LORA, "--rollout-batch-size", "8", "--diffusion-num-steps", "2",
                  "--dmd2-teacher-guidance-scale", "2", "--dmd2-critic-steps-per-rollout", "4")  # fmt: skip
    lines = resumed_line(args, 2, ["actor", "critic"], read_run_record(ckpt, 1))
    assert len(lines) == 2 and lines[1] == (
        "resume changes --rollout-batch-size 4 -> 8, --diffusion-num-steps 4 -> 2, --dmd2-critic-steps-per-rollout "
        "2 -> 4, --dmd2-teacher-guidance-scale 1.0 -> 2.0, --ema-decay 0.99 -> None; the new values apply from "
        "rollout 2"
    )


def test_a_prompt_file_shorter_than_the_saved_cursor_is_refused(world, tmp_path):
    ckpt = saved_run(world, tmp_path, data_state={"data_source": {"epoch": 0, "cursor": 6}})
    resume(world, ckpt)  # the same 8 prompts
    short = write_digit_records(tmp_path / "short.jsonl", 4, images=False)
    with pytest.raises(ArgumentValidationError) as exc:
        resume(world, ckpt, "--prompt-data", str(short))
    assert str(exc.value) == (
        f"--prompt-data {short} holds 4 records, but --load {ckpt} (rollout 1) had read 6 of its prompt file's "
        "epoch; resume with the same --prompt-data, or start a new run"
    )


def test_another_methods_checkpoint_is_refused_without_advice_to_edit_latest(world, tmp_path):
    # rollout 0 is complete too: the refusal offered to write 0 into latest, which would discard rollout 1 and still
    # be a DMD2 checkpoint.
    _, pipeline, prompts = world
    ckpt = tmp_path / "ckpt"
    checkpoint_layout(ckpt, 0, command=dmd2(world, ckpt))
    saved_run(world, tmp_path)
    train = write_digit_records(tmp_path / "train.jsonl", 8)
    argv = ["--loss-type", "sft_loss", "--train-only", "--hf-checkpoint", str(pipeline), "--prompt-data", str(train),
            "--rollout-batch-size", "8", "--micro-batch-size", "4", "--num-rollout", "4", "--load", str(ckpt)]  # fmt: skip
    args = validated(argv)
    with pytest.raises(ArgumentValidationError) as exc:
        check_load(args, group_layout(args))
    assert str(exc.value) == (
        f"--load {ckpt} holds a --loss-type dmd2 checkpoint (rollout 1) but this command is --loss-type sft_loss; "
        "resume it with --loss-type dmd2, or start the sft_loss run from an exported pipeline (--hf-checkpoint) with "
        "a new --save"
    )


def test_phase_2_on_a_phase_1_checkpoint_is_a_resume_that_names_what_starts_fresh(world, tmp_path):
    # docs/dmd2.md "From phase 1 to phase 2": the GAN head and the EMA join a phase-1 checkpoint (the trainers'
    # side: tests/fast/backends/fsdp_utils/test_lora.py; the real-data cursor's: tests/fast/ray/test_real_data.py).
    real = write_digit_records(tmp_path / "real.jsonl", 4)
    ckpt = saved_run(world, tmp_path)
    phase2 = ("--dmd2-gan-disc-weight", "0.01", "--dmd2-gan-gen-weight", "0.001", "--dmd2-gan-real-data", str(real),
              "--ema-decay", "0.99")  # fmt: skip
    args = resume(world, ckpt, *phase2)
    lines = resumed_line(args, 2, ["actor", "critic"], read_run_record(ckpt, 1))
    assert lines[1] == (
        "resume starts fresh what the checkpoint lacks (phase 1 -> phase 2): the actor group's EMA (--ema-decay), the "
        "critic group's GAN head (--dmd2-gan-disc-weight); a side input new to the run (the GAN head's real data) "
        "reads from its first record"
    )
    assert lines[2] == "resume changes --ema-decay None -> 0.99; the new values apply from rollout 2"
