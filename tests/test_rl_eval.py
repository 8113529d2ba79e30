"""pass@k (Chen et al. 2021) and the eval metrics against a naive count over every draw of k samples."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from common.rl_eval import BestCheckpoint, pass_at_k, pass_metrics


def _naive(results: list[bool], k: int) -> float:
    """The share of all k-subsets of the samples with at least one pass."""
    draws = list(itertools.combinations(results, k))
    return sum(any(d) for d in draws) / len(draws)


@pytest.mark.parametrize("n", [1, 4, 5])
def test_pass_at_k_is_the_share_of_k_draws_with_a_pass(n):
    rng = random.Random(n)
    for _ in range(20):
        results = [rng.random() < 0.4 for _ in range(n)]
        for k in range(1, n + 1):
            assert pass_at_k(n, sum(results), k) == pytest.approx(_naive(results, k))


def test_pass_metrics_on_fixed_samples():
    # 3 prompts x 4 samples; prompt 2's last sample has no usable reward and prompt 2 then counts in no pass@k
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.7, 0.0, 0.2, 0.0, 0.0, 0.0, 9.0])
    prompt_index = [0] * 4 + [1] * 4 + [2] * 4
    ok = list(range(11))
    m = pass_metrics(scores, ok, None, prompt_index, 4)  # reward > 0 passes
    by_prompt = [[True, False, False, False], [True, True, False, True]]
    for k in (1, 2, 4):
        assert m[f"eval/pass@{k}"] == pytest.approx(sum(_naive(r, k) for r in by_prompt) / 2)
    assert m["eval/reward_mean"] == pytest.approx(float(scores[:11].mean()))
    # the reward function's own verdicts win over "reward > 0"
    passed = [False] * 12
    passed[0] = True
    m = pass_metrics(scores, ok, passed, prompt_index, 4)
    assert m["eval/pass@1"] == pytest.approx((1 / 4 + 0) / 2) and m["eval/pass@4"] == pytest.approx(0.5)


def test_best_checkpoint_tracks_the_key():
    best = BestCheckpoint("")
    assert best.key == "eval/pass@1"
    assert best.improved({"eval/pass@1": 0.3}) and not best.improved({"eval/pass@1": 0.2})
    assert not best.improved({"train/kl": 1.0}) and best.improved({"eval/pass@1": 0.5})
    assert BestCheckpoint("", best.state()).value == 0.5  # resumed
    assert not BestCheckpoint("none").improved({"eval/pass@1": 1.0})
