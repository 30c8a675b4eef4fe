"""A flag written once: a settings dataclass whose fields declare their own command-line flags.

A field made with :func:`option` carries its flag's help, choices, parse function and number check in its metadata;
:func:`add_dataclass_arguments` adds one argparse argument per such field, in field order, and :func:`from_namespace`
builds the dataclass back from the parsed namespace. So a method's flags, their defaults and the typed object its
hooks read are one declaration (torchtitan's ``JobConfig`` does the same with its config dataclasses)::

    @dataclass(frozen=True)
    class MySettings:
        flag_prefix = "my-"
        steps: int = option(5, help="Inner steps per rollout.", check={"low": 1})   # --my-steps, int, default 5

    add_dataclass_arguments(parser.add_argument_group("mine"), MySettings)
    settings = from_namespace(MySettings, parser.parse_args(argv))                  # MySettings(steps=...)

A field's flag is ``--<flag_prefix><name with dashes>`` unless its ``flag`` says otherwise; its argparse ``dest`` is
the flag without the dashes, as argparse makes it. A :func:`derived` field has no flag: the method fills its value
on the namespace (under the same dest rule) before the settings are built.
"""

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

from miles.utils.validation import check_number

__all__ = ["add_dataclass_arguments", "check_fields", "derived", "flag_dest", "flag_name", "from_namespace", "option"]

# How an unset flag's default is told apart from "the field's default" (see option's flag_default).
_SAME = object()


def option(
    default: Any = None,
    *,
    help: str,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple | None = None,
    action: Any = None,
    check: dict[str, Any] | None = None,
    flag_default: Any = _SAME,
) -> Any:
    """A dataclass field that is also a command-line flag.

    Args:
        default: the field's default, and the flag's (unless ``flag_default`` says otherwise).
        help: the flag's help text (argparse's ``%`` escapes apply: ``2%%``).
        flag: the flag's name when it is not ``--<flag_prefix><field name>`` (``"--critic-load"``).
        parse: argparse's ``type`` (default: the field's own type, ``int``, ``float`` or ``str``).
        choices: argparse's ``choices``.
        action: argparse's ``action`` (``argparse.BooleanOptionalAction``); a bool field without one is a
            ``store_true`` switch.
        check: :func:`~miles.utils.validation.check_number` bounds (``{"low": 0}``) that :func:`check_fields`
            applies to the parsed value (a None value, a flag left unset, is not checked).
        flag_default: the flag's default when it differs from the field's: ``None`` for a value that is filled in
            after parsing from other flags or the model (the field's default is then what an object built without
            the command holds).
    """
    metadata = {
        "help": help,
        "flag": flag,
        "parse": parse,
        "choices": choices,
        "action": action,
        "check": check,
        "flag_default": default if flag_default is _SAME else flag_default,
    }
    return dataclasses.field(default=default, metadata={"flag": metadata})


def derived(default: Any = None) -> Any:
    """A settings field with no flag of its own: a value the method derives from the other flags (and the model)
    and leaves on the namespace under the field's dest before :func:`from_namespace` runs."""
    return dataclasses.field(default=default, metadata={"derived": True})


def _flag_fields(cls: type) -> list[dataclasses.Field]:
    return [field for field in dataclasses.fields(cls) if "flag" in field.metadata]


def flag_name(cls: type, field: dataclasses.Field) -> str:
    """The command-line flag of ``field`` (``--dmd2-gan-disc-weight``)."""
    meta = field.metadata.get("flag") or {}
    if meta.get("flag"):
        return meta["flag"]
    return "--" + getattr(cls, "flag_prefix", "") + field.name.replace("_", "-")


def flag_dest(cls: type, field: dataclasses.Field) -> str:
    """The argparse dest of ``field``'s flag (``dmd2_gan_disc_weight``), also that of a derived field."""
    return flag_name(cls, field).removeprefix("--").replace("-", "_")


def _base_type(annotation: Any) -> Any:
    """``int`` of ``int | None``; the annotation itself when it is not a union."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {**vars(typing), "tuple": tuple})  # noqa: S307 - a field's own annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
        return kinds[0] if len(kinds) == 1 else None
    return annotation


def add_dataclass_arguments(group: argparse._ActionsContainer, cls: type) -> None:
    """Add one argument to ``group`` per :func:`option` field of the dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    for field in _flag_fields(cls):
        meta = field.metadata["flag"]
        kwargs: dict[str, Any] = {"default": meta["flag_default"], "help": meta["help"]}
        kind = _base_type(hints[field.name])
        if meta["action"] is not None:
            kwargs["action"] = meta["action"]
        elif kind is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = meta["parse"] or kind
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
        group.add_argument(flag_name(cls, field), **kwargs)


def from_namespace(cls: type, namespace: argparse.Namespace, **values: Any) -> Any:
    """The dataclass ``cls`` of a parsed namespace: each flag and derived field from its dest (a list becomes a
    tuple, so that the frozen object holds nothing mutable); ``values`` set fields directly."""
    read = dict(vars(namespace))
    for field in dataclasses.fields(cls):
        if field.name in values or not ("flag" in field.metadata or "derived" in field.metadata):
            continue
        dest = flag_dest(cls, field)
        if dest in read:
            value = read[dest]
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def check_fields(settings: Any) -> None:
    """Apply each field's ``check`` (:func:`~miles.utils.validation.check_number` bounds) to its value, in field
    order; a None value is not checked.

    Raises:
        ArgumentValidationError: naming the first flag whose value is out of its range.
    """
    cls = type(settings)
    for field in _flag_fields(cls):
        bounds = field.metadata["flag"]["check"]
        value = getattr(settings, field.name)
        if bounds is not None and value is not None:
            check_number(flag_name(cls, field), value, **bounds)
