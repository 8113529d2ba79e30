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


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str, clamp: float = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy. [B, T] -> [B, T].

    With log_ratio = logp - ref_logp (Schulman, "Approximating KL divergence"):
    k1 = log_ratio (unbiased, can be negative); k2 = log_ratio^2 / 2 (biased, low variance);
    k3 = exp(-log_ratio) - 1 + log_ratio (unbiased and never negative). Each estimate is clamped
    to [-clamp, clamp], as OpenRLHF does: one token the reference finds near-impossible (k3 grows
    like exp) would otherwise swamp a sequence's reward.

    The log-ratio itself is clamped first, to +-(clamp + 10): each estimate reaches +-clamp before
    the log-ratio reaches +-(clamp + 1), so no value changes (OpenRLHF's values, for every input
    where they are finite), but nothing overflows. Without it k3's exp overflowed below a log-ratio
    of about -89 in fp32 and its gradient became 0 * inf = NaN behind the clamp (k2's likewise at
    fp32's largest values).
    """
    bound = clamp + 10.0
    log_ratio = (_f(logp) - _f(ref_logp)).clamp(-bound, bound)
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = log_ratio ** 2 / 2
    elif kind == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")
    return kl.clamp(-clamp, clamp)


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


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
           std_norm: bool = True) -> torch.Tensor:
    """(x - mean) / std over all valid tokens of the batch; [B, T] -> [B, T], 0 on padding.

    std is the population std (divides by the token count), its variance floored at `eps` as
    OpenRLHF does. `std_norm=False` only subtracts the mean (--no_advantage_std_norm); with
    `shift_mean=False` the mean is added back, so only the scale changes. A batch whose valid values
    all tie gives exactly 0 (before the mean is added back), as tied groups do in `group_advantages`:
    the computed mean of copies of a value the dtype cannot hold (2/3, 0.1) is off by a rounding
    error, which the division by the floored std would scale up (to 6e-4 for 20 tokens of 2/3 in fp32).
    """
    x, valid = _f(x), mask.bool()
    count = valid.sum().clamp_min(1)
    mean = torch.where(valid, x, 0.0).sum() / count
    tied = torch.where(valid, x, torch.inf).amin() == torch.where(valid, x, -torch.inf).amax()
    out = torch.where(tied, 0.0, x - mean)
    if std_norm:
        var = torch.where(valid, out ** 2, 0.0).sum() / count
        out = out * torch.rsqrt(var.clamp_min(eps))
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
    scores: torch.Tensor, n: int, kind: str, std_norm: bool = True, eps: float = 1e-9
) -> torch.Tensor:
    """Per-sample advantage from a baseline over its prompt's group. scores: [P * n] -> [P * n].

    Scores come in consecutive blocks of n samples per prompt. kind:
    group_norm: s - group mean, divided by (group std + eps) when `std_norm` (GRPO; eps 1e-9 as
    OpenRLHF, TRL uses 1e-4), else only mean-centred (--no_advantage_std_norm);
    dr_grpo: s - group mean, never divided by the std (Dr. GRPO);
    rloo: s - mean of the other n - 1 samples (leave-one-out);
    reinforce_baseline: s - group mean; the caller then whitens over the batch (REINFORCE++-baseline).
    The group std is the unbiased one (divides by n - 1), as in the GRPO implementations people
    compare against.

    A group whose scores all tie gets exactly 0, whatever the kind and dtype. The formula alone
    does not give that: the computed mean of n copies of a value the dtype cannot hold (2/3, 0.1)
    is off by a rounding error, which group_norm divides by a std of that size plus 1e-9 (in fp32:
    0.92 for a lone group of 2/3, 60 in a batch of them; OpenRLHF's formula does the same).
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
    tied = (s == s[:, :1]).all(-1, keepdim=True)
    return torch.where(tied, 0.0, adv).reshape(-1)


def group_all_equal(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Which prompts' n samples all scored the same (no learning signal; DAPO's dynamic sampling
    drops them). scores: [P * n] -> [P] bool."""
    s = _groups(scores, n)
    return (s == s[:, :1]).all(-1)


def rl_advantages(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, *, estimator: str, n: int, kl_coef: float,
    gamma: float = 1.0, lambd: float = 1.0, values: torch.Tensor | None = None, std_norm: bool = True,
    reward_clip: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every estimator's advantages from sequence scores [B] and per-token KL [B, T] -> (advantages,
    returns), [B, T], 0 on padding. Both RL scripts call this, so their estimators agree.

    1. Group estimators first replace each score by its group-relative value (`group_advantages`;
       a group whose scores tie gets 0). group_norm divides by the group std unless std_norm is
       False (--no_advantage_std_norm, which in OpenRLHF's code reaches the whitening only).
    2. The result is clipped to `reward_clip` (--reward_clip_range) and becomes the reward of the
       sequence's last valid token, with -kl_coef * KL_t on every token t (`token_rewards`).
    3. gae: GAE over `values` [B, T]; every other estimator: the undiscounted reward-to-go, so token t's
       advantage is A_seq - kl_coef * sum_{k >= t} KL_k (REINFORCE++, Hu 2025; gamma must be 1
       for the group estimators, whose A_seq is a sequence-level quantity).
    4. gae, reinforce and reinforce_baseline are then whitened over the batch's valid tokens
       (mean only with std_norm False); group_norm, dr_grpo and rloo keep their scale.
    dr_grpo and rloo never divide by a std, so std_norm False is refused with them rather than ignored.
    """
    if estimator in GROUP_KINDS:
        if gamma != 1.0:
            raise ValueError(f"the {estimator} estimator needs gamma 1, got {gamma}")
        if not std_norm and estimator in ("dr_grpo", "rloo"):
            raise ValueError(f"the {estimator} estimator never divides by a std; std_norm False changes nothing")
        shaped = group_advantages(scores, n, estimator, std_norm=std_norm)
    elif estimator in ("gae", "reinforce"):
        shaped = _f(scores)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    if reward_clip is not None:
        shaped = shaped.clamp(*reward_clip)
    rewards = token_rewards(shaped, kl, mask, kl_coef)
    if estimator == "gae":
        if values is None:
            raise ValueError("gae needs the critic's values")
        adv, returns = gae(rewards, values, mask, gamma, lambd)
    else:
        returns = discounted_returns(rewards, mask, gamma)
        adv = returns
    if estimator in ("gae", "reinforce", "reinforce_baseline"):
        adv = whiten(adv, mask, std_norm=std_norm)
    return adv, returns


def length_penalties(scores: torch.Tensor, response_len: torch.Tensor, truncated: torch.Tensor, *,
                     max_new_tokens: int, overlong_buffer_len: float | None = None,
                     overlong_penalty_factor: float = 1.0,
                     stop_properly_penalty_coef: float | None = None) -> tuple[torch.Tensor, dict]:
    """Length shaping of scores [B] before any baseline; response_len [B] (tokens), truncated [B] bool.

    DAPO's overlong penalty (Yu et al. 2025): a response longer than max_new_tokens - buffer loses
    factor * min(excess, buffer) / buffer. ProRL's stop-properly penalty: a truncated response's
    score is multiplied by the coefficient when it is in [0, 1], or replaced by it when negative.
    Returns (scores, {"overlong_frac", "truncated_frac"} of the samples each penalty touched).
    """
    out, stats = _f(scores).clone(), {}
    if overlong_buffer_len is not None:
        excess = (_f(response_len) - (max_new_tokens - overlong_buffer_len)).clamp(max=overlong_buffer_len)
        hit = excess > 0
        out = torch.where(hit, out - excess / overlong_buffer_len * overlong_penalty_factor, out)
        stats["overlong_frac"] = hit.float().mean().item()
    if stop_properly_penalty_coef is not None:
        cut = truncated.bool()
        c = stop_properly_penalty_coef
        out = torch.where(cut, torch.full_like(out, c) if c < 0 else out * c, out)
        stats["stop_penalized_frac"] = cut.float().mean().item()
    return out, stats


class KLController:
    """The KL coefficient: fixed, or adaptive towards `target` (Ziegler et al. 2019), where after
    each step the coefficient is multiplied by 1 + clip(kl / target - 1, -0.2, 0.2) * samples / horizon."""

    def __init__(self, init: float, target: float | None = None, horizon: int = 10000):
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, kl: float, samples: int) -> None:
        if self.target:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * samples / self.horizon
