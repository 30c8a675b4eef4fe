"""Small helpers shared by every module: seeded generators and hook loading."""

import hashlib
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["stable_hash", "make_generator", "load_function"]


def stable_hash(*parts: Any) -> int:
    """Hash ``parts`` to a non-negative 63-bit integer that is the same in every process and Python run.

    Python's built-in ``hash`` is salted per process for strings, so it cannot seed the random draws that two Ray
    workers (or a resumed run) must repeat. This hashes the ``repr`` of each part with SHA-256 instead.

    Args:
        *parts: values that identify one random draw, e.g. ``("sample", seed, rollout_id, microbatch_id, dp_rank)``.
            Use ints, floats, strings, bools, None or tuples of them: their ``repr`` is stable.

    Returns:
        `int` in ``[0, 2**63)``, usable as ``torch.Generator.manual_seed``.
    """
    digest = hashlib.sha256("\x1f".join(repr(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def make_generator(*parts: Any, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``stable_hash(*parts)``."""
    return torch.Generator(device=device).manual_seed(stable_hash(*parts))


def _is_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError):  # a parent that is a module, not a package
        return False


def load_function(path: str, what: str = "hook path") -> Callable:
    """Import ``module.sub.attr`` and return the callable it names.

    Args:
        path: dotted path such as ``"miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula"``.
        what: how the errors name the path (``"hook path"``, ``"--diffusion-model-family"``).

    Raises:
        ValueError: if the path has no dot, the module cannot be imported (or raises, or exits, while it is), the
            attribute does not exist or is not callable. The message names the path and what failed.
    """
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"{what} {path!r} must be a dotted path 'package.module.function'")
    module_name, attr_name = path.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r} ({exc})") from exc
    except SystemExit as exc:
        # A module that exits on import would end the command with its code and no word of why.
        raise ValueError(f"{what} {path!r}: importing module {module_name!r} called sys.exit({exc.code!r})") from exc
    except Exception as exc:
        # The module's own error (a SyntaxError, a failing top-level statement), named with the path.
        raise ValueError(
            f"{what} {path!r}: importing module {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    # The whole path may name a submodule, imported already (then an attribute of its package) or not.
    if inspect.ismodule(getattr(module, attr_name, None)) or (not hasattr(module, attr_name) and _is_module(path)):
        raise ValueError(f"{what} {path!r} names a module, not a callable: add the name inside it ({path}.<name>)")
    if not hasattr(module, attr_name):
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no attribute {attr_name!r}")
    fn = getattr(module, attr_name)
    if not callable(fn):
        raise ValueError(f"{what} {path!r}: {attr_name!r} is a {type(fn).__name__}, not a callable")
    return fn
