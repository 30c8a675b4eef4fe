"""The generic evaluation modules stay generic: no import of the digits evaluation or of model families.

Checked twice: statically (every import statement of the generic modules, function-level ones included, names
only ``miles.utils`` or a third-party package), and at run time (importing them in a fresh interpreter loads no
``miles`` module outside ``miles.eval`` and ``miles.utils``).
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

EVAL_DIR = Path(__file__).resolve().parents[3] / "miles" / "eval"
GENERIC = sorted(path for path in EVAL_DIR.glob("*.py"))
GENERIC_MODULES = [f"miles.eval.{path.stem}" for path in GENERIC if path.stem != "__init__"]


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: use absolute imports"
            names.append(node.module)
    return names


def test_the_generic_modules_are_the_expected_ones():
    # A new generic module is covered automatically; this pins that the glob finds the files at all.
    assert {"miles.eval.metrics", "miles.eval.grids", "miles.eval.report", "miles.eval.images"} <= set(GENERIC_MODULES)


@pytest.mark.parametrize("path", GENERIC, ids=lambda path: path.name)
def test_generic_module_imports_only_utils_and_third_party(path):
    allowed = ("miles.utils", "miles.eval")
    for name in _imported_modules(path):
        if name == "miles" or name.startswith("miles."):
            assert name.startswith(allowed) and not name.startswith("miles.eval.digits"), f"{path.name} imports {name}"


def test_importing_the_generic_modules_loads_no_digits_or_model_code():
    code = (
        "import importlib, json, sys\n"
        f"for name in {GENERIC_MODULES!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'miles' or m.startswith('miles.'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    outside = [m for m in loaded if m != "miles" and not m.startswith(("miles.eval", "miles.utils"))]
    assert outside == [], outside
    assert not [m for m in loaded if m.startswith("miles.eval.digits")]
    assert set(GENERIC_MODULES) <= set(loaded)
