"""Losses shared by the training scripts: sequence log-probs, reward-model, DPO and PPO-family losses
(token log-probs of the logits: common.algo.logprobs).

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

def aggregate(loss: torch.Tensor, mask: torch.Tensor, agg: str, *, step_tokens: float | None = None,
              step_seqs: float | None = None, norm_len: int | None = None) -> torch.Tensor:
    """This micro-batch's share of a step's loss: a per-token loss [B, T] -> scalar.

    A step's loss is the sum of its micro-batches' shares, averaged over the data-parallel ranks
    (what DeepSpeed's gradient accumulation and all-reduce compute when each share is backpropagated
    unscaled). `step_tokens` / `step_seqs` are the step's valid tokens / non-empty sequences over
    all micro-batches and ranks, divided by the number of ranks (`common.rl.workers` passes them);
    left out, they are this micro-batch's own, so the share is the micro-batch's mean.

    token_mean: every valid token of the step weighs the same (DAPO; long answers weigh more).
    seq_mean_token_mean: each sequence's mean over its tokens, averaged over the step's sequences (GRPO paper).
    seq_mean_token_sum_norm: each sequence's token sum divided by the constant `norm_len` (the
    generation budget, --generate_max_len; default the mask's width), averaged over the step's
    sequences (Dr. GRPO: no length bias, and the same constant in every micro-batch and step).
    Rows without a valid token (padding rows) count in no mean.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {', '.join(AGG_MODES)}")
    if agg == "token_mean":
        tokens = mask.float().sum().clamp_min(1e-8) if step_tokens is None else max(step_tokens, 1e-8)
        return masked_sum(loss, mask) / tokens
    if agg == "seq_mean_token_mean":
        per_seq = masked_mean(loss, mask, dim=-1)
    else:
        per_seq = masked_sum(loss, mask, dim=-1) / (norm_len or mask.shape[1])
    rows = mask.bool().any(-1)
    seqs = rows.float().sum().clamp_min(1e-8) if step_seqs is None else max(step_seqs, 1e-8)
    return masked_sum(per_seq, rows) / seqs


IS_KINDS = ("tis", "icepop", "seq-mask-tis")
# A ratio is exp of at most this log-ratio (e^20 ~ 5e8): past it the gradient would overflow.
MAX_LOG_RATIO = 20.0
# A token's log-ratio is held within this before a sequence sums or averages it, so the sum stays
# finite (a difference of two finite fp32 log-probs may not be); no real log-prob gap comes near it.
TOKEN_LOG_RATIO_BOUND = 1e6


