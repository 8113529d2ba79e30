"""The RL scripts' prompt sets, reward source and evaluation: training and held-out prompts, the scorer
of decoded responses, pass@k, the best checkpoint.

--eval_dataset (with --eval_split) gives held-out prompts in the training data's format; without it
the built-in task keeps its held-out split and a user's --prompt_data has none. Every evaluation
samples --eval_n_samples_per_prompt answers per prompt at --eval_temperature and logs
eval/reward_mean and eval/pass@k: the unbiased estimator of Chen et al. 2021 over each prompt's n
samples, a sample passing when its reward is > 0 unless the reward function returns a dict with a
"pass" list (common.rewards).
"""
from __future__ import annotations

from math import comb


def load_prompts(a: dict, tokenizer) -> tuple[list, list, str, int]:
    """(training prompts, held-out prompts, the training data's description, prompts dropped as too long)."""
    from common.blend import EVAL_FLAGS, PROMPT_FLAGS, load_mixture
    from common.prompts import build_prompts
    from common.tasks import prompt_rows

    builtin = a["prompt_data"] is None
    if builtin:
        rows, src = prompt_rows(2048, "train", seed=0), "built-in copy task"
    else:
        rows, src = load_mixture(a["prompt_data"], a["prompt_data_probs"], split=a["prompt_split"], seed=a["seed"],
                                 max_samples=a["max_samples"], flags=PROMPT_FLAGS)
    args = dict(input_key="prompt" if builtin else a["input_key"], label_key="label" if builtin else a["label_key"],
                apply_chat_template=builtin or a["apply_chat_template"], prompt_max_len=a["prompt_max_len"],
                input_template=a["input_template"])
    prompts, dropped = build_prompts(rows, src, tokenizer, **args)
    if a["eval_dataset"]:
        eval_rows, eval_src = load_mixture(a["eval_dataset"], None, split=a["eval_split"], seed=a["seed"],
                                           flags=EVAL_FLAGS)
    elif builtin:
        eval_rows, eval_src = prompt_rows(64, "eval", seed=0), src + " (held out)"
    else:
        return prompts, [], src, dropped
    return prompts, build_prompts(eval_rows, eval_src, tokenizer, **args)[0], src, dropped


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021: the chance that at least one of k samples drawn without replacement from n,
    c of which pass, passes: 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_metrics(scores, ok: list[int], passed: list, prompt_index: list[int], n: int) -> dict[str, float]:
    """eval/reward_mean over the usable samples, and eval/pass@k for k = 1, 2, 4, ... and n over the
    prompts with n usable samples. scores: [N] tensor; passed: [N] bools or None (then score > 0)."""
    usable = set(ok)
    by_prompt: dict[int, list[bool]] = {}
    for i, p in enumerate(prompt_index):
        if i in usable:
            hit = passed[i] if passed and passed[i] is not None else float(scores[i]) > 0
            by_prompt.setdefault(p, []).append(bool(hit))
    out = {"eval/reward_mean": float(scores[ok].mean()) if ok else float("nan")}
    full = [v for v in by_prompt.values() if len(v) == n]
    for k in sorted({2 ** j for j in range(n.bit_length()) if 2 ** j <= n} | {n}):
        if full:
            out[f"eval/pass@{k}"] = sum(pass_at_k(n, sum(v), k) for v in full) / len(full)
    return out


class BestCheckpoint:
    """--best_metric_key: keep the checkpoint whose evaluation scored best. As OpenRLHF: empty picks the
    pass@1 metric, "none" keeps none."""

    def __init__(self, key: str, resumed: dict | None = None):
        self.key = None if key == "none" else (key or "eval/pass@1")
        self.value = (resumed or {}).get("value", float("-inf"))

    def improved(self, metrics: dict) -> bool:
        if self.key is None or self.key not in metrics or not metrics[self.key] > self.value:
            return False
        self.value = metrics[self.key]
        return True

    def state(self) -> dict:
        return {"key": self.key, "value": self.value}


def text_scorer(a: dict):
    """score_text(prompts, completions, labels) -> (values, skipped) for the RL scripts' reward flags
    (--reward_func, --remote_rm_url, else the built-in task's rule), or None with --reward_pretrain,
    whose workers score instead."""
    from common.rewards import RemoteReward, load_reward_func, score_with_function
    from common.tasks import reward_func as builtin

    timeout, skip = a["reward_timeout"], a["skip_bad_rewards"]
    if a["reward_func"]:
        fn = load_reward_func(a["reward_func"])
        return lambda p, c, lab: score_with_function(fn, p, c, lab, timeout_s=timeout, skip_bad=skip)
    if a["remote_rm_url"]:
        remote = RemoteReward(a["remote_rm_url"], timeout_s=timeout)
        return lambda p, c, lab: remote(p, c, lab, skip_bad=skip)
    if a["reward_pretrain"]:
        return None
    return lambda p, c, lab: score_with_function(builtin, p, c, lab, timeout_s=timeout)
