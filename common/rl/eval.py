"""The RL scripts' prompt sets, reward source and evaluation: training and held-out prompts, the scorer
of decoded responses, pass@k, the best checkpoint.

--eval_dataset (with --eval_split) gives held-out prompts in the training data's format; without it
the built-in task keeps its held-out split and a user's --prompt_data has none. Every evaluation
samples --eval_n_samples_per_prompt answers per prompt at --eval_temperature and logs
eval/reward_mean and eval/pass@k: the unbiased estimator of Chen et al. 2021 over each prompt's n
samples, a sample passing when its reward is >= --eval_correct_threshold (1.0: full marks of a 0-1
rule such as the built-in task's) unless the reward function returns a dict with a "pass" list
(common.rl.rewards). With --eval_steps N > 0 a run evaluates at step 0 too, the starting policy, so the
curve shows the improvement.

On the built-in task, whatever scores the answers (a reward model, say), rollout/ and eval/exact_match
say which share of them is right by the task's own rule: a reward that rises while they do not is
being exploited.

The end of a run judges its health over its last fifth of steps (`run_health`): more than
TRUNCATED_WARN of the responses hitting --generate_max_len, or a mean KL to the reference above
KL_WARN, is a warning line in the run's summary and a 1 in metrics.jsonl's health/*_warning.
"""
from __future__ import annotations

from math import comb

# The end-of-run bounds (`run_health`), also the scripts' per-step warnings. Healthy runs of the built-in
# pipeline stay far below both (no response truncated, KL under 0.5 nats per token); its reward-hacking
# run ended at 100% and 4.9.
TRUNCATED_WARN = 0.5  # share of the responses that hit --generate_max_len
KL_WARN = 1.0  # mean KL to the reference, nats per token (train/kl)


def load_prompts(a: dict, tokenizer) -> tuple[list, list, str, int]:
    """(training prompts, held-out prompts, the training data's description, prompts dropped as too long)."""
    from common.data.blend import EVAL_FLAGS, PROMPT_FLAGS, load_mixture
    from common.data.prompts import build_prompts
    from common.data.tasks import prompt_rows

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


def pass_metrics(scores, ok: list[int], passed: list, prompt_index: list[int], n: int,
                 threshold: float = 1.0) -> dict[str, float]:
    """eval/reward_mean over the usable samples, and eval/pass@k for k = 1, 2, 4, ... and n over the
    prompts with n usable samples. scores: [N] tensor; passed: [N] bools or None (then a sample passes
    when its score >= threshold, --eval_correct_threshold)."""
    usable = set(ok)
    by_prompt: dict[int, list[bool]] = {}
    for i, p in enumerate(prompt_index):
        if i in usable:
            hit = passed[i] if passed and passed[i] is not None else float(scores[i]) >= threshold
            by_prompt.setdefault(p, []).append(bool(hit))
    out = {"eval/reward_mean": float(scores[ok].mean()) if ok else float("nan")}
    full = [v for v in by_prompt.values() if len(v) == n]
    for k in sorted({2 ** j for j in range(n.bit_length()) if 2 ** j <= n} | {n}):
        if full:
            out[f"eval/pass@{k}"] = sum(pass_at_k(n, sum(v), k) for v in full) / len(full)
    return out


def task_metrics(texts: list[str], labels: list, prefix: str) -> dict[str, float]:
    """The built-in task's own verdict on decoded answers [N] against their labels [N], whatever reward the
    run trains on: <prefix>/exact_match, the share copied exactly (the rule's 1.0), and <prefix>/task_reward,
    the rule's mean (partial copies count in part)."""
    from common.data.tasks import copy_reward

    if not texts:
        return {}
    r = [copy_reward(t, y) for t, y in zip(texts, labels)]
    return {f"{prefix}/exact_match": sum(x == 1.0 for x in r) / len(r), f"{prefix}/task_reward": sum(r) / len(r)}


class BestCheckpoint:
    """--best_metric_key: keep the checkpoint whose evaluation scored best. As OpenRLHF: empty picks the
    pass@1 metric, "none" keeps none. A tie goes to the later step: a metric at its ceiling must not pin
    the first step that reached it, and more training at the same score is the better bet."""

    def __init__(self, key: str, resumed: dict | None = None):
        self.key = None if key == "none" else (key or "eval/pass@1")
        self.value = (resumed or {}).get("value", float("-inf"))
        self.step = (resumed or {}).get("step")

    def improved(self, metrics: dict, step: int | None = None) -> bool:
        if self.key is None or self.key not in metrics or not metrics[self.key] >= self.value:  # NaN never wins
            return False
        self.value, self.step = metrics[self.key], step
        return True

    def state(self) -> dict:
        return {"key": self.key, "value": self.value, "step": self.step}


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def run_health(history: list[dict], generate_max_len: int) -> tuple[dict[str, float], list[str], list[str]]:
    """The end-of-run verdict from each step's metrics (`history`, in step order): the first and the last
    fifth of the steps (one at least) compared. Returns (health/* metrics for metrics.jsonl, summary lines,
    warning lines): a warning when the last fifth's mean rollout/truncated_frac is above TRUNCATED_WARN
    or its mean train/kl above KL_WARN."""
    if not history:
        return {}, [], []
    k = max(1, len(history) // 5)
    first, last = history[:k], history[-k:]
    span = f"the first and last {k} step{'s' if k > 1 else ''}"
    lines = []
    for key in ("rollout/reward_mean", "rollout/exact_match", "rollout/truncated_frac", "train/kl"):
        a, b = _mean(first, key), _mean(last, key)
        if a is not None and b is not None:
            lines.append(f"{key} {a:.3g} -> {b:.3g}")
    lines = [f"summary ({span}): " + ", ".join(lines)] if lines else []
    metrics, warnings = {}, []
    trunc, kl = _mean(last, "rollout/truncated_frac"), _mean(last, "train/kl")
    checks = (  # (value key, warning key, value, bound, what the warning says past the bound)
        ("truncated_frac", "truncation_warning", trunc, TRUNCATED_WARN, lambda: (
            f"{trunc:.0%} of the responses of the last {k} step(s) hit --generate_max_len {generate_max_len} "
            f"(bound {TRUNCATED_WARN:.0%}): a reward that grows with length (a reward model that learned "
            "'longer is better'?) or a limit too short for the task. Read the samples; "
            "--stop_properly_penalty_coef or --overlong_buffer_len penalise such answers")),
        ("kl", "kl_warning", kl, KL_WARN, lambda: (
            f"the KL to the reference averaged {kl:.2f} over the last {k} step(s) (bound {KL_WARN:g}): the policy "
            "moved far from --pretrain, often by exploiting its reward; a larger --init_kl_coef or a smaller "
            "--actor_learning_rate keeps it closer")),
    )
    for key, flag, value, bound, say in checks:
        if value is not None:
            metrics[f"health/{key}"] = value
            metrics[f"health/{flag}"] = float(value > bound)
            if value > bound:
                warnings.append(say())
    return metrics, lines, warnings


def text_scorer(a: dict):
    """score_text(prompts, completions, labels) -> (values, skipped) for the RL scripts' reward flags
    (--reward_func, --remote_rm_url, else the built-in task's rule), or None with --reward_pretrain,
    whose workers score instead."""
    from common.rl.rewards import RemoteReward, load_reward_func, score_with_function
    from common.data.tasks import reward_func as builtin

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
