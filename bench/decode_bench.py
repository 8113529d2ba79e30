"""The policy's own generation without vLLM, against vLLM on the same rollout (GPU).

    python bench/decode_bench.py --model /tmp/q05 --out decode.json

8 prompts of 64 tokens x 8 samples x 256 new tokens (the rollout of bench/grpo_step.py), bf16:
- transformers `generate` with its static cache compiled (what --static_kv_cache ran before
  common.rollout.decode), and with the default dynamic cache;
- `common.rollout.decode.static_generate`, eager and compiled (CUDA graphs);
- a bare `vllm.LLM` (in-process, model runner v2, no log-probs) when vLLM is importable.
Every row generates all 256 tokens (no stop token). The first round of each row compiles or warms up;
the median of the next `--rounds` is reported. As a check, 64 greedy tokens per prompt from the
compiled decode and from transformers' static cache are each compared with the argmax of one full
forward over the same tokens (random weights make near-ties common in bf16: the largest logit gap
at a mismatch says how near). `--profile` prints the GPU kernels of one decode step.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import typer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _timed(fn, rounds: int) -> tuple[float, float, list[float]]:
    """(first call s, median of the next `rounds` s, those times)."""
    import torch

    times = []
    for _ in range(rounds + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:]), times[1:]


def main(model: str = "/tmp/q05", prompts: int = 8, n: int = 8, tokens: int = 256, rounds: int = 3,
         hf_dynamic: bool = True, vllm: bool = True, profile: bool = False, out: str = ""):
    import torch
    from transformers import AutoModelForCausalLM

    from common.rollout.decode import static_generate

    if not os.path.isdir(model):
        from bench.make_model import main as make_model
        make_model(shape="0.5b", out=model)
    prompt_ids = [[(7 * i + j) % 500 + 5 for j in range(64)] for i in range(prompts)]
    rows = [p for p in prompt_ids for _ in range(n)]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompt_ids, device="cuda")
    results = []

    def report(name, first, med, times):
        r = dict(name=name, first_s=first, median_s=med, times=times, tok_s=len(rows) * tokens / med)
        results.append(r)
        print(f"{name:44s} first {first:7.2f} s   median {med:6.3f} s  {r['tok_s']:9,.0f} tok/s", flush=True)

    def hf_gen(cache):
        return hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                           top_k=0, top_p=1.0, max_new_tokens=tokens, min_new_tokens=tokens, num_return_sequences=n,
                           pad_token_id=0, cache_implementation=cache)

    def ours(compile):
        return static_generate(hf, rows, temperature=1.0, top_p=1.0, max_new_tokens=tokens, eos_id=-1, pad_id=0,
                               seed=0, compile=compile)

    with torch.no_grad():
        report("ours, common.rollout.decode compiled (CUDA graphs)", *_timed(lambda: ours(True), rounds))
        if profile:  # the GPU's kernels in one decode step (the graph's body run outside the graph)
            from torch.profiler import ProfilerActivity, profile as prof

            from common.rollout import decode
            dec = next(iter(decode._DECODERS.values()))
            dec.cache.reset()  # the rollout filled the cache: start it again for the profiled steps
            dec.t.fill_(1)
            with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
                for _ in range(4):
                    dec.body()
                torch.cuda.synchronize()
            dec.cache.reset()
            dec.t.fill_(1)
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60), flush=True)
            t0 = time.perf_counter()
            for _ in range(20):
                dec.graph.replay()
            dec.cache.reset()
            torch.cuda.synchronize()
            print(f"graph replay: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms per decode step", flush=True)
        report("ours, common.rollout.decode eager", *_timed(lambda: ours(False), 1))
        report("transformers generate, static cache compiled", *_timed(lambda: hf_gen("static"), rounds))
        if hf_dynamic:
            report("transformers generate, dynamic cache", *_timed(lambda: hf_gen(None), 1))
        # Greedy check: is each token the argmax of transformers' full forward over the same prefix?
        # Random weights make near-ties common in bf16, so mismatches are listed with their logit gap.
        for name, fn in (("common.rollout.decode", lambda: static_generate(hf, prompt_ids, temperature=1.0, top_p=1.0,
                                                                  max_new_tokens=64, eos_id=-1, pad_id=0, greedy=True)),
                         ("transformers static", lambda: hf.generate(
                             input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64,
                             min_new_tokens=64, pad_token_id=0, cache_implementation="static")[:, 64:].tolist())):
            resp = torch.tensor(fn(), device="cuda")
            logits = hf(torch.cat([ids, resp], 1)).logits[:, 63:-1].float()
            top = logits.argmax(-1)
            agree = (top == resp).float().mean().item()
            gap = (logits.gather(-1, top[..., None]) - logits.gather(-1, resp[..., None])).max().item()
            print(f"greedy check, {name}: {agree:.1%} of 512 tokens are the full forward's argmax; largest logit gap {gap:.4f}", flush=True)
            results.append(dict(name=f"greedy check, {name}", argmax_fraction=agree, max_logit_gap=gap))
    del hf
    torch.cuda.empty_cache()
    if vllm:
        try:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt
        except ImportError as e:
            print(f"vLLM not importable ({e}): no vLLM row")
        else:
            llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=1024, enable_prefix_caching=False)
            reqs = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
            params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=tokens, min_tokens=tokens, detokenize=False)
            report("bare vLLM, in-process, no log-probs", *_timed(lambda: llm.generate(reqs, params, use_tqdm=False), rounds))
    if out:
        with open(out, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M"), model=model, rows=len(rows), tokens=tokens,
                           results=results), f, indent=1)


if __name__ == "__main__":
    typer.run(main)
