"""pass@k (Chen et al. 2021) and the eval metrics against a naive count over every draw of k samples; the
best checkpoint; the built-in task's exact-match verdict; the end-of-run health summary."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from common.rl.eval import KL_WARN, TRUNCATED_WARN, BestCheckpoint, pass_at_k, pass_metrics, run_health, task_metrics


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
    m = pass_metrics(scores, ok, None, prompt_index, 4, threshold=0.1)  # reward >= 0.1 passes
    by_prompt = [[True, False, False, False], [True, True, False, True]]
    for k in (1, 2, 4):
        assert m[f"eval/pass@{k}"] == pytest.approx(sum(_naive(r, k) for r in by_prompt) / 2)
    assert m["eval/reward_mean"] == pytest.approx(float(scores[:11].mean()))
    # the reward function's own verdicts win over "reward > 0"
    passed = [False] * 12
    passed[0] = True
    m = pass_metrics(scores, ok, passed, prompt_index, 4)
    assert m["eval/pass@1"] == pytest.approx((1 / 4 + 0) / 2) and m["eval/pass@4"] == pytest.approx(0.5)


@pytest.mark.parametrize("threshold", [1.0, 0.5, 0.0])
def test_pass_at_k_counts_a_sample_correct_at_the_threshold(threshold):
    """Partial rewards (the built-in task's 0, 1/3, 1/2, 2/3, 1): a sample passes when its reward is >= the
    threshold, so at 1.0 (the default) only full marks count; checked against a naive loop over every draw."""
    rng = random.Random(7)
    n, prompts = 4, 6
    scores = torch.tensor([rng.choice([0.0, 1 / 3, 0.5, 2 / 3, 1.0]) for _ in range(n * prompts)])
    prompt_index = [p for p in range(prompts) for _ in range(n)]
    m = pass_metrics(scores, list(range(n * prompts)), None, prompt_index, n, threshold)
    for k in (1, 2, 4):
        want = sum(_naive([float(s) >= threshold for s in scores[p * n:(p + 1) * n]], k) for p in range(prompts)) / prompts
        assert m[f"eval/pass@{k}"] == pytest.approx(want), k
    if threshold == 1.0:  # partial copies are not right answers: pass@1 is the share of full marks, below the mean
        assert m["eval/pass@1"] == pytest.approx(float((scores == 1.0).float().mean()))
        assert m["eval/pass@1"] < m["eval/reward_mean"]


def test_best_checkpoint_tracks_the_key():
    best = BestCheckpoint("")
    assert best.key == "eval/pass@1"
    assert best.improved({"eval/pass@1": 0.3}, 10) and not best.improved({"eval/pass@1": 0.2}, 20)
    assert not best.improved({"train/kl": 1.0}, 30) and best.improved({"eval/pass@1": 0.5}, 40)
    assert not best.improved({"eval/pass@1": float("nan")}, 50)
    resumed = BestCheckpoint("", best.state())
    assert (resumed.value, resumed.step) == (0.5, 40)
    assert not BestCheckpoint("none").improved({"eval/pass@1": 1.0}, 10)


def test_best_checkpoint_tie_goes_to_the_later_step():
    """A metric at its ceiling (pass@1 = 1.0 from step 10 on) keeps the latest step that reached it, not
    the first: the demo kept step 10 although step 40 was better."""
    best = BestCheckpoint("")
    kept = [s for s, v in [(0, 0.25), (10, 1.0), (20, 0.75), (30, 1.0), (40, 1.0)] if best.improved({"eval/pass@1": v}, s)]
    assert kept == [0, 10, 30, 40] and best.step == 40


def test_task_metrics_is_the_share_of_exact_copies():
    texts = ["red cat", " red  cat ", "red dog", "red cat cat", "", "sun"]
    labels = ["red cat"] * 4 + ["sun", "sun"]
    m = task_metrics(texts, labels, "rollout")
    assert m["rollout/exact_match"] == pytest.approx(3 / 6)  # extra words, a wrong word or nothing are not right
    assert m["rollout/task_reward"] == pytest.approx((1 + 1 + 0.5 + 2 / 3 + 0 + 1) / 6)


def _steps(n, truncated, kl, reward=0.5):
    return [{"rollout/reward_mean": reward, "rollout/truncated_frac": truncated(i), "train/kl": kl(i)} for i in range(n)]


def test_run_health_warns_when_truncation_or_kl_run_away():
    """The hacked pipeline's shape: reward up while every answer hits the length limit and the KL climbs
    to 4.9 in the last steps. The summary compares the first and last fifth; only the last fifth decides."""
    hacked = _steps(24, lambda i: 0.0 if i < 12 else 1.0, lambda i: 4.9 * i / 23)
    metrics, lines, warnings = run_health(hacked, 12)
    assert metrics["health/truncated_frac"] == 1.0 and metrics["health/truncation_warning"] == 1.0
    assert metrics["health/kl"] == pytest.approx(sum(4.9 * i / 23 for i in range(20, 24)) / 4)
    assert metrics["health/kl_warning"] == 1.0
    assert len(warnings) == 2 and "--generate_max_len 12" in warnings[0] and "100%" in warnings[0]
    assert f"bound {KL_WARN:g}" in warnings[1] and "--init_kl_coef" in warnings[1]
    assert lines == ["summary (the first and last 4 steps): rollout/reward_mean 0.5 -> 0.5, "
                     "rollout/truncated_frac 0 -> 1, train/kl 0.32 -> 4.58"]
    # an early spike that settled is no runaway; a bound reached exactly is still within it
    healthy = _steps(24, lambda i: 0.9 if i < 5 else TRUNCATED_WARN, lambda i: 3.0 if i == 2 else KL_WARN)
    metrics, _, warnings = run_health(healthy, 12)
    assert warnings == [] and metrics["health/truncation_warning"] == metrics["health/kl_warning"] == 0.0
    assert run_health([], 12) == ({}, [], [])
