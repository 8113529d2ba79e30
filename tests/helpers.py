"""Shared test utilities: running the scripts as a user would, and reading their metrics back."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
# Logical CPUs of the session's `ray start` head (tests/conftest.py): a module's in-process engines and the
# scripts its tests run fit beside each other; CPU workers mostly wait on each other.
RAY_HEAD_CPUS = 12


def env() -> dict:
    e = dict(os.environ)
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".venv", "torch_extensions"))
    e["PYTHONUNBUFFERED"] = "1"
    e["COLUMNS"] = "200"  # rich wraps --help at the terminal width
    return e


def wait_for(pred, timeout: float, what: str, show=None):
    """Wait for `pred()` and return it; on a timeout, the message adds `show()`: what was still there."""
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f": {show()}" if show else ""))
        time.sleep(0.2)
    return got


def free_port() -> int:
    """A port free now, for a server started right after (`ray start --port`): the Slurm templates' pick,
    below the ephemeral range (slurm/free_ports.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("free_ports", os.path.join(ROOT, "slurm", "free_ports.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.free_ports(1)[0]


def run(args: list[str], timeout: float = 600, check: bool = True, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repo root (with `extra_env` set); on failure show its output tail."""
    p = subprocess.run(args, cwd=ROOT, env=env() | (extra_env or {}), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args[:3])} ... exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}")
    return p


def script(name: str, *flags: str, **kw) -> subprocess.CompletedProcess:
    return run([PY, os.path.join(ROOT, name), *flags], **kw)


def metrics(save_path: str) -> list[dict]:
    with open(os.path.join(save_path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def last(rows: list[dict], key: str) -> float:
    return [r[key] for r in rows if r.get(key) is not None][-1]
