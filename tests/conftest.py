"""Shared pytest fixtures."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.helpers import PY, env, free_port


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


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """A `ray start --head` cluster for the session; scripts find it through RAY_ADDRESS.

    `--block` keeps `ray start` in the foreground, so the teardown can stop this cluster alone:
    `ray stop` would kill every Ray process on the machine, other sessions' clusters included.
    """
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    ray_bin = os.path.join(os.path.dirname(PY), "ray")
    e = env() | {"RAY_AUTH_MODE": "disabled"}
    log = open(temp / "ray_start.log", "w+")
    head = subprocess.Popen([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=8", "--include-dashboard=false",
                             "--disable-usage-stats", f"--temp-dir={temp}", "--block"],
                            env=e, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while "Ray runtime started" not in (temp / "ray_start.log").read_text():
        if head.poll() is not None or time.time() > deadline:
            head.kill()
            raise RuntimeError(f"ray start failed:\n{(temp / 'ray_start.log').read_text()[-3000:]}")
        time.sleep(0.5)
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    os.environ["HYBRIDRL_TEST_RAY_HEAD_PID"] = str(head.pid)  # whose process tree holds this cluster's workers
    os.environ["RAY_AUTH_MODE"] = "disabled"
    yield os.environ["RAY_ADDRESS"]
    os.environ.pop("RAY_ADDRESS")
    head.terminate()  # SIGTERM: `ray start --block` then stops the processes it started
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()
    log.close()
