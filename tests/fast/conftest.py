"""Fixtures shared by the fast tests: one Ray cluster for the session, started on first use."""

import pytest

from tests.support.ray import export_test_environment, ray_session

export_test_environment()


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray cluster (4 CPUs): tests share it instead of starting one each (2–3 s apiece).

    ``train_diffusion.main`` joins it when it finds Ray initialised, and ends only the actors and placement groups
    it started."""
    with ray_session(num_cpus=4) as ray:
        yield ray
