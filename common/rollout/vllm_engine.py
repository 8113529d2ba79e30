"""vLLM rollout engines as Ray actors, and pushing the trainer's weights into them.

Each engine is one `vllm.LLM` running in its actor's own process (vLLM's in-process mode: it starts
in seconds and takes tensors directly, with no serialisation between engine and worker). With
`--vllm_tensor_parallel_size` > 1 the engine's workers are processes of their own (vLLM's
multiprocess executor), one per GPU of the engine, or one per group of cores on CPU. Prompts go
in as token ids and samples come out as token ids with the engine's log-prob of each sampled token,
so the trainer can check that both sides agree (`rollout/logprob_diff`).

The worker's side of the weight sync is `common.rollout.vllm_worker` (every tensor-parallel worker receives
the full weights and keeps its shard); the protocol and the transports (CUDA IPC, NCCL, gloo, Ray's
object store) are in `common.rollout.weight_sync`.
"""
from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import dataclass

from common import cpu_threads
from common.errors import UserError
from common.rollout.engine_clock import clock_mark, clock_since, clock_time_gc, clock_time_jit


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
    tensor_parallel_size: int = 1
    # vLLM's model runner v2 prepares each decode step on the GPU. A small model's generation is
    # bound by the engine's host work per step; on the 0.5B GRPO rollout a profiled call took 1.8 s
    # of host time against 3.1 s on runner v1 (docs/performance.md). vLLM 0.22 makes it the default
    # for Qwen3 only; the scripts ask for it on GPU for the dense architectures in RUNNER_V2
    # (VLLM_USE_V2_MODEL_RUNNER=0 declines).
    model_runner_v2: bool = False
    # A few short generate calls at start, compiling the kernels later rollouts' shapes will need
    # (GPU; HYBRIDRL_VLLM_WARMUP=0 declines).
    warmup: bool = False
    # LoRA: the rank of the adapters the trainer pushes (0: none; the engine then serves its weights
    # alone). vLLM sizes its LoRA buffers for max_lora_rank, one of a fixed set: the smallest that holds
    # this rank (vllm_lora_rank). max_loras: adapters held at once, one per policy version, so that
    # --async_train's rollouts still in flight sample from the version they started with.
    lora_rank: int = 0
    max_loras: int = 1

    @classmethod
    def from_options(cls, a, plan, pretrain: str) -> EngineSpec:
        """The engines of an RL script's options (--vllm_tensor_parallel_size, --vllm_gpu_memory_utilization,
        --enable_prefix_caching, ...) for the model at `pretrain`, on the devices of the resource plan `plan`."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(pretrain)
        return cls(pretrain, dtype=("bfloat16" if a["bf16"] else "auto") if plan.use_gpu else "float32",
                   max_model_len=min(a["prompt_max_len"] + a["generate_max_len"], config.max_position_embeddings),
                   gpu_memory_utilization=a["vllm_gpu_memory_utilization"],
                   enable_prefix_caching=a["enable_prefix_caching"], enforce_eager=a["enforce_eager"],
                   enable_sleep=a["vllm_enable_sleep"], seed=a["seed"], per_request_seeds=not plan.use_gpu,
                   tensor_parallel_size=a["vllm_tensor_parallel_size"],
                   # vLLM's model runner v2 serves no LoRA adapters
                   model_runner_v2=plan.use_gpu and runner_v2_suits(config) and not a["lora_rank"], warmup=plan.use_gpu,
                   # --async_train: a slot per policy version a queued rollout may still sample from
                   lora_rank=a["lora_rank"], max_loras=1 + (a["async_queue_size"] if a["async_train"] else 0))


# dense decoder-only architectures that take the same vLLM code path as the measured Qwen2
RUNNER_V2 = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


def runner_v2_suits(config) -> bool:
    """Whether a transformers config is one RUNNER_V2 runs: a listed architecture, not quantized, no experts."""
    archs = getattr(config, "architectures", None) or []
    dense = not any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    return bool(archs) and set(archs) <= set(RUNNER_V2) and getattr(config, "quantization_config", None) is None and dense


def vllm_lora_rank(rank: int) -> int:
    """The max_lora_rank vLLM is given for adapters of rank `rank`: the smallest it accepts that holds it
    (1, 8, 16, 32, 64, 128, 256, 320, 512 in vLLM 0.32; read from vLLM)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    fits = [r for r in sorted(get_args(MaxLoRARanks)) if r >= rank]
    if not fits:
        raise UserError(f"--lora_rank {rank}: vLLM serves LoRA adapters of rank up to {max(get_args(MaxLoRARanks))}")
    return fits[0]


