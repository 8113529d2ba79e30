"""Which processes the run's watcher ends once its driver has gone (common/cluster/ray_local.py): its
cluster's, found three ways, and never a bystander that only reads a log in the run's folder."""
import os
import subprocess
import sys
import time

import pytest

from common.cluster import ray_local

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watcher reads /proc")


def test_the_watcher_ends_the_runs_processes_and_leaves_a_reader_of_its_logs(tmp_path):
    # The run's folder under a folder called ray: a path that names ray is not what makes a process Ray's.
    temp = tmp_path / "ray" / "ray-hybridrl-1"
    logs = temp / "session_1" / "logs"
    logs.mkdir(parents=True)
    (logs / "worker-1.out").write_text("started\n")
    fake_pkg = tmp_path / "site-packages" / "ray" / "_private"
    fake_pkg.mkdir(parents=True)
    (fake_pkg / "log_monitor.py").write_text("import time\ntime.sleep(60)\n")
    mark = "1-abcd"
    env = {k: v for k, v in os.environ.items() if k != ray_local.MARK}
    procs = {
        # what the driver started: its environment carries the mark
        "marked": subprocess.Popen(["sleep", "60"], env={**env, ray_local.MARK: mark}),
        # what Ray started with a title over its environment: its output goes to the session's logs
        "logging": subprocess.Popen(["bash", "-c", 'exec sleep 60 >>"$0" 2>&1', str(logs / "worker-1.out")], env=env),
        # a program of the ray package that names the run's folder (raylet, log monitor, dashboard)
        "ray program": subprocess.Popen([sys.executable, str(fake_pkg / "log_monitor.py"), f"--logs-dir={logs}"],
                                        env=env),
        # Ray's agents: a `ray::` title, neither the mark nor their output in the folder, its log files open
        "ray agent": subprocess.Popen(["bash", "-c", 'exec -a "ray::DashboardAgent" sleep 60 3>>"$0"',
                                       str(logs / "dashboard_agent.log")], env=env, stdout=subprocess.DEVNULL),
        # a user following a worker's log: the folder in its command line and a file of it open
        "reader": subprocess.Popen(["tail", "-f", str(logs / "worker-1.out")], env=env, stdout=subprocess.DEVNULL),
        # the same mark's text in another variable, and another run's folder: not this run
        "other run": subprocess.Popen(["sleep", "60"], env={**env, "X": f"{ray_local.MARK}={mark}",
                                                            ray_local.MARK: "2-ffff"}),
    }
    try:
        time.sleep(0.5)  # tail has opened its file
        found = set(ray_local.run_processes(mark, str(temp)))
        named = {name for name, p in procs.items() if p.pid in found}
        assert named == {"marked", "logging", "ray program", "ray agent"}, named
        ray_local._stop(mark, str(temp), timeout_s=5)
        assert [name for name, p in procs.items() if p.poll() is None] == ["reader", "other run"]
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
