"""Fixtures shared by the fast tests: one Ray cluster for the session, started on first use; and the order in which
pytest-xdist hands the test files to its workers."""

import pytest

from tests.support.ray import export_test_environment, ray_session

export_test_environment()

# Seconds each of the slowest test files took (the sum of its tests' setup, call and teardown), from `--durations` of
# `.ci/run` at b02f1df on the 2-core machine while other sessions' tests ran beside it (docs/performance.md, "The test
# suite"; files outside its 25 slowest tests from earlier runs). With `-n 2 --dist loadfile` each file runs whole on
# one worker; handing them out longest first (the LPT rule) keeps a long file from starting last on one worker while
# the other has nothing left. The files not listed follow in collection order. The figures only order the files: a
# stale one costs balance, never a test.
FILE_SECONDS = {
    "test_dmd2_gan_e2e.py": 750,
    "test_dmd2_e2e.py": 430,
    "test_recipes.py": 360,
    "models/test_flux2.py": 345,
    "test_faults.py": 330,
    "benchmarks/test_gpu_check.py": 315,
    "models/test_qwen_image.py": 285,
    "models/test_sd3_stock_export.py": 215,
    "test_train_diffusion.py": 200,
    "models/test_flux.py": 200,
    "test_family_recipes.py": 190,
    "models/test_family_plugin.py": 190,
    "models/test_wan.py": 145,
    "backends/fsdp_utils/test_actor.py": 140,
    "test_keep_best_e2e.py": 125,
    "test_multinode.py": 120,
    "test_dmd2_lora_e2e.py": 110,
    "driver/test_bad_inputs.py": 100,
    "test_pinned_figures.py": 90,
    "backends/fsdp_utils/test_mixed_precision.py": 80,
    "test_dmd2_reward_e2e.py": 75,
    "driver/test_evaluation.py": 60,
    # Files added after that run, from their authors' runs under load (an ordering guess until the next CI run).
    "models/test_qwen_image_edit.py": 360,
    "models/test_wan_experts.py": 200,
    "models/test_teacher_lora.py": 170,
    "models/test_wan22_ti2v.py": 150,
    "backends/fsdp_utils/test_context_parallel.py": 80,
}


def pytest_configure(config):
    # pytest-xdist's loadfile schedule sorts the files by their count of tests unless told to keep the collection
    # order, which pytest_collection_modifyitems below sets. The option exists only with xdist loaded.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def file_seconds(nodeid: str) -> float:
    """The :data:`FILE_SECONDS` figure of the test file of ``nodeid`` (``tests/fast/models/test_wan.py::test_x``),
    0 for a file not listed."""
    path = nodeid.split("::", 1)[0]
    return FILE_SECONDS.get(path.split("tests/fast/", 1)[-1], 0)


def pytest_collection_modifyitems(session, config, items):
    # Stable: the tests of a file keep their order, and so do the files not listed. Every xdist worker collects the
    # same order, as the controller requires.
    items.sort(key=lambda item: -file_seconds(item.nodeid))


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray cluster (4 CPUs): tests share it instead of starting one each (2–3 s apiece).

    ``train_diffusion.main`` joins it when it finds Ray initialised, and ends only the actors and placement groups
    it started."""
    with ray_session(num_cpus=4) as ray:
        yield ray