def cpu_binding(cores: list[int], tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers: the cores split into `tp` runs, "0,1|2,3".

    vLLM's automatic binding gives each worker a NUMA node of its own, which refuses a second worker
    on a one-node machine; when there are fewer cores than workers, they share round-robin."""
    if len(cores) < tp:
        return "|".join(str(cores[i % len(cores)]) for i in range(tp))
    bounds = [round(i * len(cores) / tp) for i in range(tp + 1)]
    return "|".join(",".join(str(c) for c in cores[bounds[i]:bounds[i + 1]]) for i in range(tp))


class VllmEngine:
    """One vLLM engine in a Ray actor; `visible_devices`: the GPUs its tensor-parallel workers use
    when they share the actor's GPUs (None: the GPUs Ray gave this actor)."""

    def __init__(self, spec: EngineSpec, index: int, env: dict | None = None, visible_devices: list[str] | None = None):
        os.environ.update(env or {})
        # In-process engine by default: starts in ~5 s instead of ~35 s, and weights reach it as tensors.
        self.core_process = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "1"
        if self.core_process:  # the sync's buckets and handles are pickled to it
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM-CPU otherwise reserves 92% of RAM
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        if spec.model_runner_v2:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        tp = spec.tensor_parallel_size
        if visible_devices:  # set before anything in this process starts CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices)
        cores = cpu_threads.pin("engine")  # --async_train on CPU: cores the trainer does not use
        if (tp > 1 or cores) and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # read only by vLLM-CPU
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(cores or sorted(os.sched_getaffinity(0)), tp)
        logging.getLogger("vllm").setLevel(logging.WARNING)
        from vllm import LLM

        self.index, self.spec = index, spec
        self.version = 0  # the policy version of the weights held, set by each sync; tags the samples
        self.load_error = None
        self.adapter_error = False  # load_error came from an adapter push: the next complete push clears it
        self.adapters: dict[int, int] = {}  # policy version -> vLLM's id of the adapter held for it
        self.serving: dict[str, tuple] = {}  # serve()'s requests running: our id and vLLM's -> (ours, version, both, client)
        self.served: dict[str, list[dict]] = {}  # serve()'s finished requests per client, not yet returned
        lora = dict(enable_lora=True, max_lora_rank=vllm_lora_rank(spec.lora_rank), max_loras=spec.max_loras,
                    max_cpu_loras=spec.max_loras) if spec.lora_rank > 0 else {}
        self.llm = LLM(model=spec.path, dtype=spec.dtype, max_model_len=spec.max_model_len,
                       gpu_memory_utilization=spec.gpu_memory_utilization, enable_prefix_caching=spec.enable_prefix_caching,
                       enforce_eager=spec.enforce_eager, enable_sleep_mode=spec.enable_sleep, seed=spec.seed + index,
                       max_num_seqs=spec.max_num_seqs, logprobs_mode="processed_logprobs",
                       tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
                       worker_extension_cls="common.rollout.vllm_worker.WeightReceiver", **lora,
                       # vLLM-CPU cannot rewind a request's seeded generator when it splits a prompt over steps
                       # ("CPU Generator does not use offset"): a batch of prompts past the token budget (4096),
                       # which an agent's many separate episodes reach, would fail
                       **({"enable_chunked_prefill": False} if spec.per_request_seeds else {}))
        clock_time_gc()
        # vLLM's model runs in this process only with the in-process engine on one device
        self.timing_jit = not self.core_process and tp == 1 and clock_time_jit()
        if spec.warmup and os.environ.get("HYBRIDRL_VLLM_WARMUP", "1") != "0":
            self._warm_up()

    def _warm_up(self) -> None:
        """Generate a few short batches before the first rollout, so that the Triton kernels which vLLM
        specializes by batch shape (a count of 1, a multiple of 16, any other) compile now rather
        than inside a training step. vLLM's own warm-up runs one prefill and one decode shape."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        def run(lengths, n, max_tokens, logprobs=None):
            prompts = [TokensPrompt(prompt_token_ids=list(range(1, 1 + k))) for k in lengths]
            params = [SamplingParams(n=n, max_tokens=m, ignore_eos=True, detokenize=False, logprobs=logprobs)
                      for m in max_tokens]
            self.llm.generate(prompts, params, use_tqdm=False)

        # 17 prompts of 1-17 tokens, 2 samples each, stopping one step apart: the batch shrinks
        # from 34 requests to 2 (306 prompt tokens); 16 of 16 tokens (256); a single request.
        # No request outgrows the engine's max_model_len.
        k = max(1, min(17, self.spec.max_model_len // 2))
        run(range(1, k + 1), 2, range(1, k + 1))
        run(range(1, k + 1), 2, range(1, k + 1), logprobs=0)
        run([min(16, k)] * 16, 1, [min(16, k)] * 16)
        run([1], 1, [1])
        self.llm.reset_prefix_cache()

    def ready(self) -> int:
        return self.index

    def cores(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    def gpu_memory(self) -> dict:
        """The largest of its workers' GPU memory figures (common.cluster.gpu_memory), since the last call."""
        from common.cluster.gpu_memory import combine

        return combine(self.llm.collective_rpc("hybridrl_memory"))

    def generate(self, prompt_ids: list[list[int]], sampling: dict, seed: int):
        """n samples per prompt, token ids in and out, with each sampled token's log-prob.

        With LoRA, from the adapter of the last `load_adapter`, or of policy version
        `sampling["adapter_version"]` if the engine still holds it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from common.rollout.samples import Samples

        self._check_loaded()
        self._drain()  # LLM.generate runs the engine until every request it holds is done, serve()'s too
        version, lora = self._adapter_request(sampling.get("adapter_version"))
        n = sampling["n"]
        greedy = sampling.get("greedy", False)
        # The sampled tokens' log-probs cost a quarter of the decode time of a 0.5B model on an H200
        # (bench/vllm_gen.py): the scripts ask for them only on the steps that use them.
        want_lp = sampling.get("logprobs", True)
        # vLLM refuses n > 1 with greedy decoding; the n copies would be identical, so repeat one.
        # One seed per request: the same seed on every request would give every prompt the same noise.
        # flat_logprobs: a few flat lists per sample instead of a dict and an object per token (fewer
        # objects; on the 0.5B bench no faster, 0.899 against 0.902 s: dev/LOG.md).
        params = [SamplingParams(n=1 if greedy else n, temperature=0.0 if greedy else sampling["temperature"],
                                 top_p=sampling["top_p"], max_tokens=sampling["max_new_tokens"],
                                 logprobs=0 if want_lp else None, flat_logprobs=True, detokenize=False,
                                 seed=seed + i if self.spec.per_request_seeds and not greedy else None)
                  for i in range(len(prompt_ids))]
        # The engine's host work per decode step is what bounds a small model's generation: its CPU
        # seconds, the garbage collector's and Triton's compiles say whether a slow call was starved
        # or did more (common.rollout.vllm_engine).
        m = clock_mark()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False,
                                 lora_request=lora)
        extra, compiled = clock_since(m, self.timing_jit)
        s = Samples([], [], [], [], [] if want_lp else None, extra=extra, versions=[])
        if compiled:  # into the actor's log (Ray's session logs): what made a slow call slow
            logging.getLogger("hybridrl").warning("vLLM engine %d compiled Triton kernels during generate (%.2f s): %s",
                                                  self.index, extra["engine_jit_s"], ", ".join(compiled))
        for i, out in enumerate(outs):
            for c in out.outputs * (n if greedy else 1):
                ids = list(c.token_ids)
                s.prompt_ids.append(prompt_ids[i])
                s.response_ids.append(ids)
                s.prompt_index.append(i)
                s.truncated.append(c.finish_reason == "length")
                s.versions.append(version)
                if want_lp:
                    flat = c.logprobs  # logprobs=0: one entry per position, the sampled token's
                    s.logprobs.append([flat.logprobs[k] for k in flat.start_indices])
        return s

    def _check_loaded(self) -> None:
        if self.load_error:  # a deferred weight load failed (common.rollout.weight_sync): never sample from half-loaded weights
            raise RuntimeError(f"vLLM engine {self.index}: the last weight load failed: {self.load_error}")

    # -------------------------------------------------------- continuous batching (common.rl.agent_batching)
    def serve(self, requests: list[dict], slice_s: float, client: str = "") -> list[dict]:
        """Adds `requests` to those the engine is running and steps it until one of `client`'s requests
        finishes or `slice_s` seconds pass; returns `client`'s finished ones. For multi-turn episodes, whose
        turns arrive one at a time: a turn joins the running batch at the next decode step instead of waiting
        for the others. Several clients (a rollout and the next one, --async_train) share the batch; each
        gets its own requests back.

        A request: {"id": str, "ids": prompt ids, "max_tokens", "seed" (None: the engine's stream),
        "temperature", "top_p", "logprobs": bool}. A result: {"id", "token_ids", "logprobs" (None without),
        "truncated", "version": the policy version whose weights sampled it}. Requests left running stay in
        the engine for the next call; a weight load, sleep or generate() first runs them to their end with
        the weights they started with (`_drain`), and the next serve() returns them."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._check_loaded()
        engine = self.llm.llm_engine
        version, lora = self._adapter_request(None)
        for r in requests:
            params = SamplingParams(n=1, temperature=r["temperature"], top_p=r["top_p"], max_tokens=r["max_tokens"],
                                    logprobs=0 if r["logprobs"] else None, flat_logprobs=True, detokenize=False,
                                    seed=r["seed"] if self.spec.per_request_seeds else None)
            params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it ends
            # vLLM may append a suffix to the id it was given (and report either): keep both
            inner = engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["ids"]), params, lora_request=lora)
            keys = {r["id"], inner or r["id"]}
            for k in keys:
                self.serving[k] = (r["id"], version, keys, client)
        t0 = time.perf_counter()
        while not self.served.get(client) and engine.has_unfinished_requests() and time.perf_counter() - t0 < slice_s:
            self._step()
        return self.served.pop(client, [])

    def _step(self) -> None:
        """One engine step; the requests it finished go to their client's list in `served`."""
        for o in self.llm.llm_engine.step():
            if not o.finished:
                continue
            ours, version, keys, client = self.serving[o.request_id]
            for k in keys:
                del self.serving[k]
            c = o.outputs[0]
            lp = c.logprobs
            self.served.setdefault(client, []).append(
                {"id": ours, "token_ids": list(c.token_ids), "truncated": c.finish_reason == "length",
                 "logprobs": [lp.logprobs[k] for k in lp.start_indices] if lp is not None else None,
                 "version": version})

    def _drain(self) -> None:
        """Run serve()'s requests to their end before the weights, the adapters or the memory change."""
        while self.serving and self.llm.llm_engine.has_unfinished_requests():
            self._step()

    def _adapter_request(self, version: int | None):
        """(the policy version that samples, vLLM's request for its adapter or None for the weights alone)."""
        from vllm.lora.request import LoRARequest

        version = self.version if version is None else version
        if version not in self.adapters:
            if not self.adapters and version == self.version:  # no adapter pushed yet: the weights are that version
                return version, None
            raise RuntimeError(f"vLLM engine {self.index}: no adapter of policy version {version} "
                               f"(held: {sorted(self.adapters)}; EngineSpec.max_loras {self.spec.max_loras})")
        lora_id = self.adapters[version]
        # vLLM requires a path; the adapter is registered in every worker, so none reads it. Absolute:
        # had a worker lost it, vLLM would then fail on the missing folder rather than ask the Hugging
        # Face hub for a model of that name. The name keys the prefix cache: one per id.
        name = f"hybridrl-adapter-{lora_id}"
        return version, LoRARequest(name, lora_id, f"/in-memory/{name}")

    # ---------------------------------------------------------------- LoRA adapter sync
    def load_adapter(self, tensors: dict, config: dict, version: int | None = None) -> float:
        """Serve the trainer's LoRA adapter as policy version `version` (None: one more than before); the
        next generate calls sample from it. Returns the seconds the engine spent.

        `tensors`: peft's state dict ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
        [r, in], "...lora_B.weight": [out, r]), every tensor-parallel worker gets all of it; `config`: its
        LoraConfig as a dict. The newest `spec.max_loras` versions stay (the one pushed always), older
        ones are dropped. A failed push makes generate refuse until a complete one.
        """
        t0 = time.perf_counter()
        if self.spec.lora_rank <= 0:
            raise RuntimeError(f"vLLM engine {self.index} serves no LoRA adapters: "
                               "start it with EngineSpec.lora_rank > 0")
        self._drain()
        version = self.version + 1 if version is None else version
        lora_id = version + 1  # vLLM's adapter ids start at 1, policy versions at 0
        others = sorted(v for v in self.adapters if v != version)
        stale = others[:max(0, len(others) - (self.spec.max_loras - 1))]
        args = (lora_id, tensors, config)
        if self.core_process:  # as receive_weights: one pickle instead of vLLM's encoding of tensors as lists
            args = (pickle.dumps(args),)
        try:
            for v in stale:  # first, so the new one finds a free slot (vLLM holds at most max_loras)
                self.llm.collective_rpc("hybridrl_remove_adapter", args=(self.adapters.pop(v),))
            self.adapters.pop(version, None)  # replaced: not servable until the push completes
            self.llm.collective_rpc("hybridrl_add_adapter", args=args)
        except Exception as e:
            self.load_error, self.adapter_error = f"{type(e).__name__}: {e}", True
            try:  # some tensor-parallel workers may hold it and others not
                self.llm.collective_rpc("hybridrl_remove_adapter", args=(lora_id,))
            except Exception:  # the push's own error is the one to report
                pass
            raise
        if self.adapter_error:  # a base weight load's failure stays until a complete weight load
            self.load_error, self.adapter_error = None, False
        self.adapters[version] = lora_id
        self.version = version
        self.llm.reset_prefix_cache()  # a re-pushed version keeps its id, and its name keys the cached prefixes
        return time.perf_counter() - t0

    def _drop_adapters(self) -> None:
        """Forget every adapter: they were trained on the weights that a weight load replaces (vLLM's
        reload drops them itself; its in-place load on GPU does not)."""
        for lora_id in self.adapters.values():
            self.llm.collective_rpc("hybridrl_remove_adapter", args=(lora_id,))
        self.adapters.clear()

    # ---------------------------------------------------------------- weight sync (common.rollout.weight_sync)
    def join_sync_group(self, backend: str, addr: str, port: int, first_rank: int, world: int, timeout_s: float) -> None:
        """Each worker joins as rank `first_rank` + its tensor-parallel rank."""
        self.llm.collective_rpc("hybridrl_join", args=(backend, addr, port, first_rank, world, timeout_s))

    def receive_weights(self, buckets: list, transport: str, payload, version: int | None = None) -> float:
        """Every worker takes every bucket, then loads them in one reload; returns the seconds the
        engine spent (for a broadcast, receiving included: the workers receive and load in one call).
        `version`: the policy version these weights are (None: one more than before)."""
        import ray

        t0 = time.perf_counter()
        if transport == "ray":  # fetched here once; the workers get the tensors
            payload = ray.get(payload)
        args = (buckets, transport, payload)
        if self.core_process:
            # vLLM's own encoding to its engine-core process turns dataclasses into dicts and tensors
            # into lists: pickle (tensors, IPC handles and all) once instead.
            args = (pickle.dumps(args),)
        self._drain()
        self._drop_adapters()
        try:
            self.llm.collective_rpc("hybridrl_receive", args=args)
        except Exception as e:
            self.load_error, self.adapter_error = f"{type(e).__name__}: {e}", False
            raise
        self.load_error = None  # a complete load replaces every weight a failed one may have left
        self.llm.reset_prefix_cache()
        self.version = self.version + 1 if version is None else version
        return time.perf_counter() - t0

    # ---------------------------------------------------------------- sleep (GPU only)
    def sleep(self, level: int) -> None:
        self._drain()
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)


