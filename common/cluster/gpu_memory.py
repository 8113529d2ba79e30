"""What one process holds on its GPU, for the `mem/` metrics that check the memory plan (common.cluster.memory_plan).

Each process measures itself: the trainers' workers (`ModelWorker.gpu_memory`) and each vLLM worker
(`common.rollout.vllm_worker`, by `collective_rpc`). torch's counters give the tensors' peak (allocated) and the
caching allocator's (reserved); the device also holds the CUDA context and libraries' own buffers, which
only the driver counts. Where NVML sees this process (not always inside a container, whose PIDs the
driver does not know), `device_peak_gb` adds that non-torch part to the reserved peak: the process's
own share of what nvidia-smi shows.
"""
from __future__ import annotations

import os
from dataclasses import replace

from common.cluster.memory_estimate import CONTEXT, GiB, plan_memory


def _nvml():
    """pynvml (nvidia-ml-py), or the copy vLLM ships; None when neither imports."""
    try:
        import pynvml
    except ImportError:
        try:
            from vllm.third_party import pynvml
        except ImportError:
            return None
    return pynvml


def _driver_bytes(device_index: int) -> int | None:
    """This process's bytes on the GPU as the driver counts them (None: NVML absent or blind to this PID)."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        nv.nvmlInit()
        handle = nv.nvmlDeviceGetHandleByIndex(device_index)
        procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # no NVML library, or a device index NVML numbers otherwise
        return None
    mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory]
    return mine[0] if mine else None


def measure(reset: bool = True) -> dict:
    """{allocated_gb, peak_gb, peak_reserved_gb[, device_peak_gb]} of this process on its current GPU since
    the last reset ({} without CUDA); `reset` starts the next peak from now."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    out = {"allocated_gb": torch.cuda.memory_allocated() / GiB, "peak_gb": torch.cuda.max_memory_allocated() / GiB,
           "peak_reserved_gb": torch.cuda.max_memory_reserved() / GiB}
    index = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v for v in visible.split(",") if v.strip()]
    physical = int(ids[index]) if index < len(ids) and ids[index].strip().isdigit() else index
    used = _driver_bytes(physical)
    if used is not None:  # context and non-torch buffers now, over the allocator's peak
        out["device_peak_gb"] = (torch.cuda.max_memory_reserved() + max(0, used - torch.cuda.memory_reserved())) / GiB
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return out


def start_history() -> None:
    """HYBRIDRL_MEMORY_SNAPSHOT=folder (a GPU bench's diagnosis, not a user's option): record this process's
    allocations with their Python stacks from now on; `dump_history` writes them out once."""
    import torch

    if os.environ.get("HYBRIDRL_MEMORY_SNAPSHOT") and torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")


def dump_history(name: str, calls: int) -> None:
    """At the `HYBRIDRL_MEMORY_SNAPSHOT_AT`-th call (default 2: one step after the first), the recorded
    history to {folder}/{name}.pickle (dev/probes/mem_peak.py lists what was live at its peak), and stop."""
    import torch

    folder = os.environ.get("HYBRIDRL_MEMORY_SNAPSHOT")
    if not folder or not torch.cuda.is_available() or calls != int(os.environ.get("HYBRIDRL_MEMORY_SNAPSHOT_AT", "2")):
        return
    os.makedirs(folder, exist_ok=True)
    torch.cuda.memory._dump_snapshot(os.path.join(folder, f"{name}.pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)


def combine(parts: list[dict]) -> dict:
    """Several workers' `measure` (an engine's tensor-parallel ranks): the largest of each figure."""
    out: dict = {}
    for p in parts:
        for k, v in (p or {}).items():
            out[k] = max(out.get(k, v), v)
    return out


def mem_metrics(role: str, measured: dict | None, mp, seq: int | None = None) -> dict:
    """`mem/` keys of one process: its measured peaks in GiB (common.cluster.gpu_memory.measure; None: measured here)
    beside the predicted ones (allocated; reserved: what its allocator holds; device: with the CUDA context,
    vLLM's whole share), the prediction redone for `seq`, the step's longest sequence. role "": mem/peak_gb,
    mem/predicted_gb."""
    if measured is None:
        measured = measure(reset=False)
        if not measured:
            return {}
    pre = f"mem/{role}_" if role else "mem/"
    out = {pre + k: v for k, v in measured.items()}
    if mp is not None and mp.job is not None:
        mp = plan_memory(replace(mp.job, seq=seq), mp.gpu_bytes) if seq else mp
        proc = next((p for p in mp.processes if p.process == role), mp.processes[0] if not role else None)
        if proc is not None:
            out[pre + "predicted_gb"] = proc.allocated_peak / GiB
            out[pre + "predicted_reserved_gb"] = (max(proc.phases.values()) - CONTEXT) / GiB  # the allocator's hold
            out[pre + "predicted_device_gb"] = max(proc.phases.values()) / GiB  # and the context: device_peak_gb's
    return out