def sampler_gap(logp: torch.Tensor, gen_logp: torch.Tensor, mask: torch.Tensor,
                correction: tuple[str, float, float] | None = None) -> tuple[dict[str, float], torch.Tensor | None]:
    """How far the trainer's log-probs of the sampled tokens are from the sampler's (vLLM's), and the
    importance weights that correct for it.

    logp, gen_logp, mask: [B, T]. `correction` = (kind, low, high) with w = exp(logp - gen_logp):
    tis: w clamped to [low, high] (truncated IS); icepop: w where low <= w <= high, else 0 (token
    mask); seq-mask-tis: w, but 0 on whole sequences whose geometric-mean ratio
    exp(mean_t log w) lies outside [low, high] (OpenRLHF's three kinds at 76351db1; w is capped at
    e^20). Returns ({"logprob_diff": mean |gap|, "prob_ratio": mean exp(gap), "vllm_kl":
    mean(gen - logp)[, "is_weight_mean", and "is_clipped_frac" (tis) or "is_masked_token_frac"
    (icepop, seq-mask-tis), and with seq-mask-tis "is_masked_seq_frac"]}, weights [B, T] or None
    without a correction). All are means over valid tokens, except is_masked_seq_frac: the share of
    sequences (with a valid token) that seq-mask-tis zeroed, the unit it decides on.
    """
    gap = (_f(logp.detach()) - _f(gen_logp)).clamp(-TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)
    stats = {"logprob_diff": masked_mean(gap.abs(), mask).item(), "prob_ratio": masked_mean(gap.exp(), mask).item(),
             "vllm_kl": masked_mean(-gap, mask).item()}
    if correction is None:
        return stats, None
    kind, low, high = correction
    w = gap.clamp(max=MAX_LOG_RATIO).exp()  # a gap past e^20 is a broken sampler; keep the weights finite
    if kind == "tis":
        weights = w.clamp(low, high)
        stats["is_clipped_frac"] = masked_mean(((w < low) | (w > high)).float(), mask).item()
    elif kind == "icepop":
        keep = (w >= low) & (w <= high)
        weights = torch.where(keep, w, 0.0)
        stats["is_masked_token_frac"] = masked_mean((~keep).float(), mask).item()
    elif kind == "seq-mask-tis":
        seq = masked_mean(gap, mask, dim=-1).exp()
        keep_seq = (seq >= low) & (seq <= high)
        keep = keep_seq[:, None].expand_as(w)
        weights = torch.where(keep, w, 0.0)
        stats["is_masked_token_frac"] = masked_mean((~keep).float(), mask).item()
        stats["is_masked_seq_frac"] = masked_mean((~keep_seq).float(), mask.bool().any(-1)).item()
    else:
        raise ValueError(f"unknown IS correction {kind!r}; choose one of {', '.join(IS_KINDS)}")
    weights = torch.where(mask.bool(), weights, 0.0)
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
    loss_type: str = "ppo",
    gen_logp: torch.Tensor | None = None,
    **agg_kw,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with asymmetric clip range (DAPO's clip-higher) and optional dual clip,
    or GSPO's sequence-level ratio.

    All tensors [B, T]. ppo: ratio = exp(logp - old_logp) per token (log-ratio clamped to +-20, as
    OpenRLHF's later loss); gspo (Zheng et al. 2025): one ratio per sequence, exp(mean over its
    tokens of logp - old_logp), taken against the sampler's log-probs `gen_logp` instead when given
    (OpenRLHF's IS-corrected variant; TRL keeps the ratio against old_logp and multiplies the loss by
    the sampler's IS weights instead), the same ratio on each of its tokens. The sequence's mean
    log-ratio is clamped to +-20, not each token's: a token past 20 still counts in full, as in
    OpenRLHF and TRL (which clamp nothing there), and exp stays finite. Per-token loss
    -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A); with `dual_clip` = c > 1 the loss
    of tokens with A < 0 is further capped at -c * A (Ye et al. 2020). `is_weights` (sampler_gap's)
    multiply the per-token loss as constants (ppo only, as OpenRLHF). `agg` and `agg_kw` go to
    `aggregate`: the result is this micro-batch's share of the step's loss.

    Returns (loss, clip_frac, approx_kl), scalars: clip_frac is the fraction of valid tokens where
    the clipped branch set the loss; approx_kl is the k3 estimate of KL(old || new), detached.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    A = _f(advantages)
    log_ratio = (_f(logp) - _f(old_logp)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if loss_type == "ppo":
        ratio = torch.exp(log_ratio)
    elif loss_type == "gspo":
        base = old_logp if gen_logp is None else gen_logp
        token_lr = (_f(logp) - _f(base)).clamp(-TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)
        seq_lr = masked_mean(token_lr, mask, dim=-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio = torch.exp(seq_lr)[:, None].expand_as(A)
        is_weights = None
    else:
        raise ValueError(f"unknown policy loss type {loss_type!r}; choose ppo or gspo")
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
    return aggregate(loss, mask, agg, **agg_kw), clip_frac, approx_kl


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None,
    **agg_kw,
) -> torch.Tensor:
    """0.5 * the token mean of the squared error to the returns; all [B, T] -> scalar (this
    micro-batch's share of the step's token mean: `aggregate`'s token_mean with `agg_kw`).

    With `value_clip` = c the new value may move at most c from the rollout's value before the
    error stops shrinking: max((v - R)^2, (old + clip(v - old, -c, c) - R)^2).
    """
    v, R = _f(values), _f(returns)
    err = (v - R) ** 2
    if value_clip is not None:
        old = _f(old_values)
        v_clipped = old + torch.clamp(v - old, -value_clip, value_clip)
        err = torch.maximum(err, (v_clipped - R) ** 2)
    return 0.5 * aggregate(err, mask, "token_mean", **agg_kw)
