"""The bench's OpenRLHF row asks OpenRLHF 0.11.2 for the same work as the other two sides.

Its command goes through OpenRLHF's own argument parser (the parser block of its
`openrlhf/cli/train_ppo_ray.py`, run as written; the test extra installs the package without its
dependencies) and its own `hierarchize`, so a misspelled flag, a bad choice or a wrong count fails here
rather than after a GPU machine has loaded the model.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def _openrlhf_parser() -> argparse.ArgumentParser:
    spec = importlib.util.find_spec("openrlhf")
    if spec is None:
        pytest.skip("openrlhf is not installed (make test installs it without its dependencies)")
    src = open(os.path.join(os.path.dirname(spec.origin), "cli", "train_ppo_ray.py")).read()
    block = src[src.index('if __name__ == "__main__":'):src.index("args = parser.parse_args()")]
    scope = {"argparse": argparse, "datetime": datetime.datetime, "os": os}
    exec(textwrap.dedent(block.split("\n", 1)[1]), scope)
    return scope["parser"]


def _hierarchize(ns):
    path = os.path.join(os.path.dirname(importlib.util.find_spec("openrlhf").origin), "utils", "config.py")
    spec = importlib.util.spec_from_file_location("openrlhf_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.hierarchize(ns)


@pytest.mark.parametrize("is_correction,lora", [(True, 0), (False, 16)])
def test_openrlhf_command_parses_as_the_same_work(tmp_path, is_correction, lora):
    import grpo_step

    job = dict(model="/m", prompt_file="/p.jsonl", prompts=32, samples=8, micro_batch=32, new_tokens=1024,
               warmup=2, steps=5, seed=42, gradient_checkpointing=True, is_correction=is_correction, lora_rank=lora)
    cmd = grpo_step.openrlhf_command(job, str(tmp_path))
    assert cmd[1:3] == ["-m", "openrlhf.cli.train_ppo_ray"]
    args = _hierarchize(_openrlhf_parser().parse_args(cmd[3:]))
    assert (args.rollout.batch_size, args.rollout.n_samples_per_prompt, args.train.batch_size) == (32, 8, 256)
    assert args.rollout.micro_batch_size == args.train.micro_batch_size == 32  # one optimizer step per rollout
    assert args.rollout.max_new_tokens == 1024 and args.data.max_samples == 32 * 7  # 7 steps of 32 prompts
    assert args.algo.advantage.estimator == "group_norm" and not args.algo.advantage.no_std_norm
    assert args.algo.kl.use_loss and args.algo.kl.init_coef == grpo_step.KL_COEF and args.algo.kl.estimator == "k3"
    assert args.actor.adam.lr == grpo_step.LR and args.actor.lr_warmup_ratio == 0
    assert args.actor.entropy_coef == 0 and args.rollout.temperature == 1.0
    assert args.train.colocate_all and args.vllm.enable_sleep and args.ds.enable_sleep
    assert args.vllm.gpu_memory_utilization == 0.3  # the share the other two sides give their engine
    assert args.actor.gradient_checkpointing_enable
    level = args.algo.advantage.is_correction_level
    if is_correction:  # truncated IS, each token's weight clamped to [0, 3], as TRL's token_truncate
        assert (level, args.algo.advantage.is_correction_mode) == ("token", "clip")
        assert list(args.algo.advantage.is_correction_threshold) == [0.0, grpo_step.IS_CAP]
    else:
        assert level == "off"
    assert args.ds.lora.rank == lora and (not lora or args.ds.lora.alpha == 2 * lora)
