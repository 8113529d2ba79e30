"""vLLM rollout engines as Ray actors, and pushing the trainer's weights into them.

Each engine is one `vllm.LLM` running in its actor's own process (vLLM's in-process mode: it starts
in seconds and takes tensors directly, with no serialisation between engine and worker). Prompts go
in as token ids and samples come out as token ids with the engine's log-prob of each sampled token,
so the trainer can check that both sides agree (`rollout/logprob_diff`).

The engine's side of the weight sync (joining the sync group, receiving buckets, loading them) is
here; the protocol and the transports (CUDA IPC, NCCL, gloo, Ray's object store) are in
`common.weight_sync`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass


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
    # One seed per request makes a CPU run repeatable sample for sample. On GPU, batch-dependent
    # kernels make samples unrepeatable anyway, and per-request generators cost 15% of the decode
    # there (bench/vllm_gen.py): the engine's own seeded stream is used instead.
    per_request_seeds: bool = True


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
                                 detokenize=False, seed=seed + i if self.spec.per_request_seeds and not greedy else None)
                  for i in range(len(prompt_ids))]
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

    # ---------------------------------------------------------------- weight sync (common.weight_sync)
    def join_sync_group(self, backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        from common.weight_sync import join_group

        self._sync_group = join_group(backend, addr, port, rank, world, timeout_s)

    def receive_weights(self, buckets: list, transport: str, payloads: list | None) -> float:
        """Take every bucket, then load them in one reload; returns the seconds spent loading."""
        import ray
        import torch

        from common import weight_sync as ws

        weights = []
        for i, bucket in enumerate(buckets):
            if transport == "ray":
                flat = ray.get(payloads[i])
            elif transport == "cuda_ipc":
                flat = ws.open_shared(payloads[i])
            else:
                device = torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")
                flat = torch.empty(bucket.numel, dtype=getattr(torch, bucket.dtype), device=device)
                ws.broadcast(self._sync_group, flat)
            weights += ws.unpack(flat, bucket)
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        if transport == "cuda_ipc":
            torch.cuda.current_stream().synchronize()  # done reading the actor's buffers before it frees them
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
