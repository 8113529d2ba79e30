"""Shared pytest fixtures."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.helpers import PY, env, free_port

# The files that take longest, longest first (seconds of work in `make test` on the 2-core machine,
# 2026-12-06: test_slurm ~900, test_rl ~600, test_vllm ~500, test_sft ~400, test_agents ~250, ...).
# pytest-xdist's --dist loadfile hands a worker one file at a time, and by default in order of their
# number of tests, which put the few-test heavy files (agents, LoRA with vLLM, newcomer) last, where a
# long one kept the suite waiting on one worker; the Makefile passes --no-loadscope-reorder so this order
# holds. Files not listed follow, e2e before unit. The Slurm file goes last of the e2e files, though it is
# the heaviest: its two-node job starts a second Ray node, whose raylet Ray gives a fixed 30 s to come up,
# and with the three heaviest files started together it missed that three times running (2026-12-07,
# fresh venv); at the end it shares the cores with the tail of the others and the unit tests.
LAST = ("e2e/test_slurm.py",)
HEAVIEST_FIRST = ("e2e/test_rl.py", "e2e/test_vllm.py", "e2e/test_sft.py", "e2e/test_agents.py",
                  "e2e/test_newcomer.py", "e2e/test_rm_dpo.py", "e2e/test_vllm_lora.py", "e2e/test_reliability.py",
                  "e2e/test_loss_agg.py", "e2e/test_lora.py", "e2e/test_wheel.py")


def pytest_collection_modifyitems(session, config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    rank = {f: i for i, f in enumerate(HEAVIEST_FIRST)}

    def order(item):
        rel = os.path.relpath(str(item.path), here).replace(os.sep, "/")
        if rel in LAST:
            return len(rank) + 1
        return rank.get(rel, len(rank) + (0 if rel.startswith("e2e/") else 2))

    items.sort(key=order)  # stable: each file keeps its own order


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
