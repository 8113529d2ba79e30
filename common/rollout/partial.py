"""--partial_rollout: rollouts generated in chunks of new tokens, so that a weight sync lands between two.

Each engine generates its shard of a rollout as a run of `generate` calls of at most `chunk` new
tokens per sample; each call after the first continues the samples not yet finished, from their
prompt plus their tokens so far (one request per sample). A driver thread per shard makes the next
call as soon as the previous one returns. A weight sync's call queues in the engine behind at most
one chunk of each rollout in flight (Ray runs an actor's calls one at a time, in the order they were
made): the engine pauses at a chunk boundary, loads the new weights and resumes with them. The engine
tags each call's samples with the policy version it holds (`VllmEngine.version`, set by the sync);
here those tags become one version per token (`Samples.token_versions`), and a sample's version is
its oldest token's, so the staleness bound of --async_queue_size still holds.

After a sync the engine reads the tokens so far with the new weights (each sync empties vLLM's
prefix cache): every later token is sampled by the new weights given the whole prefix, and the
log-prob the engine returns for it is the new weights' own. The importance weights of
--enable_vllm_is_correction (trainer / engine) therefore correct each token for the weights that
sampled it, with no bookkeeping here.

Seeds are per request and chunk, so a rollout without a sync in the middle is repeatable sample for
sample; where a sync lands depends on timing, which makes token versions (and a resumed run) vary.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable

CHUNK_SEED = 104_729  # chunk c of a shard samples with seed + c x this prime (engines are 7919 apart)


def generate_in_chunks(call: Callable, prompt_ids: list[list[int]], sampling: dict, seed: int, chunk: int):
    """One engine's shard in chunks of at most `chunk` new tokens: `call(prompt_ids, sampling, seed)`
    is one `VllmEngine.generate` (its samples tagged with `versions`). Returns the shard's Samples
    with `token_versions`, `versions` the oldest per sample, and `extra` summed over the calls."""
    budget = sampling["max_new_tokens"]
    out = call(prompt_ids, dict(sampling, max_new_tokens=min(chunk, budget)), seed)
    out.token_versions = [[v] * len(r) for v, r in zip(out.versions, out.response_ids)]
    first = list(out.versions)
    c = 1
    # "length" ends a chunk as it ends a sample at --generate_max_len: only the budget tells them apart
    live = [i for i in range(len(out)) if out.truncated[i] and len(out.response_ids[i]) < budget]
    while live:
        room = min(budget - len(out.response_ids[i]) for i in live)
        part = call([out.prompt_ids[i] + out.response_ids[i] for i in live],
                    dict(sampling, n=1, max_new_tokens=min(chunk, room)), seed + c * CHUNK_SEED)
        for k, i in enumerate(live):
            new = part.response_ids[k]
            out.response_ids[i] = out.response_ids[i] + new
            out.token_versions[i] = out.token_versions[i] + [part.versions[k]] * len(new)
            out.truncated[i] = part.truncated[k]
            if out.logprobs is not None:
                out.logprobs[i] = out.logprobs[i] + part.logprobs[k]
        for key, v in part.extra.items():  # one engine, one call after another: the seconds add up
            out.extra[key] = out.extra.get(key, 0.0) + v
        live = [i for i in live if out.truncated[i] and len(out.response_ids[i]) < budget]
        c += 1
    out.versions = [min(tv, default=v) for tv, v in zip(out.token_versions, first)]
    return out


def engine_call(engine, timeout_s: float) -> Callable:
    """One `generate` call on an engine actor, waited for (at most `timeout_s`)."""
    def call(prompt_ids, sampling, seed):
        from common.cluster.ray_groups import get

        return get(engine.generate.remote(prompt_ids, sampling, seed), timeout_s, "vLLM generate")

    return call


def submit_chunked(engines: list, prompt_ids: list[list[int]], sampling: dict, seed: int, chunk: int,
                   timeout_s: float = 1800, call: Callable = engine_call):
    """`submit_balanced` in chunks: each non-empty shard's chunks are driven by a thread started now.
    Returns `collect() -> Samples`, which waits for every shard and raises a shard's error (a dead
    engine, a chunk not answered within `timeout_s`) in the caller's thread. `call(engine, timeout_s)`
    makes the per-chunk call (tests wrap it)."""
    from common.rollout.samples import merge_shards
    from common.rollout.vllm_engine import shard_bounds

    bounds, used = shard_bounds(len(prompt_ids), len(engines))
    futures = []
    for i in used:
        done: Future = Future()
        args = (call(engines[i], timeout_s), prompt_ids[bounds[i]:bounds[i + 1]], sampling, seed + 7919 * i, chunk)
        # daemon: a run that stops on another error must not wait for a shard's last chunk to exit
        threading.Thread(target=_run, args=(done, args), name=f"partial-rollout-{i}", daemon=True).start()
        futures.append(done)

    def collect():
        return merge_shards([(bounds[i], f.result()) for i, f in zip(used, futures)])

    return collect


def _run(done: Future, args: tuple) -> None:
    try:
        done.set_result(generate_in_chunks(*args))
    except BaseException as e:  # to the collecting thread, which says it once; nothing printed here
        done.set_exception(e)

