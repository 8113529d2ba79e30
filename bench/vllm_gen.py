"""What vLLM's sampling options cost: tokens/s of one engine on a GRPO-shaped rollout (GPU).

    python bench/vllm_gen.py --model /tmp/q05

8 prompts x 8 samples x 256 new tokens (fixed length), the rollout of bench/grpo_step.py, sampled
as common.vllm_engine does (one seed per request, the sampled token's log-prob) and with each of
those two options removed, so the table shows what reproducible per-request seeds and log-probs
cost. Median of 3 rounds after a warm-up round.
"""
from __future__ import annotations

import os
import statistics
import time

import typer


def main(model: str = "/tmp/q05", prompts: int = 8, n: int = 8, tokens: int = 256, gpu_util: float = 0.3):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=gpu_util, seed=0, logprobs_mode="processed_logprobs")
    reqs = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 500 + 5 for j in range(64)]) for i in range(prompts)]
    variants = {
        "seed per request + logprobs (ours)": lambda i: dict(seed=1000 + i, logprobs=0),
        "no seed + logprobs": lambda i: dict(logprobs=0),
        "seed per request, no logprobs": lambda i: dict(seed=1000 + i),
        "no seed, no logprobs": lambda i: {},
    }
    for name, extra in variants.items():
        params = [SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=tokens, min_tokens=tokens, detokenize=False,
                                 **extra(i)) for i in range(prompts)]
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            llm.generate(reqs, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times[1:])
        print(f"{name:38s} {med:6.3f} s  {prompts * n * tokens / med:9,.0f} tok/s", flush=True)


if __name__ == "__main__":
    typer.run(main)
