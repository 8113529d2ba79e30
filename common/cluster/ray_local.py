"""A local Ray cluster that goes away with the driver that started it, however the driver ends.

Ray starts its GCS and raylet with PR_SET_PDEATHSIG, so those die with the driver, but not the
raylet's children: after a SIGKILL of a driver, `ray::DashboardAgent` and `ray::RuntimeEnvAgent`
ran on for minutes. So `start_watcher()` (called by `common.cluster.ray_groups.init_ray` just before it
starts a cluster of its own) runs this file as a small process in a session of its own (a
terminal's Ctrl-C does not reach it) that waits for the driver's exit and then ends every process
of that cluster: SIGTERM, then SIGKILL a second later for what is still there.

The cluster's processes are told apart from any other Ray on the machine (other runs, the test
suite's cluster, a `ray start` cluster) by a mark in their environment, which all of them inherit
from the driver, and by the run's own temp folder (`ray-hybridrl-<pid>`, in RAY_TMPDIR or /tmp):
their stdout or stderr is a log file in there (Ray points what it starts, and so their children, at
the session's logs), or a Ray program (`ray::DashboardAgent`, the raylet) names the folder in its
command line or holds a file of it open. A process that only reads a file in there (a user's
`tail -f` of a worker's log) is not the run's and is left alone. The temp folder is removed
after a driver that exited (its `atexit` ran) and kept, with Ray's logs, after a kill. A driver
that joins an existing cluster (RAY_ADDRESS, `ray job submit`, `ray start`) starts no watcher:
that cluster is not its to stop.

    python common/cluster/ray_local.py <driver pid> <mark> <temp folder>      # what start_watcher runs
"""
from __future__ import annotations

import atexit
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time

MARK = "HYBRIDRL_RAY_RUN"  # environment variable every process of the run's cluster inherits


def start_watcher() -> str:
    """Mark this process's environment, start the watcher; return the temp folder for `ray.init`."""
    mark = f"{os.getpid()}-{secrets.token_hex(4)}"
    os.environ[MARK] = mark
    temp = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), f"ray-hybridrl-{os.getpid()}")
    if sys.platform.startswith("linux"):  # /proc and pidfd; elsewhere Ray's own clean-up is all there is
        # -I: neither common/ (whose module names could shadow the standard library's) nor PYTHONPATH
        subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), mark, temp],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
        atexit.register(_mark_exited, temp)  # registered before ray.init: runs after Ray's own shutdown
    return temp


def _mark_exited(temp: str) -> None:
    try:
        open(os.path.join(temp, ".exited"), "w").close()
    except OSError:  # Ray never made the folder
        pass


def run_processes(mark: str, temp: str) -> list[int]:
    """Live processes of the run's cluster (not this one): the mark in their environment, or (a process
    title can overwrite the environment's memory) stdout or stderr in the temp folder, or a Ray program
    with the folder in its command line or a file of it open."""
    needle, folder, me = f"{MARK}={mark}".encode(), temp.encode(), os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                ours = needle in f.read().split(b"\0")
            if not ours:
                ours = any(_fd_path(name, fd).startswith(temp + "/") for fd in (1, 2))
            if not ours:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
                # Ray's agents run with neither the mark nor their output in the folder, only its log files open
                ours = _is_ray(args, folder) and (any(folder in a for a in args) or any(
                    _fd_path(name, int(fd)).startswith(temp + "/") for fd in os.listdir(f"/proc/{name}/fd")))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if ours:
            found.append(int(name))
    return found


def _fd_path(pid: str, fd: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:  # closed
        return ""


def _is_ray(args: list[bytes], folder: bytes) -> bool:
    """A Ray process by its command line: a `ray::` title, or a program or script of the ray package
    (raylet, gcs_server, log_monitor.py, `-m ray...`); the run's folder is left out of the test, as it
    may itself sit under a folder called ray."""
    if args[0].startswith(b"ray::"):
        return True
    head = [a.replace(folder, b"") for a in args[:3]]
    return any(b"/ray/" in a or a.startswith(b"ray.") or a == b"ray" for a in head)


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (Python < 3.9, Linux < 5.3): poll
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.5)
        return
    select.select([fd], [], [])


def _stop(mark: str, temp: str, timeout_s: float = 20.0) -> None:
    # 20 s: a busy machine slows the scans of /proc and the exits; the loop ends as soon as none is left
    termed: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = run_processes(mark, temp)
        if not pids:
            return
        now = time.monotonic()
        for pid in pids:
            sig = signal.SIGTERM if pid not in termed else signal.SIGKILL if now - termed[pid] > 1.0 else None
            if sig is not None:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
                termed.setdefault(pid, now)
        time.sleep(0.2)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pid, mark, temp = int(argv[1]), argv[2], argv[3]
    _wait_for_exit(pid)
    # A driver that exits normally has stopped its cluster already (ray.shutdown at exit): what is
    # left now is what it could not stop, or everything after a SIGKILL.
    _stop(mark, temp)
    if os.path.exists(os.path.join(temp, ".exited")):
        shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv)
