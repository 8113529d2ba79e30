"""Shared pytest fixtures."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session (starting one costs ~6 s).

    8 logical CPUs on a 2-core machine: CPU workers of a test mostly wait on each other.
    address="local" so a `ray start` cluster on the same machine is never picked up by mistake.
    """
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray.cluster_resources()
    ray.shutdown()
