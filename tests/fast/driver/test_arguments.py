"""Batch and hook validation of ``parse_args`` (``miles.driver.arguments``), the CLI's one-line rejections, and
picklable args. Each loss type's own flags and checks are tested in tests/fast/methods."""

import copy
import pickle

import pytest

from miles.driver.arguments import (
    build_parser,
    method_flag_dests,
    parse_args,
    run_paths,
    set_default_diffusion_args,
    validate_args,
)
from miles.utils.validation import ArgumentValidationError
from tests.support.arguments import BASE
from tests.support.arguments import rejected as _rejected
from tests.support.arguments import validated as _validate


def test_batch_invariant_holds_with_the_default_global_batch():
    args = parse_args(
        [*BASE, "--rollout-batch-size", "4", "--n-samples-per-prompt", "3", "--num-steps-per-rollout", "2"]
    )
    assert args.global_batch_size == 6
    args = parse_args([*BASE, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8"])
    assert (args.global_batch_size, args.num_steps_per_rollout) == (8, 1)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "4"],
            "--rollout-batch-size x --n-samples-per-prompt (4 x 2 = 8) must equal --global-batch-size x "
            "--num-steps-per-rollout (4 x 1); set --global-batch-size to 8 or change --num-steps-per-rollout",
        ),
        (
            ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "2"]
            + ["--global-batch-size", "2"],
            "(4 x 2 = 8) must equal --global-batch-size x --num-steps-per-rollout (2 x 2); set --global-batch-size to 4",
        ),
        # 3 pairs cannot split into 2 equal steps, so no default global batch exists.
        (
            ["--rollout-batch-size", "3", "--num-steps-per-rollout", "2"],
            "(3 x 1 = 3) must equal --global-batch-size x --num-steps-per-rollout (None x 2); pick a "
            "--num-steps-per-rollout that divides 3, or change --rollout-batch-size",
        ),
    ],
)
def test_broken_batch_invariant_rejected(extra, message):
    assert message in _rejected([*BASE, *extra])


@pytest.mark.parametrize(
    "extra, message, fixed",
    [
        (
            ["--rollout-batch-size", "6", "--micro-batch-size", "4"],
            "--global-batch-size 6 must be a multiple of DP size x --micro-batch-size (1 x 4 = 4)",
            ["--rollout-batch-size", "8"],
        ),
        (
            # 4 prompts split over the 4 ranks, but 2 steps of 2 pairs leave ranks without a micro-batch.
            ["--rollout-batch-size", "4", "--num-steps-per-rollout", "2"]
            + ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2"],
            "--global-batch-size 2 must be a multiple of DP size x --micro-batch-size (4 x 1 = 4)",
            ["--rollout-batch-size", "8"],
        ),
    ],
)
def test_global_batch_not_divisible_by_dp_times_micro_batch_rejected(extra, message, fixed):
    assert message in _rejected([*BASE, *extra])
    _validate([*BASE, *extra, *fixed])


@pytest.mark.parametrize(
    "extra, message, fixed",
    [
        (
            # Every DP rank generates an equal share of the prompts, so they must split evenly.
            ["--rollout-batch-size", "6", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2"],
            "--rollout-batch-size 6 must be a multiple of the DP size 4 (--actor-num-nodes x "
            "--actor-num-gpus-per-node / --context-parallel-size): every rank generates an equal share of the prompts",
            ["--rollout-batch-size", "8"],
        ),
        (
            # Not enough even with more samples per prompt: the split is of prompts, not of samples.
            ["--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--actor-num-gpus-per-node", "2"],
            "--rollout-batch-size 3 must be a multiple of the DP size 2",
            ["--rollout-batch-size", "2"],
        ),
        (
            ["--rollout-batch-size", "6", "--actor-num-gpus-per-node", "3", "--rollout-num-gpus", "2"],
            "--rollout-num-gpus 2 must divide the DP size 3: each engine replica generates the shards of a run of "
            "DP ranks",
            ["--rollout-num-gpus", "3"],
        ),
    ],
)
def test_prompts_and_engine_replicas_must_split_over_the_dp_ranks(extra, message, fixed):
    assert message in _rejected([*BASE, *extra])
    _validate([*BASE, *extra, *fixed])


@pytest.mark.parametrize(
    "extra, message, fixed",
    [
        (
            # 4 ranks at CP 2 are 2 DP ranks: 2 prompts split over them, where 4 DP ranks could not split them.
            ["--rollout-batch-size", "2", "--actor-num-gpus-per-node", "4"],
            "--rollout-batch-size 2 must be a multiple of the DP size 4",
            ["--context-parallel-size", "2"],
        ),
        (
            ["--rollout-batch-size", "2", "--actor-num-gpus-per-node", "4", "--context-parallel-size", "3"],
            "--context-parallel-size 3 must divide the trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node "
            "= 4); DP size = ranks / context-parallel size",
            ["--context-parallel-size", "4"],
        ),
        (
            ["--rollout-batch-size", "2", "--actor-num-gpus-per-node", "2", "--context-parallel-size", "0"],
            "--context-parallel-size must be >= 1, got 0",
            ["--context-parallel-size", "2"],
        ),
        (
            ["--rollout-batch-size", "2", "--actor-num-gpus-per-node", "4", "--context-parallel-size", "2"]
            + ["--rollout-num-gpus", "1"],
            "--context-parallel-size 2 needs the actor ranks to generate (--rollout-num-gpus 0)",
            ["--rollout-num-gpus", "0"],
        ),
    ],
)
def test_the_context_parallel_size_splits_the_ranks_into_dp_by_cp(extra, message, fixed):
    assert message in _rejected([*BASE, *extra])
    args = _validate([*BASE, *extra, *fixed])
    from miles.utils.validation import context_parallel_size, dp_size

    assert dp_size(args) * context_parallel_size(args) == args.actor_num_gpus_per_node


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--num-rollout is required (a positive integer)"),
        (["--rollout-batch-size", "0"], "--rollout-batch-size must be a positive integer, got 0"),
        (["--rollout-batch-size", "4", "--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be >= 1, got 0"),
        (["--rollout-batch-size", "4", "--diffusion-num-steps", "0"], "--diffusion-num-steps must be >= 1, got 0"),
    ],
)
def test_non_positive_sizes_rejected(extra, message):
    argv = ["--hf-checkpoint", "/m", "--prompt-data", "/p.jsonl", *extra]
    if extra:
        argv += ["--num-rollout", "1"]
    assert message in _rejected(argv)


