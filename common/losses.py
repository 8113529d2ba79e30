"""Losses shared by the training scripts: sequence log-probs, reward-model, DPO and PPO-family losses
(token log-probs of the logits: common.logprobs).

Pure torch on tensors. Shapes: B sequences, T tokens, V vocabulary. Masks are 0/1 (float or bool)
of the same shape as the values they select; padding may hold anything (even inf/NaN), because
masked values are selected with `torch.where`, never multiplied by 0. All math is fp32 (fp64
inputs stay fp64), whatever the dtype of the inputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def _f(x: torch.Tensor) -> torch.Tensor:
    # fp32 at least: bf16 log-probs and ratios lose the small differences PPO and DPO live on.
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` where `mask` is 1. `x`, `mask`: same shape; `dim=None` sums everything."""
    x = torch.where(mask.bool(), _f(x), 0.0)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, eps: float = 1e-8) -> torch.Tensor:
    """Mean of `x` where `mask` is 1; 0 (not NaN) where nothing is selected."""
    count = mask.float().sum() if dim is None else mask.float().sum(dim)
    # clamp rather than add eps: the mean of n tokens stays exact and an empty selection gives 0.
    return masked_sum(x, mask, dim) / count.clamp_min(eps)


def sequence_logprobs(token_lp: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per-sequence log-prob: token_lp, mask: [B, T] -> [B]; the sum, or with `average` the mean
    over each sequence's own valid tokens (IPO, SimPO-style length normalisation)."""
    return masked_mean(token_lp, mask, dim=-1) if average else masked_sum(token_lp, mask, dim=-1)


def nll_loss(token_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood per valid token over the whole batch. [B, T] -> scalar."""
    return -masked_mean(token_lp, mask)


# ---- reward model --------------------------------------------------------------------------------

def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """mean(-log sigmoid(chosen - rejected - margin)). chosen, rejected, margin: [B] -> scalar.

    The margin (Llama 2) asks the chosen reward to lead by at least that much for a small loss."""
    diff = _f(chosen) - _f(rejected)
    if margin is not None:
        diff = diff - _f(margin)
    return -F.logsigmoid(diff).mean()


def log_exp_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """mean(log(1 + exp(rejected - chosen))), via softplus so large gaps do not overflow. [B] -> scalar."""
    return F.softplus(_f(rejected) - _f(chosen)).mean()


# ---- DPO -----------------------------------------------------------------------------------------

def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    ipo: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO (with conservative label smoothing) or IPO on sequence log-probs, all [B].

    Returns (loss scalar, chosen_reward [B], rejected_reward [B]); the rewards are
    beta * (policy - reference), detached, for logging. With policy == reference the DPO loss is
    ln 2. IPO's target margin 1/(2 beta) assumes length-averaged sequence log-probs
    (`sequence_logprobs(..., average=True)`); summed log-probs make the squared loss length-biased.
    """
    if ipo and label_smoothing:
        raise ValueError("label_smoothing applies to DPO only; IPO has no label noise term")
    pc, pr, rc, rr = _f(policy_chosen), _f(policy_rejected), _f(ref_chosen), _f(ref_rejected)
    logits = (pc - pr) - (rc - rr)
    if ipo:
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = (-(1.0 - label_smoothing) * F.logsigmoid(beta * logits)
                  - label_smoothing * F.logsigmoid(-beta * logits))
    return losses.mean(), (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()


# ---- PPO family ----------------------------------------------------------------------------------

def aggregate(loss: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    token_mean: mean over all valid tokens of the batch (long answers weigh more).
    seq_mean_token_mean: mean over each sequence's tokens, then over sequences (GRPO paper).
    seq_mean_token_sum_norm: each sequence's token sum divided by the constant T = mask.shape[1],
    then the mean over sequences (Dr. GRPO: no length bias).
    The sequence means count only rows with at least one valid token, so padding rows that fill
    a micro-batch do not dilute the loss.
    """
    if agg == "token_mean":
        return masked_mean(loss, mask)
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {', '.join(AGG_MODES)}")
    if agg == "seq_mean_token_mean":
        per_seq = masked_mean(loss, mask, dim=-1)
    else:
        per_seq = masked_sum(loss, mask, dim=-1) / mask.shape[1]
    return masked_mean(per_seq, mask.bool().any(-1))


def sampler_gap(logp: torch.Tensor, gen_logp: torch.Tensor, mask: torch.Tensor,
                is_threshold: float | None = None) -> tuple[dict[str, float], torch.Tensor | None]:
    """How far the trainer's log-probs of the sampled tokens are from the sampler's (vLLM's).

    logp, gen_logp, mask: [B, T]. Returns ({"logprob_diff": mean |gap|, "prob_ratio": mean
    exp(gap)[, "is_weight_mean"]}, truncated importance weights exp(gap) clamped at `is_threshold`
    [B, T], or None without a threshold).
    """
    gap = logp.detach() - gen_logp
    stats = {"logprob_diff": masked_mean(gap.abs(), mask).item(), "prob_ratio": masked_mean(gap.exp(), mask).item()}
    if is_threshold is None:
        return stats, None
    weights = gap.exp().clamp(max=is_threshold) * mask
    stats["is_weight_mean"] = masked_mean(weights, mask).item()
    return stats, weights


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    agg: str = "token_mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with asymmetric clip range (DAPO's clip-higher) and optional dual clip.

    All tensors [B, T]. ratio = exp(logp - old_logp); per-token loss
    -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A); with `dual_clip` = c > 1 the
    loss of tokens with A < 0 is further capped at -c * A (Ye et al. 2020), so a huge ratio on a
    bad token cannot blow up the step. `is_weights` (e.g. truncated importance weights between
    the rollout engine's and the trainer's log-probs) multiply the per-token loss as constants.

    Returns (loss, clip_frac, approx_kl), scalars: clip_frac is the fraction of valid tokens where
    the clipped branch set the loss; approx_kl is the k3 estimate of KL(old || new), detached.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    A = _f(advantages)
    log_ratio = _f(logp) - _f(old_logp)
    ratio = torch.exp(log_ratio)
    surr = ratio * A
    surr_clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * A
    loss = -torch.minimum(surr, surr_clipped)
    clipped = surr_clipped < surr
    if dual_clip is not None:
        loss = torch.where(A < 0, torch.minimum(loss, -dual_clip * A), loss)
    if is_weights is not None:
        loss = loss * _f(is_weights).detach()
    with torch.no_grad():
        clip_frac = masked_mean(clipped.float(), mask)
        # tokens were sampled from the old policy: k3 = (r - 1) - log r with r = new / old.
        approx_kl = masked_mean(torch.expm1(log_ratio) - log_ratio, mask)
    return aggregate(loss, mask, agg), clip_frac, approx_kl


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None,
) -> torch.Tensor:
    """0.5 * masked mean of the squared error to the returns; all [B, T] -> scalar.

    With `value_clip` = c the new value may move at most c from the rollout's value before the
    error stops shrinking: max((v - R)^2, (old + clip(v - old, -c, c) - R)^2).
    """
    v, R = _f(values), _f(returns)
    err = (v - R) ** 2
    if value_clip is not None:
        old = _f(old_values)
        v_clipped = old + torch.clamp(v - old, -value_clip, value_clip)
        err = torch.maximum(err, (v_clipped - R) ** 2)
    return 0.5 * masked_mean(err, mask)
