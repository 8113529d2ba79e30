"""Token log-probs and entropy from full-vocabulary logits: fused (torch.compile) against eager blocks.

    python dev/probes/logprob_kernel.py --rows 64 --cols 320 --vocab 151936

Times `common.algo.logprobs.token_stats` forward, and forward + backward, on bf16 logits of the training
phase's shape (64 sequences x 320 tokens x Qwen2.5's vocabulary), once with the compiled kernels
(the GPU default) and once with the eager blocks (HYBRIDRL_FUSED_LOGPROBS=0, the CPU path), with
peak memory. Then checks on fp32 logits that the two agree within 1e-5 (log-probs, entropy and
gradients) and that both equal a plain log_softmax reference.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import typer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(rows: int = 64, cols: int = 320, vocab: int = 151936, check_rows: int = 4):
    import torch

    from common.algo import logprobs as L

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(rows, cols, vocab, device=dev, generator=g) * 2).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (rows, cols), device=dev, generator=g)
    w = torch.randn(rows, cols, device=dev, generator=g)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def timed(fn, n=5):
        fn()
        times = []
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def fwd():
        with torch.no_grad():
            L.token_stats(logits, labels, entropy=True)

    def fwd_bwd():
        lp, ent = L.token_stats(logits, labels, entropy=True)
        (lp * w + 0.01 * ent * w).sum().backward()
        logits.grad = None

    for mode in ("1", "0"):
        os.environ["HYBRIDRL_FUSED_LOGPROBS"] = mode
        L._COMPILED.clear()
        if dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if dev == "cuda" else 0
        f, fb = timed(fwd), timed(fwd_bwd)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else float("nan")
        name = "fused (torch.compile)" if mode == "1" else "eager blocks"
        print(f"{name:24s} forward {f * 1e3:7.1f} ms   forward+backward {fb * 1e3:7.1f} ms   "
              f"peak above inputs {peak:5.1f} GiB   ({rows}x{cols}x{vocab} bf16)", flush=True)

    # agreement on fp32 logits: fused vs eager vs log_softmax
    x = (torch.randn(check_rows, cols, vocab, device=dev, generator=g) * 3).requires_grad_()
    y = labels[:check_rows]
    ww = w[:check_rows]
    out = {}
    for mode in ("1", "0"):
        os.environ["HYBRIDRL_FUSED_LOGPROBS"] = mode
        L._COMPILED.clear()
        lp, ent = L.token_stats(x, y, temperature=0.9, entropy=True)
        (lp * ww + ent * ww).sum().backward()
        out[mode] = (lp.detach(), ent.detach(), x.grad.clone())
        x.grad = None
    logp = torch.log_softmax(x.detach() / 0.9, -1)
    ref_lp = logp.gather(-1, y[..., None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    diffs = {
        "fused vs eager, log-probs": (out["1"][0] - out["0"][0]).abs().max().item(),
        "fused vs eager, entropy": (out["1"][1] - out["0"][1]).abs().max().item(),
        "fused vs eager, gradient": (out["1"][2] - out["0"][2]).abs().max().item(),
        "fused vs log_softmax, log-probs": (out["1"][0] - ref_lp).abs().max().item(),
        "fused vs reference, entropy": (out["1"][1] - ref_ent).abs().max().item(),
    }
    for k, v in diffs.items():
        print(f"max |{k}| = {v:.2e}" + ("" if v <= 1e-5 else "   > 1e-5"), flush=True)


if __name__ == "__main__":
    typer.run(main)
