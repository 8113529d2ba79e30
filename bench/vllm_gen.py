"""What vLLM's sampling options and our engine wrapper cost: tokens/s on a GRPO-shaped rollout (GPU).

    python bench/vllm_gen.py --model /tmp/q05

8 prompts x 8 samples x 256 new tokens, the rollout of bench/grpo_step.py. First a bare `vllm.LLM`
in this process, sampled as common.rollout.vllm_engine does (one seed per request on CPU only, each sampled
token's log-prob) and with those options removed. Then (`--ours`) the same rollout through
`common.rollout.vllm_engine.VllmEngine.generate`: in this process, in a Ray actor as the scripts run it,
and in a Ray actor whose engine core runs in a process of its own; the three differ only in where
the engine lives, so the table shows what the wrapper and the Ray actor cost. Median of 3 rounds
after a warm-up round. vLLM's environment applies (VLLM_USE_V2_MODEL_RUNNER=1: its model runner v2).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import typer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


ROUNDS = {"n": 4}  # the first round warms up; --rounds sets it


def _timed(fn, rounds: int | None = None) -> tuple[float, object]:
    times, out = [], None
    for _ in range(rounds or ROUNDS["n"]):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    if len(times) > 4:  # the spread says how much of a difference between two rows is noise
        print(f"   rounds: min {min(times[1:]):.3f}  max {max(times[1:]):.3f} s", flush=True)
    return statistics.median(times[1:]), out


def _reload_own_weights(llm, model: str) -> float:
    """Push the model's own weights through the scripts' sync path (common.rollout.vllm_worker), as after a
    training step; returns seconds. Shows whether generation slows down after a weight reload."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.rollout import weight_sync as ws

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda()
    named = list(hf.named_parameters())
    buckets = ws.plan_buckets([(n, tuple(p.shape)) for n, p in named], 256, torch.bfloat16)
    params = dict(named)
    flats = [ws.pack([params[n] for n in b.names], torch.bfloat16, "cuda") for b in buckets]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.collective_rpc("hybridrl_receive", args=(buckets, "ray", flats))  # "ray": the tensors themselves
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


