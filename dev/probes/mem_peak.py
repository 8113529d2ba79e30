"""What a process held on the GPU at its peak, from a memory history (HYBRIDRL_MEMORY_SNAPSHOT, common.cluster.gpu_memory).

    HYBRIDRL_MEMORY_SNAPSHOT=/tmp/snap python train_grpo.py ...   # each worker dumps /tmp/snap/{role}-rank{r}.pickle
    python dev/probes/mem_peak.py /tmp/snap/actor-rank0.pickle --top 25

Replays the allocations and frees torch recorded and, at the moment the allocated bytes peaked, groups the
live tensors by the first frame of ours, DeepSpeed's, transformers' or torch's own modules that made them
(the innermost such frame), largest first. Small text, so it can come back from a GPU machine.
"""
from __future__ import annotations

import pickle
import sys

import typer

OURS = ("/common/", "/train_", "/deepspeed/", "/transformers/", "/torch/")


def _where(frames: list[dict]) -> str:
    for f in frames:  # innermost first
        if any(k in f["filename"] for k in OURS) and "/torch/cuda/memory.py" not in f["filename"]:
            name = f["filename"].split("/site-packages/")[-1].split("/main/")[-1]
            return f"{name}:{f['line']} {f['name']}"
    return "(no frame recorded)"


def main(path: str, top: int = 25, device: int = 0):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][device]
    live, total, peak, at = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at = total, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    groups: dict[str, list[int]] = {}
    for e in at.values():
        g = groups.setdefault(_where(e.get("frames", [])), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    print(f"{path}: allocated peak {peak / 2**30:.2f} GiB over the recorded history ({len(trace)} events), "
          f"{len(at)} tensors live then; reserved in segments at the dump: "
          f"{sum(s['total_size'] for s in snap['segments']) / 2**30:.2f} GiB")
    for where, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {size / 2**30:8.3f} GiB  {n:6d} tensors  {where}")


if __name__ == "__main__":
    sys.exit(typer.run(main))
