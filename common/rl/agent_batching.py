"""Continuous batching of agent turns over the vLLM engines (`TurnBatcher`): the driver side of
`VllmEngine.serve`. common.rl.agent runs the episodes; each turn it asks for goes through here."""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import time
import types

from common.errors import TrainingError, one_line


class _Logprob:
    __slots__ = ("logprob",)

    def __init__(self, value: float):
        self.logprob = value


_IDS = itertools.count()  # request ids unique in this process: runs (training, evaluation) may share engines


class TurnBatcher:
    """Continuous batching of the episodes' turns over the engines (VllmEngine.serve).

    Episode k runs on engine k % E, so its turns meet its own prefix in that engine's cache. A turn joins its
    engine's running batch at once when the engine is busy: the driver keeps up to `PIPELINE` serve calls
    queued on each engine (a call steps the engine for at most `slice_s`, or until a request ends), so the
    engine never waits on the driver's round trip and a slow environment holds back only its own episode. An
    idle engine first waits until all its live episodes ask, or `window_s` after the first one asks, so that
    the first turns start as one batch."""

    PIPELINE = 2

    def __init__(self, engines: list, tokenizer, jobs: int, window_s: float, timeout_s: float,
                 slice_s: float = 0.05):
        self.engines, self.tokenizer = engines, tokenizer
        self.window_s, self.timeout_s, self.slice_s = window_s, timeout_s, slice_s
        e = len(engines)
        self.live = [len(range(i, jobs, e)) for i in range(e)]  # live episodes per engine
        self.pending: list[list] = [[] for _ in range(e)]       # (request, future, time asked) not sent yet
        self.running: list[dict] = [{} for _ in range(e)]       # request id -> future, sent, not answered
        self.calls: list[list] = [[] for _ in range(e)]         # (ref, time sent) of serve calls in flight
        self.cv = threading.Condition()
        self.failed: BaseException | None = None
        self.batches = 0  # serve calls that carried new turns
        self.client = f"agent-{os.getpid()}-{next(_IDS)}"  # the engine returns this batcher's turns only
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(e)]
        for t in self.threads:
            t.start()

    def request(self, slot: int, ids: list[int], params, seed: int) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        r = {"id": f"agent-{os.getpid()}-{next(_IDS)}", "ids": ids, "max_tokens": params.max_tokens,
             "seed": seed, "temperature": params.temperature, "top_p": params.top_p, "logprobs": True}
        with self.cv:
            if self.failed is not None:
                fut.set_exception(self.failed)
                return fut
            self.pending[slot % len(self.engines)].append((r, fut, time.perf_counter()))
            self.cv.notify_all()
        return fut

    def finished(self, slot: int) -> None:
        with self.cv:
            self.live[slot % len(self.engines)] -= 1
            self.cv.notify_all()

    def _ready(self, i: int) -> bool:
        """Whether engine i's thread sends a serve call now (the lock held)."""
        pending, running, calls = self.pending[i], self.running[i], self.calls[i]
        if len(calls) >= self.PIPELINE:
            return False
        if running or calls:  # busy: new turns join at once, and running ones need steps
            return bool(pending) or bool(running)
        return bool(pending) and (len(pending) >= self.live[i]
                                  or time.perf_counter() - pending[0][2] >= self.window_s)

    def _loop(self, i: int) -> None:
        engine = self.engines[i]
        while True:
            with self.cv:
                while self.failed is None and not self._ready(i):
                    if self.live[i] <= 0 and not (self.pending[i] or self.running[i] or self.calls[i]):
                        return
                    late = [t for _, t in self.calls[i] if time.perf_counter() - t > self.timeout_s]
                    if late:
                        self._fail(TrainingError(f"vLLM serve: no answer within {self.timeout_s:.0f} s "
                                                f"(engine {i})"))
                        break
                    self.cv.wait(timeout=self.window_s / 4 if self.pending[i] else 1.0)
                if self.failed is not None:
                    return
                batch, self.pending[i] = self.pending[i], []
                for r, fut, _ in batch:
                    self.running[i][r["id"]] = fut
                if batch:
                    self.batches += 1
                try:
                    ref = engine.serve.remote([r for r, _, _ in batch], self.slice_s, self.client)
                except BaseException as e:
                    self._fail(TrainingError(f"vLLM serve (engine {i}): {one_line(e)}"))
                    return
                call = (ref, time.perf_counter())
                self.calls[i].append(call)
            ref.future().add_done_callback(lambda f, i=i, call=call: self._answered(i, call, f))

    def _answered(self, i: int, call, f) -> None:
        try:
            done = f.result()
        except BaseException as e:  # the engine failed: every waiting and later episode gets it
            from common.cluster.ray_groups import describe_failure

            with self.cv:
                self._fail(TrainingError(f"vLLM serve (engine {i}): {describe_failure(e)}"))
            return
        with self.cv:
            self.calls[i].remove(call)
            futures = [(self.running[i].pop(d["id"]), d) for d in done if d["id"] in self.running[i]]
            self.cv.notify_all()
        for fut, d in futures:
            action = d["token_ids"]
            out = types.SimpleNamespace(
                token_ids=action, text=self.tokenizer.decode(action, skip_special_tokens=True),
                finish_reason="length" if d["truncated"] else "stop",
                logprobs=[{t: _Logprob(lp)} for t, lp in zip(action, d["logprobs"])])
            fut.set_result(types.SimpleNamespace(outputs=[out], version=d["version"]))

    def _fail(self, e: BaseException) -> None:
        """(the lock held) Every waiting and later request gets `e`."""
        if self.failed is None:
            self.failed = e
        futures = [f for p in self.pending for _, f, _ in p] + [f for r in self.running for f in r.values()]
        for p in self.pending:
            p.clear()
        for r in self.running:
            r.clear()
        for f in futures:
            if not f.done():
                f.set_exception(e)
        self.cv.notify_all()
