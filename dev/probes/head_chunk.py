"""One training forward and backward of a Qwen2.5-shaped policy (random weights, bf16, no DeepSpeed) with
log-probs from the whole logits against log-probs from the last hidden state in chunks
(`common.algo.logprobs.head_stats`, the RL workers' default on a GPU): peak memory, time, and the gap.

    python dev/probes/head_chunk.py --shape 0.5b --rows 64 --seq 290 --out head_chunk.json

Needs only torch and transformers (no vLLM, DeepSpeed or Ray): a GPU check of the path the bundles'
runs take, figures in docs/performance.md.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(shape: str = "0.5b", rows: int = 64, seq: int = 290, chunk: int = 4096, reps: int = 3,
         checkpointing: bool = False, out: str = ""):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from bench.make_model import SHAPES
    from common.algo.logprobs import chunked_head, head_stats, token_stats

    torch.manual_seed(0)
    cfg = Qwen2Config(**{"vocab_size": 151936, "tie_word_embeddings": True, **SHAPES[shape]}, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (rows, seq), device="cuda")
    labels = torch.roll(ids, -1, dims=1)
    weights = torch.randn(rows, seq, device="cuda") / (rows * seq)
    head = chunked_head(model, chunk, 2, False)
    assert head is not None

    def step(chunked: bool):
        if chunked:
            with head_stats(head[0], labels, 1.0, False, chunk, None):
                lp = model(input_ids=ids).logits[..., 0]
        else:
            lp = token_stats(model(input_ids=ids).logits, labels)[0]
        (lp * weights).sum().backward()
        return lp.detach()

    res = {"shape": shape, "rows": rows, "seq": seq, "chunk": chunk, "checkpointing": checkpointing,
           "gpu": torch.cuda.get_device_name()}
    grads = {}
    for name, chunked in (("full", False), ("chunked", True)):
        step(chunked)  # warm-up: kernels compiled, allocator grown
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(reps):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            lp = step(chunked)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res[name] = {"peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30, "step_s": sorted(times)[len(times) // 2]}
        grads[name] = (lp, torch.cat([p.grad.float().flatten() for p in model.parameters()]))
        print(name, res[name], flush=True)
    (a, ga), (b, gb) = grads["full"], grads["chunked"]
    res["logprob_max_gap"] = (a - b).abs().max().item()
    res["logprob_mean_gap"] = (a - b).abs().mean().item()
    res["grad_rel_gap"] = ((ga - gb).norm() / ga.norm()).item()
    print(json.dumps(res), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":  # argparse: the GPU image has no typer without the bundles
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in dict(shape="0.5b", rows=64, seq=290, chunk=4096, reps=3, out="").items():
        p.add_argument(f"--{k}", type=type(v), default=v)
    p.add_argument("--checkpointing", action="store_true")
    main(**vars(p.parse_args()))
