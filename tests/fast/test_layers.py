"""The package's layers point one way: a module imports only from its own layer or the ones below it.

    6 driver    miles.driver (arguments, preflight, --dry-run plan, evaluation, console)
    5 methods   miles.methods (one module per --loss-type)
    4 ray       miles.ray (placement, trainer and engine groups, RolloutManager, converters)
    3 backends  miles.backends (the FSDP trainer, its hooks)
    2 rollout   miles.rollout (engine, conditioning, data), miles.eval.digits
    1 models    miles.models, miles.config (the run's specs), miles.eval (generic evaluation), miles.plot
    0 utils     miles.utils

Every import statement counts, also those inside functions (a lazy import is still a dependency).
"""

import ast
from pathlib import Path

MILES = Path(__file__).resolve().parents[2] / "miles"
LAYERS = [
    ("miles.utils", 0),
    ("miles.models", 1),
    ("miles.config", 1),
    ("miles.eval.digits", 2),
    ("miles.eval", 1),
    ("miles.plot", 1),
    ("miles.rollout", 2),
    ("miles.backends", 3),
    ("miles.ray", 4),
    ("miles.methods", 5),
    ("miles.driver", 6),
]


def layer_of(module: str) -> int:
    for prefix, layer in LAYERS:  # the most specific prefix comes first
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"module {module} has no layer; add it to LAYERS and to the docstring")


def imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("miles"):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("miles")]
    return found


def test_every_import_points_to_the_same_or_a_lower_layer():
    violations = []
    for path in sorted(MILES.rglob("*.py")):
        module = ".".join(path.relative_to(MILES.parent).with_suffix("").parts).removesuffix(".__init__")
        if module == "miles":
            continue
        for line, target in imports_of(path):
            if target != "miles" and layer_of(target) > layer_of(module):
                violations.append(f"{path.relative_to(MILES.parent)}:{line} {module} -> {target}")
    assert not violations, "\n".join(violations)


def test_only_the_argument_modules_and_the_methods_name_the_loss_type():
    argument_modules = {"arguments.py", "validators.py"}  # the parser and its validators (miles/driver)
    offenders = [
        str(path.relative_to(MILES.parent))
        for path in sorted(MILES.rglob("*.py"))
        if "loss_type" in path.read_text() and path.parent.name != "methods" and path.name not in argument_modules
    ]
    assert offenders == []
