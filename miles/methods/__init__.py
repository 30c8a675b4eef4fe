"""The loss types (``--loss-type``): one module per method declares its flags, defaults, validation and groups.

``METHODS`` maps each ``--loss-type`` value to its :class:`~miles.methods.base.Method`; the argument module and the
driver look a run's method up here and never branch on the loss type themselves.
"""

import argparse

from miles.methods.base import Method
from miles.methods.custom import CustomMethod
from miles.methods.dmd2 import DMD2Method
from miles.methods.sft import SFTMethod
from miles.utils.trainer_config import TrainerConfig

__all__ = ["METHODS", "Method", "compute_trainer_configs", "get_method"]

METHODS: dict[str, Method] = {method.name: method for method in (SFTMethod(), DMD2Method(), CustomMethod())}


def get_method(args_or_name: argparse.Namespace | str) -> Method:
    """The method of a parsed command (its ``--loss-type``) or of a loss-type name.

    Raises:
        ValueError: on an unknown name.
    """
    name = args_or_name if isinstance(args_or_name, str) else args_or_name.loss_type
    if name not in METHODS:
        raise ValueError(f"--loss-type {name!r} is unknown; choose one of {sorted(METHODS)}")
    return METHODS[name]


def compute_trainer_configs(args: argparse.Namespace) -> list[TrainerConfig]:
    """The run's trainer groups in training order (seed ``[DMD2 1/10]``): the method's list."""
    return get_method(args).trainer_configs(args)
