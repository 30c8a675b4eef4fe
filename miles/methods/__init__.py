"""The loss types (``--loss-type``): one module per method declares its flags, defaults, validation and groups.

``METHODS`` maps each ``--loss-type`` value to its :class:`~miles.methods.base.Method`; the argument module and the
driver look a run's method up here and never branch on the loss type themselves. A method registers itself with
:func:`~miles.methods.base.register_method` when its module is imported: the built-in ones in the order
``--help`` lists them, then every other module of this package, so a new method is one new file here.
"""

import argparse
import importlib
import pkgutil

from miles.methods.base import METHODS, Method, register_method

# The built-in methods register in the order --help lists them.
# isort: off
from miles.methods import sft  # noqa: F401, E402
from miles.methods import dmd2  # noqa: F401, E402
from miles.methods import custom  # noqa: F401, E402

# isort: on

__all__ = ["METHODS", "Method", "get_method", "register_method"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")  # a method module of its own registers itself


def get_method(args_or_name: argparse.Namespace | str) -> Method:
    """The method of a parsed command (its ``--loss-type``) or of a loss-type name.

    Raises:
        ValueError: on an unknown name.
    """
    name = args_or_name if isinstance(args_or_name, str) else args_or_name.loss_type
    if name not in METHODS:
        raise ValueError(f"--loss-type {name!r} is unknown; choose one of {sorted(METHODS)}")
    return METHODS[name]
