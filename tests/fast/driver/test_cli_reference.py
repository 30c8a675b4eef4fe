"""docs/cli-reference.md is generated from the parser and must match it; ``--help`` lists every flag."""

import argparse
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles.driver import cli_reference
from miles.driver.arguments import build_parser
from miles.driver.cli_reference import DEFAULT_OUTPUT, render_cli_reference

REPO_ROOT = Path(__file__).resolve().parents[3]
DOC = REPO_ROOT / "docs" / "cli-reference.md"


def _all_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for action in parser._actions for flag in action.option_strings if flag not in ("-h", "--help")]


def _table_rows(markdown: str) -> dict[str, list[str]]:
    """First flag of each table row → the row's cells (flag, type, default, help)."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| `-"):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            rows[cells[0].split(",")[0].strip("`")] = cells
    return rows


def test_committed_reference_is_up_to_date():
    assert DEFAULT_OUTPUT == DOC
    expected = render_cli_reference(build_parser())
    assert DOC.is_file(), "docs/cli-reference.md is missing: run `python -m miles.driver.cli_reference`"
    assert (
        DOC.read_text(encoding="utf-8") == expected
    ), "docs/cli-reference.md is stale: run `python -m miles.driver.cli_reference` and commit the result"


def test_reference_has_every_flag_and_group_with_its_default():
    parser = build_parser()
    markdown = render_cli_reference(parser)
    rows = _table_rows(markdown)
    for flag in _all_flags(parser):
        assert f"`{flag}`" in markdown, flag
    sections = [line[3:] for line in markdown.splitlines() if line.startswith("## ")]
    assert sections == [
        "cluster and placement",
        "models",
        "FSDP training",
        "optimizer",
        "rollout engine",
        "data",
        "checkpoint",
        "logging and evaluation",
        "hooks (dotted paths)",
        "profiling",
        # Each method's own group follows the generic ones (miles.methods); sft_loss and custom_loss add none.
        "DMD2",
    ]
    assert rows["--dmd2-critic-steps-per-rollout"][1:3] == ["int", "`5`"]
    assert rows["--loss-type"][1:3] == ["`sft_loss` \\| `dmd2` \\| `custom_loss`", "`sft_loss`"]
    assert rows["--critic-load"][1:3] == ["str", "—"]
    assert rows["--train-only"][1:3] == ["flag", "`false`"]
    assert rows["--rollout-shuffle"][:3] == ["`--rollout-shuffle`, `--no-rollout-shuffle`", "bool", "`true`"]
    assert rows["--diffusion-timesteps"][1] == "float list"
    # argparse's `%%` is shown as the single `%` that --help prints.
    assert "(reference 2%)" in rows["--dmd2-min-timestep-ratio"][3]
    assert "-h" not in rows and "--help" not in rows
    assert markdown.endswith("|\n") and "python -m miles.driver.cli_reference" in markdown.split("## ")[0]


def test_render_escapes_pipes_and_newlines():
    parser = argparse.ArgumentParser(prog="demo")
    group = parser.add_argument_group("g", "A group description.")
    group.add_argument("--mode", choices=("a", "b"), default="a", help="one | two\nlines, <dir>_x, %(default)s")
    markdown = render_cli_reference(parser)
    assert "## g\n\nA group description.\n" in markdown
    assert "| `--mode` | `a` \\| `b` | `a` | one \\| two lines, \\<dir>_x, a |" in markdown


def _run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles.driver.cli_reference", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )


def test_check_passes_on_committed_file_and_fails_on_stale(tmp_path, caplog):
    # The command itself once, in its own process; the stale and missing cases through main() in this one.
    assert _run_cli("--check").returncode == 0
    stale = tmp_path / "cli-reference.md"
    stale.write_text(DOC.read_text(encoding="utf-8").replace("`5`", "`6`"), encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="miles.driver.cli_reference"):
        assert cli_reference.main(["--check", "--output", str(stale)]) == 1
    assert "stale" in caplog.text and "python -m miles.driver.cli_reference" in caplog.text
    missing = tmp_path / "missing.md"
    assert cli_reference.main(["--check", "--output", str(missing)]) == 1
    assert cli_reference.main(["--output", str(missing)]) == 0
    assert missing.read_text(encoding="utf-8") == DOC.read_text(encoding="utf-8")


HELP_COLUMNS = ["60", "200"]


@pytest.fixture(scope="module")
def help_outputs() -> dict[str, dict]:
    """``python train_diffusion.py --help`` at each terminal width, each in its own forked process."""
    from tests.support.cli import run_commands

    results = run_commands([{"argv": ["--help"], "env": {"COLUMNS": columns}} for columns in HELP_COLUMNS])
    return dict(zip(HELP_COLUMNS, results, strict=True))


@pytest.mark.parametrize("columns", HELP_COLUMNS)
def test_help_lists_every_flag(help_outputs, columns):
    """What a new user sees: ``python train_diffusion.py --help`` exits 0 and names every flag."""
    result = help_outputs[columns]
    assert result["returncode"] == 0, result["stderr"]
    assert result["stdout"].startswith("usage: train_diffusion.py")
    # Whole tokens, so `--lr` is not taken as found inside `--lr-decay-style`.
    listed = set(re.findall(r"--[a-z0-9][a-z0-9-]*", result["stdout"]))
    assert set(_all_flags(build_parser())) <= listed
    # Every default is shown; unset flags (None) and off switches show none.
    text = " ".join(result["stdout"].split())
    assert "AdamW learning rate of the actor (student). (default: 1e-05)" in text
    assert "(default: sft_loss)" in text and "(default: 100)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
