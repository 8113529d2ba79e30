"""Shared pytest fixtures."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

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
def ray_cluster(ray_head):
    """This process connected to the suite's `ray_head` cluster, for tests that drive Ray in-process.

    One cluster for the whole suite, not one per test or per pytest worker: an idle Ray cluster's own
    processes (GCS, raylet, autoscaler monitor, client server, dashboard and its agent) take ~7
    CPU-seconds a minute on this machine, and the suite's clusters live for the whole run.
    """
    ray = pytest.importorskip("ray")
    ray.init(address=ray_head, log_to_driver=False)
    yield ray.cluster_resources()
    ray.shutdown()


@contextlib.contextmanager
def _locked(path):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """A `ray start --head` cluster shared by the suite's pytest workers; scripts find it through RAY_ADDRESS.

    The first worker to ask starts it; the last one done stops it (a count in a file next to the workers'
    temp folders, under a lock). `--block` keeps `ray start` in the foreground, so stopping it stops this
    cluster alone: `ray stop` would kill every Ray process on the machine, other sessions' clusters included.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this run
    state = root / "ray_head.json"
    with _locked(root / "ray_head.lock"):
        # a worker that asks after the others were done starts it again, in a folder of its own
        head = json.loads(state.read_text()) if state.exists() else _start_head(Path(tempfile.mkdtemp("", "ray", root)))
        head["users"] += 1
        state.write_text(json.dumps(head))
    os.environ["RAY_ADDRESS"] = head["address"]
    os.environ["RAY_AUTH_MODE"] = "disabled"
    yield head["address"]
    os.environ.pop("RAY_ADDRESS")
    with _locked(root / "ray_head.lock"):
        head = json.loads(state.read_text())
        head["users"] -= 1
        state.write_text(json.dumps(head))
        if head["users"] == 0:
            _stop(head["pid"])
            state.unlink()


def _start_head(temp) -> dict:
    port = free_port()
    ray_bin = os.path.join(os.path.dirname(PY), "ray")
    e = env() | {"RAY_AUTH_MODE": "disabled"}
    with open(temp / "ray_start.log", "w") as log:
        # a session of its own: the worker that starts it may be done before the others
        head = subprocess.Popen([ray_bin, "start", "--head", f"--port={port}", f"--num-cpus={RAY_HEAD_CPUS}",
                                 "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}", "--block"],
                                env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 120
    while "Ray runtime started" not in (temp / "ray_start.log").read_text():
        if head.poll() is not None or time.time() > deadline:
            head.kill()
            raise RuntimeError(f"ray start failed:\n{(temp / 'ray_start.log').read_text()[-3000:]}")
        time.sleep(0.5)
    return {"address": f"127.0.0.1:{port}", "pid": head.pid, "users": 0}


def _stop(pid: int) -> None:
    """SIGTERM: `ray start --block` then stops the processes it started; SIGKILL after 60 s."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 60
    while _alive(pid):
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    try:
        os.waitpid(pid, os.WNOHANG)  # ours to reap when this worker started it
    except ChildProcessError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
