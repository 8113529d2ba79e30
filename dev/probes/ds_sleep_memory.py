"""GPU memory that DeepSpeed sleep (`offload_states`) frees, state by state, for the actor's engine.

    python dev/probes/ds_sleep_memory.py --model /tmp/q05 --zero-stage 3 --out ds_sleep_z3.json

Builds the actor exactly as the scripts do (common.training.ds, bf16, DeepSpeed's FusedAdam, which
`offload_states` needs), runs one training step so every state exists, then offloads one state type
at a time and records how much `torch.cuda.memory_allocated()` drops, then all of them together.
After `reload_states` the loss on a fixed batch must equal the loss before the offload, bit for bit.
"""
from __future__ import annotations

import json
import os
import sys
import time

import typer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(model: str = "/tmp/q05", zero_stage: int = 3, micro_batch: int = 8, seq_len: int = 320, out: str = ""):
    import torch
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    from common.training import ds
    from common.training.models import load_causal_lm

    dist = ds.setup_distributed()
    settings = ds.DSSettings(zero_stage=zero_stage, bf16=True, fused_adam=True, micro_train_batch_size=micro_batch,
                             train_batch_size=micro_batch)
    _keep = ds.zero3_loading(ds.train_config(settings, 1, torch.bfloat16))  # noqa: F841
    engine = ds.initialize(load_causal_lm(model, dtype=torch.float32, attn_impl="sdpa"), settings, dist, torch.bfloat16,
                           lr=1e-6, total_steps=10)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (micro_batch, seq_len), generator=g).to(dist.device)

    def loss() -> torch.Tensor:
        return engine(input_ids=ids, labels=ids).loss

    engine.backward(loss())
    engine.step()
    engine.backward(loss())  # gradients held again, as between a backward and the next step
    with torch.no_grad():
        before = loss().item()
    gb = lambda: torch.cuda.memory_allocated() / 2**30  # noqa: E731
    torch.cuda.synchronize()
    base = gb()
    rows = []
    for state in (S.optim_states, S.hp_params, S.lp_grads, S.contiguous_grad_buffer, S.lp_params):
        m0, t0 = gb(), time.perf_counter()
        try:
            engine.offload_states(include=[state])
            torch.cuda.synchronize()
            rows.append({"state": state.value, "freed_gb": m0 - gb(), "offload_s": time.perf_counter() - t0})
        except Exception as e:  # a state this stage does not have, or cannot move
            rows.append({"state": state.value, "error": f"{type(e).__name__}: {e}"[:200]})
        engine.reload_states()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.offload_states()
    torch.cuda.synchronize()
    t_off, asleep = time.perf_counter() - t0, gb()
    t0 = time.perf_counter()
    engine.reload_states()
    torch.cuda.synchronize()
    t_on = time.perf_counter() - t0
    with torch.no_grad():
        after = loss().item()
    result = {"zero_stage": zero_stage, "params": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
              "allocated_gb": base, "asleep_gb": asleep, "freed_all_gb": base - asleep, "offload_all_s": t_off,
              "reload_all_s": t_on, "awake_gb": gb(), "loss_before": before, "loss_after": after,
              "same_loss": before == after, "per_state": rows}
    print(json.dumps(result, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    typer.run(main)
