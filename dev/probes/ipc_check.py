"""Does CUDA IPC work from memory in expandable segments? (GPU; a check before the runs that need it.)

    python dev/probes/ipc_check.py     # prints "ipc with expandable segments: ok" and exits 0, or says what failed

The DeepSpeed workers allocate with PyTorch's expandable_segments (common.training.ds.use_expandable_segments), and the
actor hands its weight buckets to a vLLM engine on the same GPU by CUDA IPC (common.rollout.weight_sync.share). This
shares buckets the way the actor does, several per segment and the same one twice (PyTorch issue 198305: a
segment's handle differs between calls), to a process without expandable segments, as vLLM's is, which checks
every value. If it fails, run with HYBRIDRL_EXPANDABLE_SEGMENTS=0.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _child(handles, expected, q):
    try:
        from common.rollout.weight_sync import open_shared

        got = [float(open_shared(h).float().sum()) for h in handles]
        q.put(("ok", [abs(g - e) <= 1e-3 * max(1.0, abs(e)) for g, e in zip(got, expected)]))
    except Exception as e:  # noqa: BLE001  (report whatever broke)
        q.put(("error", f"{type(e).__name__}: {e}"))


def main() -> int:
    import torch
    import torch.multiprocessing as mp

    from common.training import ds
    from common.rollout.weight_sync import share

    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    assert ds.use_expandable_segments(), "no GPU here"
    torch.manual_seed(0)
    flats = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (128 * 2**20, 64 * 2**20, 3 * 2**20, 128 * 2**20)]
    handles = [share(f) for f in flats] + [share(flats[0])]  # the last: the first bucket's segment again
    expected = [float(f.float().sum()) for f in flats] + [float(flats[0].float().sum())]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    os.environ["HYBRIDRL_EXPANDABLE_SEGMENTS"] = "0"  # the child allocates as vLLM does
    p = ctx.Process(target=_child, args=(handles, expected, q))
    p.start()
    status, detail = q.get(timeout=120)
    p.join(timeout=30)
    if status == "ok" and all(detail):
        print("ipc with expandable segments: ok")
        return 0
    print(f"ipc with expandable segments: FAILED ({detail}); run with HYBRIDRL_EXPANDABLE_SEGMENTS=0")
    return 1


if __name__ == "__main__":
    sys.exit(main())
