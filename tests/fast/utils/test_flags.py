"""The dataclass -> argparse bridge: a settings field declares its flag once (name, type, default, help, choices,
check), and the parsed namespace comes back as the dataclass."""

import argparse
from dataclasses import dataclass

import pytest

from miles.utils.flags import add_dataclass_arguments, check_fields, derived, from_namespace, option
from miles.utils.validation import ArgumentValidationError, int_list


@dataclass(frozen=True)
class Toy:
    flag_prefix = "toy-"

    steps: int = option(5, help="Steps.", check={"low": 1})
    scale: float = option(1.0, help="Scale (default: the model's).", flag_default=None, check={"low": 1})
    rule: str = option("grid", help="Rule.", choices=("grid", "shift"))
    blocks: tuple[int, ...] | None = option(help="Blocks.", parse=int_list)
    path: str | None = option(help="A path.", flag="--toy-data")
    switch: bool = option(False, help="On/off.")
    both: bool = option(False, help="Both ways.", action=argparse.BooleanOptionalAction)
    origin: str = derived("")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser.add_argument_group("toy"), Toy)
    return parser


def test_each_field_is_one_flag_of_its_type_default_and_choices():
    actions = {action.dest: action for action in _parser()._actions if action.dest != "help"}
    assert list(actions) == ["toy_steps", "toy_scale", "toy_rule", "toy_blocks", "toy_data", "toy_switch", "toy_both"]
    assert actions["toy_steps"].type is int and actions["toy_steps"].default == 5
    assert actions["toy_scale"].type is float and actions["toy_scale"].default is None  # filled after parsing
    assert actions["toy_rule"].choices == ("grid", "shift") and actions["toy_rule"].help == "Rule."
    assert actions["toy_blocks"].type is int_list and actions["toy_data"].option_strings == ["--toy-data"]
    assert actions["toy_switch"].nargs == 0 and isinstance(actions["toy_both"], argparse.BooleanOptionalAction)


def test_the_namespace_comes_back_as_the_dataclass_lists_as_tuples():
    args = _parser().parse_args(["--toy-steps", "3", "--toy-blocks", "6,12", "--toy-data", "x.jsonl", "--no-toy-both"])
    args.toy_scale, args.toy_origin = 2.5, "set here"  # what a method fills in after parsing
    assert from_namespace(Toy, args) == Toy(3, 2.5, "grid", (6, 12), "x.jsonl", False, False, "set here")
    assert from_namespace(Toy, args, steps=9).steps == 9


def test_the_checks_name_the_flag_and_skip_unset_values():
    check_fields(Toy(scale=None))
    with pytest.raises(ArgumentValidationError, match=r"^--toy-steps must be >= 1, got 0$"):
        check_fields(Toy(steps=0))
    with pytest.raises(ArgumentValidationError, match=r"^--toy-scale must be a finite number, got nan$"):
        check_fields(Toy(scale=float("nan")))
