"""The order in which pytest-xdist hands the test files to its workers (``tests/fast/conftest.py``)."""

from pathlib import Path
from types import SimpleNamespace

from tests.fast.conftest import FILE_SECONDS, file_seconds, pytest_collection_modifyitems, pytest_configure

FAST = Path(__file__).resolve().parent


def test_every_listed_file_exists():
    # A renamed or removed file would silently drop out of the longest-first order.
    assert [name for name in FILE_SECONDS if not (FAST / name).is_file()] == []


def test_the_longest_files_come_first_and_each_file_stays_whole_in_its_order():
    nodeids = [
        "tests/fast/driver/test_arguments.py::test_a",
        "tests/fast/driver/test_arguments.py::test_b",
        "tests/fast/models/test_wan.py::test_c[x]",
        "tests/fast/models/test_wan.py::test_d",
        "tests/fast/test_plot.py::test_e",
        "tests/fast/test_dmd2_gan_e2e.py::test_f",
        "tests/fast/test_dmd2_gan_e2e.py::test_g",
    ]
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]
    pytest_collection_modifyitems(None, None, items)
    assert [item.nodeid for item in items] == [
        "tests/fast/test_dmd2_gan_e2e.py::test_f",
        "tests/fast/test_dmd2_gan_e2e.py::test_g",
        "tests/fast/models/test_wan.py::test_c[x]",
        "tests/fast/models/test_wan.py::test_d",
        "tests/fast/driver/test_arguments.py::test_a",
        "tests/fast/driver/test_arguments.py::test_b",
        "tests/fast/test_plot.py::test_e",
    ]
    assert file_seconds("tests/fast/models/test_wan.py::test_d") == FILE_SECONDS["models/test_wan.py"]
    assert file_seconds("tests/fast/test_plot.py::test_e") == 0


def test_xdist_keeps_the_collection_order():
    # xdist sorts the files by their count of tests unless its loadscopereorder option is off.
    with_xdist = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True))
    pytest_configure(with_xdist)
    assert with_xdist.option.loadscopereorder is False
    without_xdist = SimpleNamespace(option=SimpleNamespace())
    pytest_configure(without_xdist)
    assert not hasattr(without_xdist.option, "loadscopereorder")
