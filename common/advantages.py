"""Advantage estimators: KL penalties, token rewards, GAE, discounted returns, group baselines.

Pure torch on tensors. Shapes: B sequences, T response tokens, P prompts with n samples each.
Masks are 0/1 (float or bool) over the response tokens, normally right-padded; padding may hold
anything, since masked values are selected with `torch.where`. All math is fp32.
"""
from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3")
GROUP_KINDS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")


def _f(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy. [B, T] -> [B, T].

    With log_ratio = logp - ref_logp (Schulman, "Approximating KL divergence"):
    k1 = log_ratio (unbiased, can be negative); k2 = log_ratio^2 / 2 (biased, low variance);
    k3 = exp(-log_ratio) - 1 + log_ratio (unbiased and never negative).
    """
    log_ratio = _f(logp) - _f(ref_logp)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio ** 2 / 2
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last valid token: mask [B, T] -> [B] long (0 for an empty row)."""
    T = mask.shape[-1]
    pos = torch.arange(1, T + 1, device=mask.device)
    return (mask.bool() * pos).argmax(-1)


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """PPO's per-token reward: -kl_coef * kl on every valid token, plus the sequence's score on its
    last valid token. scores: [B], kl, mask: [B, T] -> [B, T], zeros on padding (and on rows with
    no valid token, which get no score)."""
    valid = mask.bool()
    rewards = torch.where(valid, -kl_coef * _f(kl), 0.0)
    score = torch.where(valid.any(-1), _f(scores), 0.0).to(rewards.dtype)
    return rewards.scatter_add(1, last_valid_index(mask)[:, None], score[:, None])


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation. rewards, values, mask: [B, T] -> (advantages, returns), [B, T].

    The value after a sequence's last valid token is 0 (the episode ends there). Masked tokens are
    skipped: the recursion carries over them, so right padding and masked holes (e.g. tool output
    inside a response) both work. returns = advantages + values; both are 0 on masked tokens.
    """
    r, v, valid = _f(rewards), _f(values), mask.bool()
    B, T = r.shape
    adv = torch.zeros_like(r)
    next_value = r.new_zeros(B)
    running = r.new_zeros(B)
    for t in reversed(range(T)):
        m = valid[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = torch.where(m, delta + gamma * lambd * running, running)
        next_value = torch.where(m, v[:, t], next_value)
        adv[:, t] = torch.where(m, running, 0.0)
    returns = torch.where(valid, adv + v, 0.0)
    return adv, returns


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go sum_{k >= t} gamma^(k - t) r_k over valid tokens. [B, T] -> [B, T], 0 on padding.

    REINFORCE++ uses these as advantages after `whiten` over the batch."""
    r, valid = _f(rewards), mask.bool()
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid[:, t], running, 0.0)
    return out


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over all valid tokens of the batch; [B, T] -> [B, T], 0 on padding.

    std is the population std (divides by the token count). With `shift_mean=False` the mean is
    added back, so only the scale changes (keeps the sign of e.g. all-positive returns).
    """
    x, valid = _f(x), mask.bool()
    count = valid.sum().clamp_min(1)
    mean = torch.where(valid, x, 0.0).sum() / count
    var = torch.where(valid, (x - mean) ** 2, 0.0).sum() / count
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, 0.0)


def _groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    if scores.dim() != 1 or n < 1 or scores.numel() % n:
        raise ValueError(
            f"scores must be 1-D with a length divisible by n_samples_per_prompt={n}, "
            f"got shape {tuple(scores.shape)}")
    return _f(scores).view(-1, n)


def group_advantages(
    scores: torch.Tensor, n: int, kind: str, std_norm: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantage from a baseline over its prompt's group. scores: [P * n] -> [P * n].

    Scores come in consecutive blocks of n samples per prompt. kind:
    group_norm: s - group mean, divided by (group std + eps) when `std_norm` (GRPO);
    dr_grpo: s - group mean, never divided by the std (Dr. GRPO);
    rloo: s - mean of the other n - 1 samples (leave-one-out);
    reinforce_baseline: s - group mean; the caller then whitens over the batch (REINFORCE++-baseline).
    The group std is the unbiased one (divides by n - 1), as in the GRPO implementations people
    compare against.
    """
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown advantage estimator {kind!r}; choose one of {', '.join(GROUP_KINDS)}")
    if n == 1:
        raise ValueError(
            f"the {kind} estimator compares samples of the same prompt and needs "
            f"n_samples_per_prompt > 1, got 1")
    s = _groups(scores, n)
    mean = s.mean(-1, keepdim=True)
    if kind == "rloo":
        adv = s - (s.sum(-1, keepdim=True) - s) / (n - 1)
    else:
        adv = s - mean
        if kind == "group_norm" and std_norm:
            adv = adv / (s.std(-1, unbiased=True, keepdim=True) + eps)
    return adv.reshape(-1)


def group_all_equal(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Which prompts' n samples all scored the same (no learning signal; DAPO's dynamic sampling
    drops them). scores: [P * n] -> [P] bool."""
    s = _groups(scores, n)
    return (s == s[:, :1]).all(-1)
