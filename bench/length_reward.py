"""A `--reward_func` file for timing runs: longer completions score higher (characters / 100).

`bench/grpo_step.py` gives it to both train_grpo.py and TRL's GRPOTrainer on the random-weight GPU
shapes, where no rule-based task reward means anything; scoring costs microseconds either way, so
it keeps the comparison about generation and training. Pure Python, no imports from this repo.
"""
from __future__ import annotations


def reward_func(prompts: list[str], completions: list[str], labels: list[str | None]) -> list[float]:
    """One score per completion: `len(completion) / 100`. prompts, completions, labels: [B]."""
    return [len(c) / 100 for c in completions]