# Each command rejected as a user would see it: train_diffusion.py run in its own process. The cases share one
# warmed-up interpreter that forks a child per command (tests.support.cli), not one fresh interpreter each.
REJECTED_COMMANDS = [
    (["--prompt-data", "/p.jsonl"], "--hf-checkpoint"),
    (["--hf-checkpoint", "/m"], "--prompt-data"),
    ([*BASE, "--rollout-batch-size", "4", "--global-batch-size", "3"], "--global-batch-size"),
    ([*BASE, "--rollout-batch-size", "4", "--teacher-load", "/t"], "--teacher-load"),
    ([*BASE, "--rollout-batch-size", "4", "--critic-lr", "1e-4"], "--critic-lr"),
    ([*BASE, "--rollout-batch-size", "4", "--save-interval", "2"], "--save-interval"),
    # argparse's own errors are one line too.
    ([*BASE, "--loss-type", "ppo"], "--loss-type"),
    ([*BASE, "--rollout-batch-size", "four"], "--rollout-batch-size"),
    ([*BASE, "--no-such-flag"], "--no-such-flag"),
]


@pytest.fixture(scope="module")
def rejections() -> list[dict]:
    from tests.support.cli import run_commands

    return run_commands([{"argv": argv} for argv, _ in REJECTED_COMMANDS])


@pytest.mark.parametrize("case", range(len(REJECTED_COMMANDS)), ids=[flag for _, flag in REJECTED_COMMANDS])
def test_rejection_from_a_new_process_is_one_line_exit_2_no_traceback(rejections, case):
    flag = REJECTED_COMMANDS[case][1]
    result = rejections[case]
    assert result["returncode"] == 2, result["stderr"]
    assert result["stdout"] == ""
    lines = result["stderr"].splitlines()
    assert len(lines) == 1 and result["stderr"].endswith("\n"), result["stderr"]
    assert lines[0].startswith("train_diffusion.py: error: ")
    assert flag in lines[0]
    assert "Traceback" not in result["stderr"]


@pytest.mark.parametrize(
    "argv",
    [
        [*BASE, "--rollout-batch-size", "4", "--diffusion-timesteps", "1000,750,500,250"],
        [*BASE, "--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--rollout-batch-size", "10"]
        + ["--diffusion-timesteps", "1000,500", "--load", "/ckpt/run", "--save", "/ckpt/run"],
    ],
    ids=["sft_loss", "dmd2"],
)
def test_deep_copy_of_parsed_args_pickles_to_the_same_bytes(argv):
    args = parse_args(argv)
    clone = copy.deepcopy(args)
    assert clone is not args and clone.diffusion_timesteps is not args.diffusion_timesteps
    assert pickle.dumps(clone) == pickle.dumps(args)
    assert vars(pickle.loads(pickle.dumps(args))) == vars(args)


