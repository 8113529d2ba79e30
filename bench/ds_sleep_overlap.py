"""DeepSpeed sleep with the reload behind the training passes (common.ds_sleep) against a reload in one
blocking piece: the same numbers, and how much of the reload the passes hide. GPU only (DeepSpeed's
offload_states needs its FusedAdam on CUDA).

    python bench/ds_sleep_overlap.py --model /tmp/bench/model-0.5b --out ds_sleep_overlap.json

Each way runs the actor's real worker (common.workers.ModelWorker, ZeRO-3, bf16, FusedAdam) for
`--steps` rounds of offload, reload, one training step of GRPO's clipped loss on a fixed batch, as the
hybrid engine does; the gradient norms and the log-probs after each step must agree bit for bit.
"""
from __future__ import annotations

import json
import os
import sys
import time

import typer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _loss(out, micro):
    from common.losses import policy_loss

    loss, _, _ = policy_loss(out["logprobs"], out["logprobs"].detach(), micro["advantages"], micro["action_mask"], 0.2, 0.2,
                             step_tokens=micro["step_tokens"], step_seqs=micro["step_seqs"])
    return loss, {}


def _run(model: str, overlap: bool, steps: int, rows: int, seq: int) -> dict:
    import torch

    from common import ds
    from common.workers import ModelSpec, ModelWorker

    os.environ["HYBRIDRL_OVERLAP_RELOAD"] = "1" if overlap else "0"
    settings = ds.DSSettings(zero_stage=3, bf16=True, fused_adam=True, micro_train_batch_size=rows // 4,
                             train_batch_size=rows, gradient_checkpointing=True)
    w = ModelWorker.__new__(ModelWorker)  # the worker as Ray would hold it, in this process
    w.role, w.rank, w.world_size, w._master = "actor", 0, 1, ("127.0.0.1", 0)
    w.setup(ModelSpec(model, "causal_lm", True, settings, bf16=True, optim=dict(lr=1e-5, total_steps=steps + 1)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (rows, seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "action_mask": torch.ones(rows, seq - 1),
             "advantages": torch.randn(rows, seq - 1, generator=g)}
    out = {"logprob_sums": [], "grad_norms": [], "offload_s": [], "reload_blocked_s": [], "train_s": [], "timing": []}
    for _ in range(steps):
        out["offload_s"].append(w.offload_states())
        out["reload_blocked_s"].append(w.reload_states())
        t0 = time.perf_counter()
        stats = w.train(batch, _loss, output="logprobs", micro_batch=rows // 4, steps=1)[0]
        out["train_s"].append(time.perf_counter() - t0)
        out["timing"].append(w.reload_timing())
        out["grad_norms"].append(stats["grad_norm"])
        out["logprob_sums"].append(w.logprobs(batch, rows).sum().item())  # the weights after the step, in one number
    w.model.destroy()
    del w
    torch.cuda.empty_cache()
    return out


def main(model: str = "/tmp/bench/model-0.5b", steps: int = 3, rows: int = 64, seq: int = 288, out: str = ""):
    from common import ds

    ds.setup_distributed()
    plain, overlapped = _run(model, False, steps, rows, seq), _run(model, True, steps, rows, seq)
    same = all(plain[k] == overlapped[k] for k in ("logprob_sums", "grad_norms"))
    for name, r in (("one blocking reload", plain), ("reload behind the passes", overlapped)):
        print(f"{name:26s} offload {r['offload_s'][-1]:.3f} s, reload blocked {r['reload_blocked_s'][-1]:.3f} s, "
              f"train {r['train_s'][-1]:.3f} s, {r['timing'][-1]}", flush=True)
    print(f"same gradient norms and log-probs after each step: {same}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"plain": plain, "overlapped": overlapped, "same": same}, f, indent=2)
    if not same:
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
