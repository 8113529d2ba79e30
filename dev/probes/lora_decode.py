"""What serving a pushed LoRA adapter costs vLLM's decoding, against the same weights merged: one question.

    python dev/probes/lora_decode.py --model DIR --out lora_decode.json [--rank 16] [--prompts 64] [--tokens 256]

Three in-process engines (common.rollout.vllm_engine.VllmEngine, one after another, each shut down): the base
with LoRA enabled and a random rank-`rank` all-linear adapter pushed in memory (load_adapter, timed), the same
engine before any push, and a plain engine on the adapter merged into the base. Each generates `prompts` x
at most `tokens` tokens three times (tokens per second compared); the median is kept. Also the greedy tokens of the pushed and the merged
engine on 8 prompts (they should agree: the adapter as vLLM serves it is the merged model).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def adapter(path: str, rank: int, merged_to: str):
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    g = torch.Generator().manual_seed(0)
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.01)
    tensors = {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(peft).items()}
    tensors = {f"base_model.model.{k}" if not k.startswith("base_model.") else k: v for k, v in tensors.items()}
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in peft.peft_config["default"].to_dict().items()}
    peft.merge_and_unload().save_pretrained(merged_to)
    AutoTokenizer.from_pretrained(path).save_pretrained(merged_to)
    return tensors, config


def timed(engine, prompts, tokens) -> dict:
    """Median seconds of three sampled generations, and their generated tokens per second."""
    sampling = dict(n=1, temperature=1.0, top_p=1.0, max_new_tokens=tokens, logprobs=False)
    times, rates = [], []
    for i in range(3):
        t0 = time.perf_counter()
        s = engine.generate(prompts, sampling, seed=i)
        times.append(time.perf_counter() - t0)
        rates.append(sum(len(r) for r in s.response_ids) / times[-1])
    return {"s": statistics.median(times), "tok_per_s": statistics.median(rates)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    from common.rollout.vllm_engine import EngineSpec, VllmEngine

    merged = tempfile.mkdtemp()
    tensors, config = adapter(args.model, args.rank, merged)
    prompts = [[1 + (7 * i + j) % 1000 for j in range(32)] for i in range(args.prompts)]
    out = {"rank": args.rank, "prompts": args.prompts, "tokens": args.tokens,
           "adapter_mb": sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20}
    greedy = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=32, greedy=True, logprobs=False)
    common = dict(dtype="bfloat16", max_model_len=args.tokens + 64, gpu_memory_utilization=0.4)
    engine = VllmEngine(EngineSpec(args.model, lora_rank=args.rank, max_loras=1, **common), 0)
    out["lora_enabled_no_adapter_s"] = timed(engine, prompts, args.tokens)
    loads = [engine.load_adapter(tensors, config, v) for v in range(1, 4)]
    out["adapter_load_s"] = loads
    out["lora_adapter_s"] = timed(engine, prompts, args.tokens)
    pushed = engine.generate(prompts[:8], greedy, seed=0).response_ids
    del engine
    gc.collect()
    import torch

    torch.cuda.empty_cache()
    plain = VllmEngine(EngineSpec(merged, **common), 0)
    out["merged_s"] = timed(plain, prompts, args.tokens)
    want = plain.generate(prompts[:8], greedy, seed=0).response_ids
    out["greedy_equal_rows"] = sum(a == b for a, b in zip(pushed, want))
    out["merged_over_lora_tok_per_s"] = out["merged_s"]["tok_per_s"] / out["lora_adapter_s"]["tok_per_s"]
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    os._exit(0)  # vLLM's engine threads would keep the process (and the device command) alive


if __name__ == "__main__":
    main()
