"""The --async_train queue (common/rollout/queue.py) against a fake engine that records which weights
generated what: bounded staleness, the synchronous loop at depth 0, checkpoints as barriers that make
a resumed run regenerate its in-flight rollouts exactly."""
from __future__ import annotations

import pytest

from common.data.rows import iterate_batches
from common.rollout.samples import Samples
from common.rollout.queue import RolloutQueue, rollout_version, staleness


class FakeEngine:
    """Generates in call order, as a Ray actor runs its calls; `weights` is the version last synced."""

    def __init__(self, weights: int = 0):
        self.weights, self.calls = weights, []

    def submit(self, prompts, seed, logprobs):
        made_by = self.weights  # a call made before the next sync runs with these weights
        self.calls.append(("generate", seed, made_by))
        return lambda: Samples([[1]] * len(prompts), [[2]] * len(prompts), list(range(len(prompts))),
                               [False] * len(prompts), extra={"made_by": made_by, "seed": seed, "prompts": prompts})


def _run(depth: int, save_steps: int, start: int, total: int, n_prompts: int = 40, batch: int = 4):
    """The scripts' loop shape: take, train, settle, sync; per step (made_by, seed, prompts, staleness)."""
    engine = FakeEngine(weights=start)
    epoch, in_epoch = divmod(start, n_prompts // batch)
    q = RolloutQueue(engine.submit, iterate_batches(n_prompts, batch, 0, epoch, in_epoch), list(range(n_prompts)),
                     depth=depth, save_steps=save_steps, start=start, total=total, seed=lambda j: 1000 + j,
                     logprobs=lambda j: True)
    out = []
    for step in range(start, total):
        r = q.take(step)
        s = r.samples
        assert s.versions == [s.extra["made_by"]] * len(s) and r.version == s.extra["made_by"]
        out.append((s.extra["made_by"], s.extra["seed"], s.extra["prompts"], staleness(s.versions, step)))
        q.settle()
        engine.weights = step + 1  # the sync that ends the step
    return out


def test_version_rule():
    assert [rollout_version(j, 1, -1) for j in range(5)] == [0, 0, 1, 2, 3]
    assert [rollout_version(j, 0, -1) for j in range(4)] == [0, 1, 2, 3]
    assert [rollout_version(j, 2, -1) for j in range(5)] == [0, 0, 0, 1, 2]
    # a checkpoint after step 4: rollout 4 (what step 5 trains) comes from version 4
    assert [rollout_version(j, 2, 4) for j in range(7)] == [0, 0, 0, 1, 4, 4, 4]


def test_depth_zero_is_the_synchronous_loop():
    for made_by, seed, _, lag in _run(0, -1, 0, 6):
        assert lag == {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
    assert [m for m, *_ in _run(0, -1, 0, 6)] == list(range(6))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_no_sample_is_trained_more_than_depth_versions_late(depth):
    rows = _run(depth, -1, 0, 12)
    lags = [lag["rollout/staleness_max"] for *_, lag in rows]
    assert max(lags) == depth and lags[depth:] == [depth] * (12 - depth), lags  # the pipeline stays full
    # every prompt batch in order, each with its step's seed, whatever generated it
    assert [seed for _, seed, *_ in rows] == [1000 + j for j in range(12)]
    assert [p for *_, p, _ in rows] == [p for *_, p, _ in _run(0, -1, 0, 12)]


@pytest.mark.parametrize("depth,save_steps,at", [(1, 3, 3), (2, 4, 8), (1, 5, 5)])
def test_resume_from_a_checkpoint_regenerates_what_was_in_flight(depth, save_steps, at):
    full = _run(depth, save_steps, 0, 12)
    resumed = _run(depth, save_steps, at, 12)
    assert resumed == full[at:]  # same weights, seeds and prompts for every rollout after the checkpoint
    assert full[at][0] == at  # the first rollout after a checkpoint comes from the checkpoint's weights


def test_queue_never_runs_past_the_last_step():
    engine = FakeEngine()
    q = RolloutQueue(engine.submit, iterate_batches(40, 4, 0), list(range(40)), depth=3, save_steps=-1, start=0,
                     total=2, seed=lambda j: j, logprobs=lambda j: False)
    q.take(0)
    q.take(1)
    assert len(engine.calls) == 2 and not q.pending and q.settle() == {}


@pytest.mark.parametrize("partial", [False, True])
def test_settle_waits_for_the_rollouts_in_flight_except_with_partial_rollout(partial):
    """Before a sync the queue collects what the engines are generating, so the sync's timeout counts
    the sync alone; with --partial_rollout it does not: the engines take the sync between two chunks."""
    collected = []

    def submit(prompts, seed, logprobs):
        return lambda: collected.append(seed) or Samples([[1]], [[2]], [0], [False])

    q = RolloutQueue(submit, iterate_batches(40, 4, 0), list(range(40)), depth=2, save_steps=-1, start=0,
                     total=5, seed=lambda j: j, logprobs=lambda j: False, partial=partial)
    q.take(0)  # rollouts 1 and 2 in flight
    waited = q.settle()
    assert collected == ([0] if partial else [0, 1, 2])
    assert ("time/engine_wait_s" in waited) != partial
    assert [r.samples is None for r in q.pending] == [partial, partial]


# ---------------------------------------------------------------- --partial_rollout (common/rollout/partial.py)
class CountingEngine:
    """A stand-in for VllmEngine.generate: each token is the last one + 1, a multiple of 10 ends the
    sample (eos); every sample is tagged with the version the engine holds, which the test moves."""

    def __init__(self):
        self.version, self.calls = 0, []

    def generate(self, prompt_ids, sampling, seed):
        self.calls.append((len(prompt_ids), sampling["n"], sampling["max_new_tokens"], seed))
        s = Samples([], [], [], [], [], extra={"engine_generate_s": 1.0}, versions=[])
        for i, p in enumerate(prompt_ids):
            for _ in range(sampling["n"]):
                r = []
                while len(r) < sampling["max_new_tokens"] and not (r and r[-1] % 10 == 0):
                    r.append((r or p)[-1] + 1)
                s.prompt_ids.append(p)
                s.response_ids.append(r)
                s.prompt_index.append(i)
                s.truncated.append(r[-1] % 10 != 0)  # vLLM's finish_reason "length"
                s.logprobs.append([-t / 100 for t in r])
                s.versions.append(self.version)
        return s


def test_partial_chunks_continue_samples_and_tag_each_token_with_its_version():
    from common.rollout.partial import CHUNK_SEED, generate_in_chunks

    engine = CountingEngine()

    def call(prompt_ids, sampling, seed):  # a weight sync after the first chunk
        out = engine.generate(prompt_ids, sampling, seed)
        engine.version = 1
        return out

    s = generate_in_chunks(call, [[3], [7], [15]], dict(n=2, max_new_tokens=5, temperature=1.0), seed=11, chunk=3)
    assert s.response_ids == [[4, 5, 6, 7, 8]] * 2 + [[8, 9, 10]] * 2 + [[16, 17, 18, 19, 20]] * 2
    assert s.prompt_ids == [[3]] * 2 + [[7]] * 2 + [[15]] * 2 and s.prompt_index == [0, 0, 1, 1, 2, 2]
    assert s.token_versions == [[0, 0, 0, 1, 1]] * 2 + [[0, 0, 0]] * 2 + [[0, 0, 0, 1, 1]] * 2
    assert s.versions == [0] * 6  # the oldest token's
    assert s.truncated == [True, True, False, False, False, False]  # only the budget truncates
    assert all(lp == [-t / 100 for t in r] for lp, r in zip(s.logprobs, s.response_ids))
    # chunk 0: the prompts, n each; chunk 1: the 4 unfinished samples one by one, the room left, its own seed
    assert engine.calls == [(3, 2, 3, 11), (4, 1, 2, 11 + CHUNK_SEED)]
    assert s.extra == {"engine_generate_s": 2.0}
    assert staleness(s.versions, 2, s.token_versions)["rollout/partial_frac"] == 4 / 6


def test_partial_rollout_raises_a_shards_error_in_the_collecting_thread():
    """A dead engine (here: the second chunk of shard 1 fails) ends the rollout with that error, raised
    where the trainer collects it; the other shard completes and no driver thread is left behind."""
    import threading

    from common.errors import TrainingError
    from common.rollout.partial import submit_chunked

    engines = [CountingEngine(), CountingEngine()]

    def call(engine, timeout_s):
        def one(prompt_ids, sampling, seed):
            if engine is engines[1] and engine.calls:
                raise TrainingError("vLLM generate: the actor died")
            return engine.generate(prompt_ids, sampling, seed)
        return one

    collect = submit_chunked(engines, [[1], [2], [3], [4]], dict(n=1, max_new_tokens=8), seed=0, chunk=2, call=call)
    with pytest.raises(TrainingError, match="the actor died"):
        collect()
    for t in threading.enumerate():
        if t.name.startswith("partial-rollout"):
            t.join(timeout=5)
            assert not t.is_alive()
    assert len(engines[0].calls) == 4  # 4 chunks of 2 tokens: the budget of 8
    ok = submit_chunked(engines, [[1], [2], [3], [4]], dict(n=1, max_new_tokens=8), seed=0, chunk=2,
                        call=lambda e, t: engines[0].generate)()
    assert ok.prompt_index == [0, 1, 2, 3] and ok.response_ids[0] == list(range(2, 10))