def _profile(fn, top: int = 25) -> None:
    """Where the host's time goes in one call (cProfile; its own overhead inflates the total)."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    print(buf.getvalue()[-6000:], flush=True)


def _load_paths(model: str, prompt_ids, n: int, tokens: int, gpu_util: float) -> None:
    """Generation speed before and after weight pushes through each load path of common.rollout.vllm_worker."""
    from common.rollout.vllm_engine import EngineSpec, VllmEngine

    spec = EngineSpec(model, dtype="bfloat16", max_model_len=64 + tokens + 64, gpu_memory_utilization=gpu_util,
                      per_request_seeds=False)
    eng = VllmEngine(spec, 0)
    sampling = dict(n=n, temperature=1.0, top_p=1.0, max_new_tokens=tokens, logprobs=False)
    gen = lambda: eng.generate(prompt_ids, sampling, 0)  # noqa: E731
    # the model's own weights pushed back must leave greedy answers exactly as they were
    greedy = lambda: eng.generate(prompt_ids, dict(sampling, greedy=True, max_new_tokens=32), 0).response_ids  # noqa: E731
    before = greedy()
    print(f"{'VllmEngine, no logprobs, fresh':52s} {_timed(gen)[0]:6.3f} s", flush=True)
    for path in ("direct", "reload", "direct"):
        os.environ["HYBRIDRL_VLLM_LOAD"] = path
        took = _reload_own_weights(eng.llm, model)
        print(f"{'... after a push, load path ' + path:52s} {_timed(gen)[0]:6.3f} s   (push {took:.3f} s)   "
              f"greedy answers unchanged: {greedy() == before}", flush=True)


def main(model: str = "/tmp/q05", prompts: int = 8, n: int = 8, tokens: int = 256, gpu_util: float = 0.25,
         seeds: bool = False, bare: bool = True, ours: bool = True, profile: bool = False, reload: bool = True,
         sync_sched: bool = False, load_paths: bool = False, rounds: int = 4, engines: int = 1,
         core_process: bool = True):
    import gc

    ROUNDS["n"] = rounds

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompt_ids = [[(7 * i + j) % 500 + 5 for j in range(64)] for i in range(prompts)]
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
    variants = {"logprobs (ours on GPU)": lambda i: dict(logprobs=0),
                "logprobs, flat_logprobs": lambda i: dict(logprobs=0, flat_logprobs=True),
                "no logprobs": lambda i: {}}
    if seeds:
        variants = {"seed per request + logprobs (ours on CPU)": lambda i: dict(seed=1000 + i, logprobs=0),
                    "seed per request, no logprobs": lambda i: dict(seed=1000 + i), **variants}

    if load_paths:
        _load_paths(model, prompt_ids, n, tokens, gpu_util)
        return

    def params_of(extra):
        return [SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=tokens, min_tokens=tokens, detokenize=False,
                               **extra(i)) for i in range(prompts)]

    def line(name, med):
        print(f"{'bare LLM, ' + name:52s} {med:6.3f} s  {prompts * n * tokens / med:9,.0f} tok/s", flush=True)

    llms = {"async scheduling (default)": {}}
    if sync_sched:
        llms["async scheduling off"] = {"async_scheduling": False}
    for label, kw in llms.items() if bare else ():
        llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=gpu_util, seed=0,
                  logprobs_mode="processed_logprobs", worker_extension_cls="common.rollout.vllm_worker.WeightReceiver", **kw)
        print(f"-- {label}", flush=True)
        for name, extra in variants.items():
            params = params_of(extra)
            line(name, _timed(lambda: llm.generate(reqs, params, use_tqdm=False))[0])
        ours_params = params_of(variants["logprobs (ours on GPU)"])
        if reload:
            print(f"   weight reload (scripts' path): {_reload_own_weights(llm, model):.3f} s", flush=True)
            line("logprobs, after a weight reload", _timed(lambda: llm.generate(reqs, ours_params, use_tqdm=False))[0])
        if profile:
            _profile(lambda: llm.generate(reqs, ours_params, use_tqdm=False))
        llm = None  # noqa: F841  (frees the engine before the next)
        gc.collect()
    if not ours:
        return
    import ray

    from common.rollout.vllm_engine import EngineSpec, VllmEngine

    spec = EngineSpec(model, dtype="bfloat16", max_model_len=64 + tokens + 64, gpu_memory_utilization=gpu_util,
                      per_request_seeds=False)
    sampling = dict(n=n, temperature=1.0, top_p=1.0, max_new_tokens=tokens, logprobs=False)  # as the scripts, most steps

    def report(name, gen):
        med, out = _timed(gen)
        made = sum(len(r) for r in out.response_ids)  # random weights may stop early: count what was made
        print(f"{name:52s} {med:6.3f} s  {made / med:9,.0f} tok/s  ({made} tokens)", flush=True)

    if bare:
        local = VllmEngine(spec, 0)
        report("VllmEngine.generate, this process", lambda: local.generate(prompt_ids, sampling, 0))
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path[:1] + [os.environ.get("PYTHONPATH", "")])}})
    for name, env in (("VllmEngine in a Ray actor (as the scripts)", None),
                      ("... engine core in its own process", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}))[:1 + core_process]:
        actor = ray.remote(VllmEngine).options(num_gpus=0.3, num_cpus=0.33).remote(spec, 1, env)
        ray.get(actor.ready.remote())
        report(name, lambda: ray.get(actor.generate.remote(prompt_ids, sampling, 0)))
        ray.kill(actor)
    if engines > 1:  # vLLM's host work per decode step grows with the requests: split them over processes
        import dataclasses

        from common.rollout.vllm_engine import generate_balanced

        part = dataclasses.replace(spec, gpu_memory_utilization=gpu_util / engines)
        actors = [ray.remote(VllmEngine).options(num_gpus=0.9 / engines, num_cpus=1).remote(part, i)
                  for i in range(engines)]
        ray.get([a.ready.remote() for a in actors])
        report(f"{engines} engines in Ray actors on one GPU", lambda: generate_balanced(actors, prompt_ids, sampling, 0, 600))


if __name__ == "__main__":
    typer.run(main)
