"""DeepSpeed's sleep in the hybrid engine (--deepspeed_enable_sleep): the training states leave the GPU
while vLLM generates and come back for training (OpenRLHF's order, common.rl_run).

A reload behind the training passes was tried (2026-12-02): the weights and gradient buffers first, the
fp32 master and Adam moments in a thread on a CUDA stream of its own while the forward and backward ran,
waited for before the optimizer step. Its numbers were the same, but on the 1.5B shape under ZeRO-3 it
hid the 0.52 s reload and made the training passes 1.1 s slower (docs/performance.md), so the reload
stays one blocking piece.
"""
from __future__ import annotations

import time

import torch


class Sleeper:
    """The trained worker's side of the sleep (a mixin of common.workers.ModelWorker: needs `self.model`)."""

    def offload_states(self) -> float:
        """Optimizer states, gradients, master and bf16 weights to pinned CPU memory; returns seconds."""
        t0 = time.perf_counter()
        self.model.offload_states()
        torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def reload_states(self) -> float:
        """Their way back before training; returns seconds."""
        t0 = time.perf_counter()
        self.model.reload_states()
        return time.perf_counter() - t0
