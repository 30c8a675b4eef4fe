"""``stable_hash``, ``make_generator`` and ``load_function``."""

import os
import subprocess
import sys

import pytest
import torch

from miles.utils import misc
from miles.utils.misc import load_function, make_generator, stable_hash

PARTS = ("init_noise", 42, 3, 17)
# Computed once with PYTHONHASHSEED=1 and 99 (same value): changing it would change every seeded draw of a run.
PINNED = 8952053707590389354


def test_stable_hash_pinned_value():
    assert stable_hash(*PARTS) == PINNED


def test_stable_hash_same_in_new_processes():
    """Fresh interpreters with different ``PYTHONHASHSEED`` (so ``hash(str)`` differs) get the same value."""
    code = f"from miles.utils.misc import stable_hash; print(stable_hash(*{PARTS!r}), hash('init_noise'))"
    outputs = []
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        outputs.append([int(value) for value in run.stdout.split()])
    (value_a, builtin_a), (value_b, builtin_b) = outputs
    assert builtin_a != builtin_b  # the salted built-in hash really differs between the two processes
    assert value_a == value_b == stable_hash(*PARTS) == PINNED


def test_stable_hash_is_63_bit_and_uses_the_range():
    values = [stable_hash("renoise", 42, rollout_id, sample, 1) for rollout_id in range(8) for sample in range(32)]
    assert all(isinstance(value, int) and 0 <= value < 2**63 for value in values)
    assert max(values) >= 2**62
    assert len(set(values)) == len(values)
    torch.Generator().manual_seed(max(values))  # every value is a valid torch seed


@pytest.mark.parametrize(
    "a, b",
    [
        (("stop_step", 42, 0, 1), ("stop_step", 42, 1, 0)),  # order
        (("a", 1), (1, "a")),
        ((1,), ("1",)),  # type
        ((1,), (1.0,)),
        (("ab",), ("a", "b")),  # how the parts are split
        (("a\x1fb",), ("a", "b")),  # a part holding the separator
        ((None,), ()),
        ((0,), (False,)),
        (("sample", 1234, 0, 0, 0), ("sample", 1234, 0, 0, 1)),  # the DP rank
    ],
)
def test_stable_hash_distinct_for_distinct_parts(a, b):
    assert stable_hash(*a) != stable_hash(*b)


def test_make_generator_is_reproducible_and_seeded_by_stable_hash():
    first = torch.randn(4, 3, generator=make_generator(*PARTS))
    again = torch.randn(4, 3, generator=make_generator(*PARTS))
    other = torch.randn(4, 3, generator=make_generator("init_noise", 42, 3, 18))
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    assert make_generator(*PARTS).initial_seed() == PINNED
    expected = torch.randn(4, 3, generator=torch.Generator("cpu").manual_seed(PINNED))
    assert torch.equal(first, expected)
    assert make_generator(*PARTS).device == torch.device("cpu")


def test_load_function_loads_real_functions():
    assert load_function("miles.utils.misc.stable_hash") is misc.stable_hash
    assert load_function("os.path.join") is os.path.join
    assert load_function("miles.driver.arguments.parse_args").__name__ == "parse_args"


@pytest.mark.parametrize(
    "path, message",
    [
        ("stable_hash", "hook path 'stable_hash' must be a dotted path 'package.module.function'"),
        ("", "hook path '' must be a dotted path"),
        (
            "miles.no_such_module.fn",
            "hook path 'miles.no_such_module.fn': cannot import module 'miles.no_such_module'",
        ),
        ("no_such_package.hooks.fn", "cannot import module 'no_such_package.hooks'"),
        (
            "miles.utils.misc.no_such_fn",
            "hook path 'miles.utils.misc.no_such_fn': module 'miles.utils.misc' has no attribute 'no_such_fn'",
        ),
        ("miles.utils.misc.__all__", "hook path 'miles.utils.misc.__all__': '__all__' is a list, not a callable"),
        (
            "miles.models.sd3",
            "hook path 'miles.models.sd3' names a module, not a callable: add the name inside it "
            "(miles.models.sd3.<name>)",
        ),
    ],
    ids=["no-dot", "empty", "missing-module", "missing-package", "missing-attribute", "not-callable", "a-module"],
)
def test_load_function_errors_name_the_path_and_the_problem(path, message):
    with pytest.raises(ValueError) as exc_info:
        load_function(path)
    assert message in str(exc_info.value)


def test_a_module_path_is_named_as_a_module_whether_or_not_it_was_imported_already():
    import miles.models.sd3  # noqa: F401  (now an attribute of miles.models: the other branch of the check)

    with pytest.raises(ValueError, match=r"'miles.models.sd3' names a module, not a callable"):
        load_function("miles.models.sd3")


def test_load_function_rejects_a_non_string():
    with pytest.raises(ValueError, match="must be a dotted path"):
        load_function(None)


@pytest.mark.parametrize(
    "source, message",
    [
        ('raise RuntimeError("boom")\n', "importing module 'hook_mod_{i}' raised RuntimeError: boom"),
        ("def f(:\n", "importing module 'hook_mod_{i}' raised SyntaxError: invalid syntax"),
        ("import sys\nsys.exit(0)\n", "importing module 'hook_mod_{i}' called sys.exit(0)"),
    ],
    ids=["raises", "syntax-error", "sys-exit"],
)
def test_a_hook_module_that_fails_on_import_is_named_with_its_path(tmp_path, monkeypatch, source, message):
    # A module name of its own per case: an imported module would be cached in sys.modules.
    i = len(source)  # distinct for the three cases
    (tmp_path / f"hook_mod_{i}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as exc_info:
        load_function(f"hook_mod_{i}.f")
    assert str(exc_info.value).startswith(f"hook path 'hook_mod_{i}.f': ")
    assert message.format(i=i) in str(exc_info.value)
