"""Where `rollout/logprob_diff` comes from: vLLM's sampled-token log-probs against the trainer's, per way of
computing the trainer's, on one model (GPU).

    python dev/probes/logprob_gap.py --model /tmp/bench/model-3b --out gap.json

vLLM (bf16, the scripts' engine settings: its processed log-probs, temperature 1) samples `--rows` rows of
`--new_tokens` tokens; then the same rows go through the policy as the trainer runs it, one way at a time:
- bf16: bf16 weights, padded rows, SDPA (DeepSpeed's bf16 mode, `--bf16`; ZeRO-3 gathers the same weights);
- bf16 packed: the same, the rows packed into one with a block-diagonal mask (`--packing_samples` without
  flash-attention, common.algo.packing);
- autocast: fp32 weights under bf16 autocast (`--torch_autocast`);
- fp32: fp32 weights and math, the reference the others are measured against.
Each row of the table: mean |trainer - vLLM| over the sampled tokens (what `rollout/logprob_diff` logs), mean
|trainer - fp32|, and the forward's time over all rows (no grad, micro-batches of `--micro`).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Annotated

import typer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main(model: Annotated[str, typer.Option(help="Model folder (bench/make_model.py).")],
         rows: Annotated[int, typer.Option(help="Sampled rows.")] = 64,
         new_tokens: Annotated[int, typer.Option("--new_tokens", help="Tokens sampled per row.")] = 256,
         micro: Annotated[int, typer.Option(help="Rows per trainer forward.")] = 16,
         out: Annotated[str, typer.Option(help="Write the table here as JSON.")] = None):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as the scripts run it
    import torch
    from vllm import LLM, SamplingParams

    from common.algo.logprobs import token_logprobs
    from common.algo.packing import pack

    torch.manual_seed(0)
    prompts = torch.randint(3, 500, (rows, 13)).tolist()  # the built-in tokenizer's ids (bench models use it)
    llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=0.3, seed=0, logprobs_mode="processed_logprobs",
              max_model_len=13 + new_tokens + 8)
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, logprobs=0, seed=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seqs, vllm_lp = [], []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        seqs.append(p + list(c.token_ids))
        vllm_lp.append([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    # the engine stays (0.3 of the GPU): the trainer's ways below need < 40 GiB at 3B

    width = max(map(len, seqs))
    ids = torch.zeros(rows, width, dtype=torch.long)
    att = torch.zeros(rows, width, dtype=torch.long)
    act = torch.zeros(rows, width - 1, dtype=torch.bool)  # positions whose next token was sampled
    ref = torch.zeros(rows, width - 1)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], att[i, :len(s)] = torch.tensor(s), 1
        act[i, 12:len(s) - 1] = True
        ref[i, 12:len(s) - 1] = torch.tensor(vllm_lp[i])
    ids, att = ids.cuda(), att.cuda()

    from transformers import AutoModelForCausalLM

    def run(weights, *, autocast=False, packed=False):
        m = AutoModelForCausalLM.from_pretrained(model, dtype=weights, attn_implementation="sdpa").cuda().eval()
        lps = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            for i in range(0, rows, micro):
                x, a = ids[i:i + micro], att[i:i + micro]
                if packed:
                    p = pack(x, a)
                    logits = m(**p.model_inputs()).logits
                    lps.append(p.unpack_next_token(token_logprobs(logits[:, :-1], p.input_ids[:, 1:])))
                else:
                    logits = m(input_ids=x, attention_mask=a).logits
                    lps.append(token_logprobs(logits[:, :-1], x[:, 1:]))
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        del m
        torch.cuda.empty_cache()
        return torch.cat(lps).float().cpu(), took

    ways = {"bf16": dict(weights=torch.bfloat16), "bf16 packed": dict(weights=torch.bfloat16, packed=True),
            "autocast": dict(weights=torch.float32, autocast=True), "fp32": dict(weights=torch.float32)}
    run(weights=torch.bfloat16)  # warm-up: the compiled log-prob kernels (dynamic shapes: once for all ways)
    got = {name: run(**kw) for name, kw in ways.items()}
    fp32 = got["fp32"][0]
    table = []
    for name, (lp, took) in got.items():
        table.append({"way": name, "vs_vllm": (lp - ref).abs()[act].mean().item(),
                      "vs_fp32": (lp - fp32).abs()[act].mean().item(), "forward_s": took})
    table.append({"way": "vLLM bf16", "vs_vllm": 0.0, "vs_fp32": (ref - fp32).abs()[act].mean().item(), "forward_s": None})
    print(f"{'way':<14} {'|.-vLLM|':>10} {'|.-fp32|':>10} {'forward s':>10}")
    for r in table:
        print(f"{r['way']:<14} {r['vs_vllm']:>10.4f} {r['vs_fp32']:>10.4f} "
              f"{'-' if r['forward_s'] is None else format(r['forward_s'], '.3f'):>10}")
    if out:
        with open(out, "w") as f:
            json.dump({"model": model, "rows": rows, "new_tokens": new_tokens, "micro": micro, "table": table}, f, indent=2)


if __name__ == "__main__":
    typer.run(main)
