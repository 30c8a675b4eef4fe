"""Batch, teacher and hook validation of ``parse_args``, the CLI's one-line rejections, and picklable args."""

import copy
import pickle
import subprocess
import sys

import pytest

from miles.utils.arguments import (
    ArgumentValidationError,
    build_parser,
    parse_args,
    set_default_diffusion_args,
    validate_args,
)

BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "3"]
CUSTOM_HOOKS = [
    "--custom-expand-samples-to-train-pairs-path",
    "my_project.hooks.convert",
    "--custom-prepare-train-batch-path",
    "my_project.hooks.prepare",
    "--custom-loss-function-path",
    "my_project.hooks.loss",
]


def _validate(argv):
    args = set_default_diffusion_args(build_parser().parse_args(argv))
    validate_args(args)
    return args


def _rejected(argv) -> str:
    with pytest.raises(ArgumentValidationError) as exc_info:
        _validate(argv)
    return str(exc_info.value)


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
    "extra, message",
    [
        (
            ["--rollout-batch-size", "6", "--micro-batch-size", "4"],
            "--global-batch-size 6 must be a multiple of DP size x --micro-batch-size (1 x 4 = 4)",
        ),
        (
            ["--rollout-batch-size", "6", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2"],
            "--global-batch-size 6 must be a multiple of DP size x --micro-batch-size (4 x 1 = 4)",
        ),
    ],
)
def test_global_batch_not_divisible_by_dp_times_micro_batch_rejected(extra, message):
    assert message in _rejected([*BASE, *extra])
    _validate([*BASE, *extra[:2], "--rollout-batch-size", "8"])


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--num-rollout must be a positive integer, got None"),
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


def test_teacher_load_without_consumer_rejected():
    message = _rejected([*BASE, "--rollout-batch-size", "4", "--teacher-load", "/models/teacher"])
    assert message.startswith("--teacher-load has no consumer")
    for flag in ("--custom-prepare-train-batch-path", "--custom-loss-function-path"):
        assert flag in message


@pytest.mark.parametrize(
    "flag",
    ["--custom-prepare-train-batch-path", "--custom-loss-function-path", "--custom-train-output-function-path"],
)
def test_teacher_load_accepted_with_each_custom_hook_alone(flag):
    args = _validate([*BASE, "--rollout-batch-size", "4", "--teacher-load", "/models/teacher", flag, "my.hooks.fn"])
    assert args.teacher_load == "/models/teacher"


@pytest.mark.parametrize(
    "drop, message",
    [
        (
            "--custom-prepare-train-batch-path",
            "--loss-type custom_loss needs --custom-prepare-train-batch-path and --custom-loss-function-path",
        ),
        (
            "--custom-loss-function-path",
            "--loss-type custom_loss needs --custom-prepare-train-batch-path and --custom-loss-function-path",
        ),
        (
            "--custom-expand-samples-to-train-pairs-path",
            "--loss-type custom_loss needs --custom-expand-samples-to-train-pairs-path (the converter)",
        ),
    ],
)
def test_custom_loss_without_its_hooks_rejected(drop, message):
    index = CUSTOM_HOOKS.index(drop)
    hooks = CUSTOM_HOOKS[:index] + CUSTOM_HOOKS[index + 2 :]
    assert message in _rejected([*BASE, "--rollout-batch-size", "4", "--loss-type", "custom_loss", *hooks])
    args = _validate([*BASE, "--rollout-batch-size", "4", "--loss-type", "custom_loss", *CUSTOM_HOOKS])
    assert args.custom_loss_function_path == "my_project.hooks.loss"


def test_custom_loss_with_no_hooks_rejected():
    message = _rejected([*BASE, "--rollout-batch-size", "4", "--loss-type", "custom_loss"])
    assert "--loss-type custom_loss needs --custom-prepare-train-batch-path" in message


@pytest.mark.parametrize(
    "argv, flag",
    [
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
    ],
)
def test_rejection_from_a_new_process_is_one_line_exit_2_no_traceback(argv, flag):
    code = f"from miles.utils.arguments import parse_args; parse_args({argv!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and result.stderr.endswith("\n"), result.stderr
    assert lines[0].startswith("train_diffusion.py: error: ")
    assert flag in lines[0]
    assert "Traceback" not in result.stderr


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
    from miles.utils.arguments import ArgumentValidationError, build_parser, set_default_diffusion_args, validate_args

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
    check("--save-hf", str(pipeline))  # an earlier export may be replaced


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


def _fake_digits_pipeline(path):
    """A pipeline directory as far as the input checks read it: model_index.json and the transformer config."""
    (path / "transformer").mkdir(parents=True)
    (path / "model_index.json").write_text('{"_class_name": "DigitsPipeline"}')
    (path / "transformer" / "config.json").write_text('{"in_channels": 1, "sample_size": 8}')
    return path


