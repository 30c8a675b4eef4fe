"""Parsing helpers of the argument tests (``tests/fast/driver``, ``tests/fast/methods``): the real parser, its
defaults and validators, and the one-line rejection the CLI prints."""

import pytest

from miles.driver.arguments import build_parser, parse_args, set_default_diffusion_args, validate_args
from miles.utils.validation import ArgumentValidationError

# A command that only lacks --rollout-batch-size; the paths are never opened by parse_args.
BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "3"]
CUSTOM_HOOKS = [
    "--custom-expand-samples-to-train-pairs-path",
    "my_project.hooks.convert",
    "--custom-prepare-train-batch-path",
    "my_project.hooks.prepare",
    "--custom-loss-function-path",
    "my_project.hooks.loss",
]


def parsed_with_defaults(argv: list[str]):
    """``argv`` parsed, with the defaults that depend on other flags filled, not yet validated."""
    return set_default_diffusion_args(build_parser().parse_args(argv))


def validated(argv: list[str]):
    """``argv`` parsed, defaulted and validated (``ArgumentValidationError`` propagates)."""
    args = parsed_with_defaults(argv)
    validate_args(args)
    return args


def rejected(argv: list[str]) -> str:
    """The ``ArgumentValidationError`` message of ``argv``; fails the test if ``argv`` validates."""
    with pytest.raises(ArgumentValidationError) as exc_info:
        validated(argv)
    return str(exc_info.value)


def cli_rejection(argv: list[str], capsys) -> str:
    """Run ``parse_args`` as the CLI does; return its single stderr line after checking exit code 2."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train_diffusion.py: error: "), err
    return err
