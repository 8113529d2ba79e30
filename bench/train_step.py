"""The training phase alone: one GRPO optimizer step through the actor's own code path, per ZeRO stage
and micro-batch size, with its MFU (GPU).

    python bench/train_step.py --model /tmp/q05 --stages 0,1,2 --micros 16,64 --modes master,autocast [--profile]

Runs `common.rl.workers.ModelWorker.train` (the code the scripts run inside their Ray actor) in this
process on one GPU: 64 sequences of 64 prompt + 256 response tokens, a clipped policy loss with a KL
term, DeepSpeed's default Adam, in two bf16 modes: `master` (bf16 weights with an fp32 master copy,
DeepSpeed's bf16 section) and `autocast` (fp32 weights, forward under torch.autocast: --torch_autocast),
each also with `+compile` (every transformer block under torch.compile: --torch_compile), and `plain`: the
same loss in a plain PyTorch loop as TRL's trainer runs it (transformers' model with fp32 weights under
bf16 autocast, the full logits, a log-softmax per row, torch's fused AdamW, no DeepSpeed): the baseline a
slower training phase is read against. `--gradient_checkpointing` applies to every mode.
Prints seconds per optimizer step (median of 3 after 2 warm-up steps), trained tokens/s and
MFU = 6 N tokens / s / peak, against 989 TFLOP/s (H200 datasheet, dense bf16) and 790 (a matmul
measured there). `--profile` adds, per row, the time in forward + loss, backward and the optimizer
step, and the kernels that took the most GPU time.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

import typer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def grpo_loss(out, micro):
    from common.algo.losses import masked_mean, policy_loss

    mask = micro["action_mask"]
    loss, _, _ = policy_loss(out["logprobs"], out["logprobs"].detach(), micro["advantages"], mask, 0.2, 0.2)
    kl = masked_mean(out["logprobs"] - micro["ref_logprobs"], mask)
    return loss + 0.04 * kl, {"loss": loss.item()}


def _phases(w, batch, micro: int, sync) -> dict:
    """Seconds in forward + loss, backward and optimizer step for one optimizer step (synchronised)."""
    import time

    t = {"forward_s": 0.0, "backward_s": 0.0, "step_s": 0.0}
    micros = [m for _, m in w._micro_batches(batch, micro)]
    for j, m in enumerate(micros):
        sync(); t0 = time.perf_counter()
        lp, _ = w._token_logprobs(m)
        loss, _ = grpo_loss({"logprobs": lp}, m)
        sync(); t1 = time.perf_counter()
        w.model.set_gradient_accumulation_boundary(j == len(micros) - 1)
        w.model.backward(loss)
        sync(); t2 = time.perf_counter()
        w.model.step()
        sync(); t3 = time.perf_counter()
        t["forward_s"] += t1 - t0; t["backward_s"] += t2 - t1; t["step_s"] += t3 - t2
    return t


class _Plain:
    """One optimizer step of the GRPO loss in plain PyTorch (module docstring): `train(batch, micro)`."""

    def __init__(self, model: str, checkpointing: bool):
        import torch
        from transformers import AutoModelForCausalLM

        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(self.dev)
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, fused=self.dev == "cuda")
        self.params = sum(p.numel() for p in self.model.parameters())

    def logprobs(self, m):
        """[b, t-1] log-probs of each next token: the whole logits, then a log-softmax row by row."""
        import torch

        with torch.autocast(self.dev, dtype=torch.bfloat16):
            logits = self.model(input_ids=m["input_ids"], attention_mask=m["attention_mask"]).logits[:, :-1]
        labels = m["input_ids"][:, 1:]
        rows = [torch.log_softmax(r.float(), -1).gather(-1, l[:, None]).squeeze(-1) for r, l in zip(logits, labels)]
        return torch.stack(rows)

    def train(self, batch: dict, micro: int, phases: dict | None = None, sync=None) -> None:
        import torch

        self.model.train()
        n = batch["input_ids"].shape[0]
        for i in range(0, n, micro):
            m = {k: v[i:i + micro].to(self.dev) for k, v in batch.items()}
            t0 = time.perf_counter()
            lp = self.logprobs(m)
            loss, _ = grpo_loss({"logprobs": lp}, m)
            if phases is not None:
                sync(); t1 = time.perf_counter(); phases["forward_s"] += t1 - t0
            (loss * m["input_ids"].shape[0] / n).backward()
            if phases is not None:
                sync(); t2 = time.perf_counter(); phases["backward_s"] += t2 - t1
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if phases is not None:
            sync(); phases["step_s"] += time.perf_counter() - t2


def main(model: str = "/tmp/q05", stages: str = "0,1,2", micros: str = "16,64", modes: str = "master",
         samples: int = 64, prompt_len: int = 64, response_len: int = 256, profile: bool = False, out: str = "",
         gradient_checkpointing: bool = False):
    import torch

    from common.training import ds
    from common.rl.workers import ModelSpec, ModelWorker

    g = torch.Generator().manual_seed(0)
    T = prompt_len + response_len
    ids = torch.randint(5, 500, (samples, T), generator=g)
    mask = torch.zeros(samples, T - 1)
    mask[:, prompt_len - 1:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones(samples, T, dtype=torch.long), "action_mask": mask,
             "advantages": torch.randn(samples, 1).expand(samples, T - 1).contiguous() * mask,
             "ref_logprobs": torch.full((samples, T - 1), -10.0) * mask}
    tokens = samples * T
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    configs = [(mode, int(s), int(m)) for mode in modes.split(",") for s in stages.split(",") for m in micros.split(",")]
    for mode, stage, micro in configs:
        settings = ds.DSSettings(zero_stage=stage, bf16=True, micro_train_batch_size=micro, train_batch_size=samples,
                                 autocast="autocast" in mode, compile="compile" in mode,
                                 gradient_checkpointing=gradient_checkpointing)
        w = ModelWorker.__new__(ModelWorker)  # the Ray actor's class, used in-process
        w.role = "actor"
        try:
            if mode == "plain":
                w = _Plain(model, gradient_checkpointing)
                n = w.params
                step = lambda: w.train(batch, micro)  # noqa: E731
            else:
                info = w.setup(ModelSpec(model, "causal_lm", True, settings, bf16=True,
                                         optim=dict(lr=1e-6, total_steps=100, warmup_ratio=0.0, scheduler="constant")))
                n = info["params"]
                step = lambda: w.train(batch, grpo_loss, output="logprobs", micro_batch=micro, steps=1, entropy=False)  # noqa: E731
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(5):
                sync()
                t0 = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - t0)
            s = statistics.median(times[2:])
            row = {"mode": mode, "zero_stage": None if mode == "plain" else stage, "micro": micro,
                   "checkpointing": gradient_checkpointing, "step_s": s, "tok_s": tokens / s,
                   "mfu_989": 6 * n * tokens / s / 989e12, "mfu_790": 6 * n * tokens / s / 790e12,
                   "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "params": n}
            if profile:
                if mode == "plain":
                    row["phases"] = {"forward_s": 0.0, "backward_s": 0.0, "step_s": 0.0}
                    w.train(batch, micro, row["phases"], sync)
                else:
                    row["phases"] = _phases(w, batch, micro, sync)
                if cuda:
                    from torch.profiler import ProfilerActivity
                    from torch.profiler import profile as prof

                    print(f"kernels of one step: {mode}, micro {micro}", flush=True)
                    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                        step()
                        sync()
                    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60),
                          flush=True)
        except Exception as e:  # e.g. out of memory at a large micro-batch: report, go on
            row = {"mode": mode, "zero_stage": stage, "micro": micro, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        w.model = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if out:
        with open(out, "w") as f:
            json.dump({"model": model, "tokens_per_step": tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    typer.run(main)