def test_input_checks_name_the_flag_and_the_path_before_ray_starts(tmp_path):
    import json

    from miles.utils.preflight import validate_inputs

    pipeline = _fake_digits_pipeline(tmp_path / "pipe")
    image = [[0] * 8 for _ in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "image": image}) + "\n" for i in range(4)))
    base = ["--hf-checkpoint", str(pipeline), "--prompt-data", str(data), "--num-rollout", "1"]
    base += ["--rollout-batch-size", "4", "--train-only"]

    def rejected(*extra, check_paths=True):
        with pytest.raises(ArgumentValidationError) as exc_info:
            validate_inputs(_validate([*base, *extra]), check_paths=check_paths)
        return str(exc_info.value)

    validate_inputs(_validate(base))
    assert rejected("--hf-checkpoint", str(tmp_path / "nope")).startswith(f"--hf-checkpoint {tmp_path / 'nope'}: no")
    corrupt = _fake_digits_pipeline(tmp_path / "corrupt")
    (corrupt / "model_index.json").write_text('{"_class_name": ')
    assert "model_index.json is not valid JSON" in rejected("--hf-checkpoint", str(corrupt))
    assert rejected("--prompt-data", str(tmp_path)) == f"--prompt-data {tmp_path} is a directory; pass a JSONL file"
    records = [{"prompt": "a", "image": image}, {"prompt": "b"}]
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert "record 2 (prompt 'b') has no image under --image-key 'image'" in rejected()
    records[1]["image"] = [[0] * 16 for _ in range(16)]
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    message = rejected()
    assert (
        "record 2 (prompt 'b')" in message and "latent of shape (1, 16, 16) but the model takes (1, 8, 8)" in message
    )
    records[1]["image"] = [[300] * 8 for _ in range(8)]
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert "record 2 (prompt 'b'): image values must be in 0..255" in rejected()
    data.write_text(json.dumps({"prompt": "a", "image": image}) + "\n")
    missing = str(tmp_path / "eval.jsonl")
    assert rejected("--eval-interval", "1", "--eval-prompt-data", missing).startswith("--eval-prompt-data")
    # Hooks and --load are checked in a dry run too; the data paths are not (they may live on the cluster).
    hook = rejected("--eval-function-path", "miles.utils.misc.no_such_hook", check_paths=False)
    assert hook.startswith("--eval-function-path: hook path 'miles.utils.misc.no_such_hook'")
    assert "no attribute 'no_such_hook'" in hook
    assert "is a str, not a callable" in rejected("--custom-loss-function-path", "miles.utils.arguments.SFT_LOSS")
    assert rejected("--load", str(tmp_path / "ckpt"), check_paths=False).startswith(f"--load {tmp_path / 'ckpt'}")
    validate_inputs(_validate([*base, "--hf-checkpoint", str(tmp_path / "nope")]), check_paths=False)


def _fake_checkpoint(save_dir, *rollout_ids):
    """A checkpoint directory as far as ``read_data_state`` checks it: ``latest`` names the last of ``rollout_ids``."""
    import json

    for rollout_id in rollout_ids:
        (save_dir / f"rollout_{rollout_id}" / "dcp").mkdir(parents=True)
        (save_dir / f"rollout_{rollout_id}" / "metadata.json").write_text(json.dumps({"rollout_id": rollout_id}))
        (save_dir / f"rollout_{rollout_id}" / "dcp" / ".metadata").write_text("")
    (save_dir / "latest").write_text(f"{rollout_ids[-1]}\n")


def test_dmd2_load_needs_the_critic_checkpoint_of_the_same_rollout(tmp_path):
    from miles.utils.preflight import validate_inputs

    argv = [*BASE, "--rollout-batch-size", "4", "--loss-type", "dmd2", "--teacher-load", "/models/teacher"]
    argv += ["--dmd2-critic-steps-per-rollout", "1", "--load", str(tmp_path / "ckpt")]
    _fake_checkpoint(tmp_path / "ckpt", 1)
    with pytest.raises(ArgumentValidationError, match="also loads the critic's checkpoint: .*ckpt_critic: no such"):
        validate_inputs(_validate(argv), check_paths=False)
    # The critic saves first: a crash before the actor's save leaves the critic one save ahead.
    _fake_checkpoint(tmp_path / "ckpt_critic", 1, 3)
    with pytest.raises(ArgumentValidationError) as exc_info:
        validate_inputs(_validate(argv), check_paths=False)
    message = str(exc_info.value)
    expected = (
        f"--load {tmp_path / 'ckpt'} holds rollout 1 but the critic's {tmp_path / 'ckpt_critic'} holds rollout 3"
    )
    assert message.startswith(expected), message
    assert "write 1 into the newer one's 'latest' file" in message
    (tmp_path / "ckpt_critic" / "latest").write_text("1\n")  # the fix the message asks for
    validate_inputs(_validate(argv), check_paths=False)


def test_flow_shift_must_be_positive_and_uncond_dropout_is_sft_only():
    assert "--fsdp-flow-shift must be > 0" in _rejected(
        [*BASE, "--rollout-batch-size", "2", "--fsdp-flow-shift", "-1"]
    )
    dmd2 = ["--loss-type", "dmd2", "--teacher-load", "/models/teacher", "--rollout-batch-size", "5"]
    assert "--sft-uncond-prob" in _rejected([*BASE, *dmd2, "--sft-uncond-prob", "0.1"])
    assert _validate([*BASE, "--rollout-batch-size", "2", "--sft-uncond-prob", "0.1"]).sft_uncond_prob == 0.1
