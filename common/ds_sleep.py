"""DeepSpeed's sleep in the hybrid engine (--deepspeed_enable_sleep): the training states leave the GPU
while vLLM generates, and come back for training, the reload behind the passes that run meanwhile.

The reload moves every state back before training (3B, ZeRO-3: ~46 GiB in ~1.1 s, docs/performance.md),
but the training forward needs only the bf16 weights and the backward only the gradient buffers: the
fp32 master weights and the Adam moments, three quarters of it, are read by the optimizer step alone.
So under ZeRO-3 `Reload` copies in a thread of its own, on a CUDA stream of its own, in two parts: the
weights and gradient buffers first, then the master and moments; the trainer waits for the first part
before its first forward and for the second before the optimizer step, and meanwhile runs the
reference's forward (in this process, common.guests) and its own forward and backward. The copies are
DeepSpeed's own `reload_states`, asked for one part at a time; the numbers are the same as a reload in
one piece (bench/ds_sleep_overlap.py checks it on a GPU). HYBRIDRL_OVERLAP_RELOAD=0 reloads in one
blocking piece.
"""
from __future__ import annotations

import os
import threading
import time

import torch


def _late_states():
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    return {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}  # read by the optimizer step only


def overlaps(engine) -> bool:
    """Whether `engine`'s reload can run behind the training passes: ZeRO-3 on a GPU (ZeRO-1/2 links its
    master and bf16 weights to each other on reload, so they come back together there)."""
    return os.environ.get("HYBRIDRL_OVERLAP_RELOAD", "0") == "1" and torch.cuda.is_available() \
        and engine.zero_optimization_stage() == 3


class Reload:
    """`engine.reload_states()` started now, in two parts (see the module's docstring)."""

    def __init__(self, engine):
        self.engine, self.error, self.seconds = engine, None, None
        self.first = threading.Event()
        self.waited = 0.0
        self._t0, self._device = time.perf_counter(), torch.cuda.current_device()
        self._thread = threading.Thread(target=self._run, name="ds-reload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        opt = self.engine.optimizer
        late = _late_states() & opt.offloaded_states
        try:
            torch.cuda.set_device(self._device)  # a thread's CUDA device is its own: DeepSpeed reloads onto it
            with torch.cuda.stream(torch.cuda.Stream()):
                opt.offloaded_states -= late  # DeepSpeed reloads what this set names: the weights, gradients first
                self.engine.reload_states(non_blocking=True)  # ends in a device synchronize: the copies are done
                opt.offloaded_states |= late
                self.first.set()
                self.engine.reload_states(non_blocking=True)
        except BaseException as e:  # raised to the trainer by the next wait
            opt.offloaded_states |= late
            self.error = e
        finally:
            self.seconds = time.perf_counter() - self._t0
            self.first.set()

    def _wait(self, done) -> None:
        t0 = time.perf_counter()
        done()
        self.waited += time.perf_counter() - t0
        if self.error is not None:
            raise RuntimeError(f"DeepSpeed's reload of the training states failed: {self.error!r}") from self.error

    def weights(self) -> None:
        """Wait until the weights and gradient buffers are back (before a forward)."""
        self._wait(self.first.wait)

    def all(self) -> None:
        """Wait until every state is back (before the optimizer step, and before anything else)."""
        self._wait(self._thread.join)


def reload(engine) -> tuple[Reload | None, float]:
    """(a Reload still under way, or None, the seconds this call blocked) for the engine's offloaded states."""
    if overlaps(engine):
        return Reload(engine), 0.0
    t0 = time.perf_counter()
    engine.reload_states()
    return None, time.perf_counter() - t0


def offload(engine) -> float:
    """DeepSpeed sleep: optimizer states, gradients, master and bf16 weights to pinned CPU memory; seconds."""
    t0 = time.perf_counter()
    torch.cuda.synchronize()  # the side stream's tensors are freed now: nothing in flight may still read them
    engine.offload_states()
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


class Sleeper:
    """The trained worker's side of the sleep (a mixin of common.workers.ModelWorker: needs `self.model`)."""

    _reload: Reload | None = None

    def offload_states(self) -> float:
        """Optimizer states, gradients, master and bf16 weights to CPU memory; returns seconds."""
        self._settled()
        return offload(self.model)

    def reload_states(self) -> float:
        """Their way back; under ZeRO-3 behind the passes that follow: the seconds this call blocked."""
        self._reload, blocked = reload(self.model)
        return blocked

    def _settled(self, part: str = "all") -> None:
        """Wait for a reload under way: "weights" before a forward, "all" before the step or anything else."""
        if self._reload is not None:
            getattr(self._reload, part)()

    def reload_timing(self) -> dict:
        """The last reload's seconds in all and those the passes waited for it ({} if it blocked its call)."""
        r, self._reload = self._reload, None
        if r is None:
            return {}
        r.all()
        return {"time/reload_copy_s": r.seconds, "time/reload_wait_s": r.waited}