def test_save_hf_never_replaces_a_model_a_checkpoint_or_other_files(tmp_path):
    def check(*extra):
        argv = ["--hf-checkpoint", str(tmp_path / "init"), "--prompt-data", "p.jsonl", "--num-rollout", "1"]
        args = build_parser().parse_args([*argv, "--rollout-batch-size", "2", *extra])
        validate_args(set_default_diffusion_args(args))

    with pytest.raises(ArgumentValidationError, match="--save-hf .* is also --hf-checkpoint"):
        check("--save-hf", str(tmp_path / "init"))
    for flag in ("--output-dir", "--save"):
        with pytest.raises(ArgumentValidationError, match=f"--save-hf .* is also {flag}"):
            check("--save-hf", str(tmp_path / "run"), flag, str(tmp_path / "run"))
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ArgumentValidationError, match="not a pipeline directory"):
        check("--save-hf", str(other))
    pipeline = tmp_path / "old_export"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text("{}")
    # An earlier export is replaced only when asked for (--overwrite-save-hf), never silently.
    with pytest.raises(ArgumentValidationError, match="holds a pipeline already; add --overwrite-save-hf"):
        check("--save-hf", str(pipeline))
    check("--save-hf", str(pipeline), "--overwrite-save-hf")
    # Every trainer group's paths count: DMD2's critic loads --critic-load and saves to <save>_critic.
    dmd2 = ["--loss-type", "dmd2", "--teacher-load", str(tmp_path / "teacher"), "--dmd2-critic-steps-per-rollout", "1"]
    with pytest.raises(ArgumentValidationError, match="--save-hf .* is also the critic group's --hf-checkpoint"):
        check(*dmd2, "--critic-load", str(pipeline), "--save-hf", str(pipeline), "--overwrite-save-hf")
    with pytest.raises(ArgumentValidationError, match="--save-hf .* is also the critic group's --save"):
        check(*dmd2, "--save", str(tmp_path / "ckpt"), "--save-hf", str(tmp_path / "ckpt_critic"))
    with pytest.raises(ArgumentValidationError, match="--save-hf .* is also the critic group's --teacher-load"):
        check(*dmd2, "--critic-load", str(tmp_path / "critic"), "--save-hf", str(tmp_path / "teacher"))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lr", "-1"], "--lr must be >= 0, got -1.0"),
        (["--clip-grad", "-1"], "--clip-grad must be >= 0, got -1.0"),
        (["--lr-warmup-steps", "-5"], "--lr-warmup-steps must be >= 0, got -5"),
        (["--rollout-num-gpus", "-1"], "--rollout-num-gpus must be >= 0, got -1"),
        (["--diffusion-flow-shift", "0"], "--diffusion-flow-shift must be > 0 (e.g. 3.0), got 0.0"),
        (["--eval-n-samples-per-prompt", "0"], "--eval-n-samples-per-prompt must be >= 1, got 0"),
    ],
)
def test_numbers_no_run_can_use_are_rejected(extra, message):
    assert message in _rejected([*BASE, "--rollout-batch-size", "4", *extra])


def test_flow_shift_must_be_positive():
    assert "--fsdp-flow-shift must be > 0" in _rejected(
        [*BASE, "--rollout-batch-size", "2", "--fsdp-flow-shift", "-1"]
    )


def test_every_method_flag_is_owned_by_one_loss_type_and_run_paths_cover_every_group():
    owned = method_flag_dests()
    assert set(owned) == {"sft_loss", "dmd2", "custom_loss"}
    assert owned["sft_loss"] == owned["custom_loss"] == set()
    assert {"critic_load", "critic_lr", "dmd2_critic_steps_per_rollout", "dmd2_teacher_guidance_scale"} <= owned[
        "dmd2"
    ]
    parser_dests = {action.dest for action in build_parser()._actions}
    assert owned["dmd2"] <= parser_dests
    args = parse_args(
        [*BASE, "--rollout-batch-size", "2", "--loss-type", "dmd2", "--teacher-load", "/models/teacher"]
        + ["--dmd2-critic-steps-per-rollout", "1", "--save", "/ckpt/run", "--output-dir", "/runs/a"]
    )
    assert run_paths(args) == [
        ("the critic group's --hf-checkpoint", "/models/teacher"),
        ("the critic group's --teacher-load", "/models/teacher"),
        ("the critic group's --save", "/ckpt/run_critic"),
        ("--hf-checkpoint", "/models/student"),
        ("--save", "/ckpt/run"),
        ("--output-dir", "/runs/a"),
    ]


def test_parsing_the_command_line_loads_no_diffusers_module():
    # --help and every rejection go through parse_args, which imports each method's flags. diffusers' EMA helper
    # alone loaded every diffusers model class (about 5 s of an 8 s --help): the EMA imports it when it is built.
    import subprocess
    import sys

    dmd2 = ["--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--rollout-batch-size", "5"]
    argv = [*BASE, *dmd2, "--ema-decay", "0.99"]
    code = (
        "import sys\n"
        "from miles.driver.arguments import parse_args\n"
        f"parse_args({argv!r})\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in ('diffusers', 'transformers', 'peft')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_evaluation_settings_without_evaluations_are_refused_and_their_defaults_are_the_parsers():
    base = [*BASE, "--rollout-batch-size", "4"]
    for name, value in (
        ("--eval-max-prompts", "8"),
        ("--eval-n-samples-per-prompt", "2"),
        ("--eval-prompt-data", "e"),
    ):
        message = _rejected([*base, name, value])
        assert message == f"{name} is read by the evaluations only: set --eval-interval N to evaluate every N " \
            "rollouts, or remove it"  # fmt: skip
    parser = build_parser()
    defaults = [str(parser.get_default(dest)) for dest in ("eval_max_prompts", "eval_n_samples_per_prompt")]
    _validate([*base, "--eval-max-prompts", defaults[0], "--eval-n-samples-per-prompt", defaults[1]])
    _validate([*base, "--eval-interval", "1", "--eval-max-prompts", "8", "--eval-prompt-data", "e"])
