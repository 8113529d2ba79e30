"""The engines' clocks of garbage collection and Triton compiles (common.rollout.engine_clock): in this
process, without an engine."""
import sys
import time
from types import SimpleNamespace


def test_engine_gc_timer_counts_collections_once():
    """The engines report their garbage collector's seconds per generate call (time/engine_gc_s)."""
    import gc

    from common.rollout.engine_clock import _CLOCK, _gc_timer, clock_time_gc

    clock_time_gc()
    clock_time_gc()  # a second engine in the process must not add a second timer
    assert sum(cb is _gc_timer for cb in gc.callbacks) == 1
    before = _CLOCK["gc"]
    cycles = []
    for _ in range(20_000):
        a = []
        a.append(a)
        cycles.append(a)
    del cycles, a
    gc.collect()
    assert _CLOCK["gc"] > before


def test_triton_compile_timer_keeps_the_hooks_it_found(monkeypatch):
    """time/engine_jit_s: the engine times Triton's compiles through its two runtime hooks and still
    calls the hooks set before it (vLLM's JIT monitor), whose answer to skip a compile Triton obeys.
    Triton itself compiles only on a GPU, so its `knobs.runtime` is a stand-in namespace here."""
    from common.rollout import engine_clock

    calls = []
    runtime = SimpleNamespace(jit_cache_hook=lambda **kw: calls.append(("cache", kw["key"])) or kw["key"] == "skip",
                              jit_post_compile_hook=lambda **kw: calls.append(("post", kw["key"])))
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(knobs=SimpleNamespace(runtime=runtime)))
    monkeypatch.setitem(engine_clock._CLOCK, "hooks", (None, None))
    assert engine_clock.clock_time_jit() and engine_clock.clock_time_jit()  # the second call must not wrap our own hooks
    assert runtime.jit_post_compile_hook is engine_clock._jit_after
    m = engine_clock.clock_mark()
    kernel = SimpleNamespace(name="_gumbel_sample_kernel")
    assert not runtime.jit_cache_hook(key="k1", fn=kernel)  # Triton compiles between the two hooks
    time.sleep(0.05)
    runtime.jit_post_compile_hook(key="k1", fn=kernel)
    assert runtime.jit_cache_hook(key="skip", fn=kernel)  # the earlier hook's "skip" reaches Triton
    extra, compiled = engine_clock.clock_since(m, jit=True)
    assert 0.05 <= extra["engine_jit_s"] < 1.0 and compiled == ["_gumbel_sample_kernel"]
    assert calls == [("cache", "k1"), ("post", "k1"), ("cache", "skip")]
    assert "engine_jit_s" not in engine_clock.clock_since(m, jit=False)[0]
