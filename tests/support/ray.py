"""One local Ray cluster for the whole test session (``tests/fast/conftest.py`` starts it on first use).

Ray workers import the test hooks of :mod:`tests.support.trainer` and :mod:`tests.support.rollout` by dotted path, so
the repository root goes on the ``PYTHONPATH`` of every process Ray starts (the raylet inherits this process's
environment).
"""

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# How often the session cluster may try to start (see ray_session).
START_ATTEMPTS = 3
# What every Ray worker of the tests sees: offline Hugging Face, one intra-op thread, no auth on the local cluster. A
# driver run by the tests reads OMP_NUM_THREADS too and caps each rank's threads at it (placement_group.rank_threads):
# the session's cluster declares 4 CPUs on a 2-core machine, whose 2 threads per rank would oversubscribe the cores.
WORKER_ENV = {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def export_test_environment() -> None:
    """Put the repository root on ``PYTHONPATH`` and the worker settings into this process's environment."""
    os.environ.update(WORKER_ENV)
    paths = [str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


@contextmanager
def ray_session(num_cpus: int = 4):
    """A local Ray cluster (no dashboard, private temp dir), shut down and removed on exit."""
    import ray

    export_test_environment()
    # Unix socket paths are limited to ~107 bytes: keep the temp dir short.
    temp_dir = tempfile.mkdtemp(prefix="ray_", dir="/tmp")
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, logging_level="WARNING")
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
            # Ray 2.60 waits a hard-coded 30 s for its raylet to register; on a machine loaded by other jobs that can
            # pass before the node is up. A fresh start is all it needs; any other failure is real.
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == START_ATTEMPTS:
                raise
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
