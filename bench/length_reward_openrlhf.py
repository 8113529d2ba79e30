"""bench/length_reward.py in OpenRLHF's reward-file form, for the bench's OpenRLHF row (`--reward.remote_url`).

OpenRLHF calls `reward_func(queries, prompts, labels)` with each query the prompt's text followed by
the response's, and reads the "rewards" (what trains) and "scores" of the dict it returns. The score
is the response's characters / 100, as the other two sides get it. Pure Python plus torch.
"""
from __future__ import annotations

import torch


def reward_func(queries: list[str], prompts: list[str], labels: list[str | None], **_) -> dict:
    """queries, prompts, labels: [B]; returns {"rewards", "scores"}: [B] float tensors."""
    scores = torch.tensor([(len(q) - len(p)) / 100 for q, p in zip(queries, prompts)], dtype=torch.float32)
    return {"rewards": scores, "scores": scores, "extra_logs": {}}
