"""Clocks of an engine's process, read per generate call by common.rollout.vllm_engine."""
from __future__ import annotations

import time

# What an engine's process spends its time on besides generating: garbage collection and Triton kernel
# compiles, summed per process (however many engines it holds) and read per generate call. A small model's
# generation is bound by the engine's host work per decode step, so a call that collected garbage, or
# compiled a kernel for a shape it had not seen (tenths of a second each), shows as a slow step; these
# clocks say which it was (`time/engine_gc_s`, `time/engine_jit_s`).
_CLOCK = {"gc": 0.0, "gc_t0": 0.0, "jit": 0.0, "jit_t0": 0.0, "kernels": [], "hooks": (None, None)}


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        _CLOCK["gc_t0"] = time.perf_counter()
    else:
        _CLOCK["gc"] += time.perf_counter() - _CLOCK["gc_t0"]


def clock_time_gc() -> None:
    import gc

    if _gc_timer not in gc.callbacks:  # once per process
        gc.callbacks.append(_gc_timer)


def _jit_before(**kw):
    _CLOCK["jit_t0"] = time.perf_counter()
    before = _CLOCK["hooks"][0]
    return before(**kw) if before else None  # a true answer makes Triton skip the compile


def _jit_after(**kw):
    _CLOCK["jit"] += time.perf_counter() - _CLOCK["jit_t0"]
    _CLOCK["kernels"].append(str(getattr(kw.get("fn"), "name", "?")))
    after = _CLOCK["hooks"][1]
    return after(**kw) if after else None


def clock_time_jit() -> bool:
    """Time Triton's compiles in this process, keeping the hooks already set (vLLM's JIT monitor
    warns through them); False without Triton (CPU)."""
    try:
        from triton import knobs

        rt = knobs.runtime
        if rt.jit_post_compile_hook is not _jit_after:
            _CLOCK["hooks"] = (rt.jit_cache_hook, rt.jit_post_compile_hook)
            rt.jit_cache_hook, rt.jit_post_compile_hook = _jit_before, _jit_after
        return True
    except (ImportError, AttributeError):
        return False


def clock_mark() -> tuple:
    return time.perf_counter(), time.process_time(), _CLOCK["gc"], _CLOCK["jit"], len(_CLOCK["kernels"])


def clock_since(m: tuple, jit: bool) -> tuple[dict, list[str]]:
    """Seconds since `clock_mark()`: wall, CPU, GC (and Triton compiles when timed), with the kernels compiled."""
    t, c, g, j, k = m
    out = {"engine_generate_s": time.perf_counter() - t, "engine_cpu_s": time.process_time() - c,
           "engine_gc_s": _CLOCK["gc"] - g}
    if jit:
        out["engine_jit_s"] = _CLOCK["jit"] - j
    return out, _CLOCK["kernels"][k:]