def start_engines(num: int, spec: EngineSpec, pg, gpu_fraction: float, cpu_fraction: float, *, shared_with=None,
                  env: dict | None = None, timeout_s: float = 900) -> list:
    """`num` engine actors; waits until each has loaded its model.

    Own group (`shared_with` None): engine i holds bundle i of `pg`, which has all its GPUs.
    Colocated (`shared_with`: the actor's RoleGroup, whose one-GPU bundles it shares): engine i sits
    on bundle i x TP, and its workers on the GPUs of actor ranks i x TP .. (i + 1) x TP - 1.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from common.cluster.ray_groups import get

    tp = spec.tensor_parallel_size
    cls = ray.remote(VllmEngine)
    engines = []
    for i in range(num):
        bundle, visible = i, None
        if shared_with is not None:
            bundle = i * tp
            ranks = shared_with.placements[bundle: bundle + tp]
            if len({node for node, _ in ranks}) > 1:
                raise UserError(f"vLLM engine {i} would span nodes: actor ranks {bundle}-{bundle + tp - 1} are on "
                                f"different nodes; --vllm_tensor_parallel_size {tp} must divide the GPUs per node")
            visible = [g for _, gpus in ranks for g in gpus] or None
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
        engines.append(cls.options(num_cpus=cpu_fraction, num_gpus=gpu_fraction, scheduling_strategy=strategy)
                       .remote(spec, i, env, visible))
    get([e.ready.remote() for e in engines], timeout_s, "vLLM engine start")
    return engines


def start_placed(num: int, spec: EngineSpec, plan, pgs: dict, actor_group) -> list:
    """The RL scripts' `num` engines, placed as `plan` (common.cluster.resources) says: on the actor's GPUs
    (sharing `actor_group`'s bundles) or in their own placement group. None (num 0): no engines."""
    if not num:
        return []
    actor = plan.role("actor")
    shared = plan.vllm_group == actor.group
    return start_engines(num, spec, pgs[plan.vllm_group], plan.vllm_gpu_fraction,
                         actor.cpu_fraction if shared else spec.tensor_parallel_size,
                         shared_with=actor_group if shared else None)


def generate_balanced(engines: list, prompt_ids: list[list[int]], sampling: dict, seed: int, timeout_s: float):
    """Split prompts into equal contiguous shards, one per engine; results in prompt order."""
    return submit_balanced(engines, prompt_ids, sampling, seed)(timeout_s)


def submit_balanced(engines: list, prompt_ids: list[list[int]], sampling: dict, seed: int):
    """generate_balanced's calls, made now; returns `collect(timeout_s) -> Samples`, which waits for them.

    An engine runs its calls one at a time in the order the driver made them, so calls made before a
    weight sync generate with the weights from before it (--async_train, common.rollout.queue)."""
    bounds, used = shard_bounds(len(prompt_ids), len(engines))
    refs = [engines[i].generate.remote(prompt_ids[bounds[i]:bounds[i + 1]], sampling, seed + 7919 * i) for i in used]

    def collect(timeout_s: float):
        from common.cluster.ray_groups import get
        from common.rollout.samples import merge_shards

        return merge_shards([(bounds[i], part) for i, part in zip(used, get(refs, timeout_s, "vLLM generate"))])

    return collect


def shard_bounds(n: int, k: int) -> tuple[list[int], list[int]]:
    """`n` prompts in `k` equal contiguous shards: shard i is [bounds[i], bounds[i + 1]); `used`: the
    shards that are not empty (fewer prompts than engines: those engines get no call)."""
    bounds = [round(i * n / k) for i in range(k + 1)]
    return bounds, [i for i in range(k) if bounds[i + 1] > bounds[i]]
