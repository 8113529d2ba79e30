"""DeepSpeed's sleep in the hybrid engine (--deepspeed_enable_sleep): the training states leave the GPU
while vLLM generates and come back for training (OpenRLHF's order, common.rl.run).

What leaves is OpenRLHF's choice: the Adam moments, the fp32 master weights, the gradient partitions and
ZeRO-3's reduce buckets; the bf16 weights stay (3B: 5.75 of ~46 GiB, moved twice a step before 2026-12-02).
With --adam_offload OpenRLHF does not sleep at all (its optimizer is in CPU memory already); ours still sends
what DeepSpeed keeps on the GPU there (the weights, the gradients, and with --adam_offload_ratio < 1 the GPU
sub-groups' states stay where DeepSpeed's offload_states leaves them), which is what let a 7B run with the
reference flags fit one H200 (docs/performance.md). tests/*/test_memory_plan.py holds both choices.

A reload behind the training passes was tried (2026-12-02): the weights and gradient buffers first, the
fp32 master and Adam moments in a thread on a CUDA stream of its own while the forward and backward ran,
waited for before the optimizer step. Its numbers were the same, but on the 1.5B shape under ZeRO-3 it
hid the 0.52 s reload and made the training passes 1.1 s slower (dev/LOG.md), so the reload
stays one blocking piece.
"""
from __future__ import annotations

import time


def sleep_states(adam_offload: bool) -> list | None:
    """The DeepSpeed state types `offload_states` moves (None: all of them)."""
    if adam_offload:
        return None
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    return [S.optim_states, S.contiguous_grad_buffer, S.hp_params, S.lp_grads]


class Sleeper:
    """The trained worker's side of the sleep (a mixin of common.rl.workers.ModelWorker: needs `self.model`
    and `self.spec`)."""

    def offload_states(self) -> float:
        """The states above to pinned CPU memory, all copies in flight at once; returns seconds."""
        import torch

        t0 = time.perf_counter()
        self.model.offload_states(include=sleep_states(self.spec.ds.adam_offload), pin_memory=True, non_blocking=True)
        torch.cuda.synchronize()  # the copies are done before vLLM's process may take the memory they leave
        torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def reload_states(self) -> float:
        """Their way back before training; returns seconds."""
        import torch

        t0 = time.perf_counter()
        self.model.reload_states(non_blocking=True)  # ends in a device synchronize when non-blocking
        torch.cuda.synchronize()
        return time.perf_counter() - t0
