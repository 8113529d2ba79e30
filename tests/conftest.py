"""Shared pytest fixtures."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.helpers import PY, RAY_HEAD_CPUS, env, free_port

# Every Ray cluster the suite starts (the session's head, a script's own local one, the Slurm jobs')
# inherits these. Ray's log monitor otherwise lists the log folder ten times a second, its dashboard
# agent samples every worker's process for metrics nobody reads here, and the first driver gets spare
# workers started it never uses: about a third of an idle cluster's CPU, which the two cores share
# with the tests.
for _k, _v in (("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0"), ("RAY_enable_metrics_collection", "0"),
               ("RAY_prestart_worker_first_driver", "0")):
    os.environ.setdefault(_k, _v)
# One torch thread per process, in pytest and in every process it starts (the Ray workers already take
# one, common/cluster/ray_groups.py). The three pytest workers keep both cores busy, so a second thread
# only waits for a core; on the tiny model it also costs more than it splits. Three `train_sft.py
# --max_steps 150` at once on the 2 cores: 42 s with torch's default two threads each, 33 s with one
# (CPU 27 -> 21 s each); one alone: 24 -> 20 s (2026-12-07).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The files that take longest, longest first (seconds of work in `make test` on the 2-core machine,
# 2026-12-07: test_vllm ~600, test_rl ~600, test_sft ~400, test_vllm_lora ~350, test_agents ~230, ...).
# pytest-xdist's --dist loadfile hands a worker one file at a time, and by default in order of their
# number of tests, which put the few-test heavy files (agents, LoRA with vLLM, newcomer) last, where a
# long one kept the suite waiting on one worker; the Makefile passes --no-loadscope-reorder so this order
# holds. Files not listed follow, e2e before unit. The Slurm file (~160 s) comes after the other heavy
# ones: its two-node job starts a second Ray node, whose raylet Ray gives a fixed 30 s to come up, and
# with the three heaviest files started together it missed that three times running (2026-12-07, fresh
# venv). Handed out last of all e2e files, it ran alone for its last ~100 s while the other two workers
# had nothing left (1,252 s against 1,139 and 1,151, 2026-12-07); here it starts ~750-820 s in, beside
# lighter files without vLLM.
HEAVIEST_FIRST = ("e2e/test_rl.py", "e2e/test_vllm.py", "e2e/test_sft.py", "e2e/test_agents.py",
                  "e2e/test_newcomer.py", "e2e/test_rm_dpo.py", "e2e/test_vllm_lora.py", "e2e/test_reliability.py",
                  "e2e/test_loss_agg.py", "e2e/test_lora.py", "e2e/test_wheel.py", "e2e/test_slurm.py")


def pytest_collection_modifyitems(session, config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    rank = {f: i for i, f in enumerate(HEAVIEST_FIRST)}

    def order(item):
        rel = os.path.relpath(str(item.path), here).replace(os.sep, "/")
        return rank.get(rel, len(rank) + (0 if rel.startswith("e2e/") else 1))

    items.sort(key=order)  # stable: each file keeps its own order


@pytest.fixture(scope="session")
def ray_cluster(ray_head):
    """This process connected to the session's `ray_head` cluster, for tests that drive Ray in-process.

    One cluster per pytest worker, not two: a head's own processes (GCS, raylet, log monitor, dashboard
    and its agent, client server, autoscaler monitor) took ~30 CPU-seconds over a whole `make test`
    (2026-12-07, dev/LOG.md), and the suite's clusters live for the whole session (the head's
    RAY_HEAD_CPUS leave room for both kinds of test).
    """
    ray = pytest.importorskip("ray")
    ray.init(address=ray_head, log_to_driver=False)
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
    head = subprocess.Popen([ray_bin, "start", "--head", f"--port={port}", f"--num-cpus={RAY_HEAD_CPUS}", "--include-dashboard=false",
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
