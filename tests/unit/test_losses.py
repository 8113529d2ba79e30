"""common.algo.losses against naive per-element Python references."""
import math

import pytest
import torch

from common.algo import losses as L

torch.manual_seed(0)


def make_mask(lengths, T):
    """Right-padded 0/1 float mask with the given valid lengths per row."""
    return torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])


LENGTHS = [5, 1, 3, 0, 5]  # full row, one valid token, padded row, all-masked row, full row
T = 5


def rand_bt():
    return torch.randn(len(LENGTHS), T)


# ---- masked reductions ---------------------------------------------------------------------------

def test_masked_sum_mean_match_loops_and_ignore_nonfinite_padding():
    x, mask = rand_bt(), make_mask(LENGTHS, T)
    x[mask == 0] = float("inf")  # padding garbage must not leak
    xs = [[float(x[b, t]) for t in range(T) if mask[b, t]] for b in range(len(LENGTHS))]
    flat = [v for row in xs for v in row]
    assert L.masked_sum(x, mask).item() == pytest.approx(sum(flat), abs=1e-5)
    assert L.masked_mean(x, mask).item() == pytest.approx(sum(flat) / len(flat), abs=1e-6)
    row_sum = L.masked_sum(x, mask, dim=-1)
    row_mean = L.masked_mean(x, mask.bool(), dim=-1)
    for b, row in enumerate(xs):
        assert row_sum[b].item() == pytest.approx(sum(row), abs=1e-5)
        assert row_mean[b].item() == pytest.approx(sum(row) / len(row) if row else 0.0, abs=1e-6)
    assert torch.isfinite(row_mean).all()
    assert L.masked_mean(x, torch.zeros_like(mask)).item() == 0.0


# ---- sequence log-probs and NLL ----------------------------------------------------------------

def test_sequence_logprobs_sum_and_length_correct_mean():
    lp, mask = rand_bt(), make_mask(LENGTHS, T)
    s = L.sequence_logprobs(lp, mask)
    m = L.sequence_logprobs(lp, mask, average=True)
    for b, n in enumerate(LENGTHS):
        row = [float(lp[b, t]) for t in range(n)]
        assert s[b].item() == pytest.approx(sum(row), abs=1e-5)
        assert m[b].item() == pytest.approx(sum(row) / n if n else 0.0, abs=1e-6)


def test_nll_loss_is_mean_over_all_valid_tokens():
    lp, mask = rand_bt(), make_mask(LENGTHS, T)
    vals = [float(lp[b, t]) for b, n in enumerate(LENGTHS) for t in range(n)]
    assert L.nll_loss(lp, mask).item() == pytest.approx(-sum(vals) / len(vals), abs=1e-6)


# ---- reward model --------------------------------------------------------------------------------

def naive_logsigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def test_bradley_terry_with_and_without_margin():
    c, r, m = torch.randn(6), torch.randn(6), torch.rand(6)
    ref = sum(-naive_logsigmoid(float(c[i] - r[i])) for i in range(6)) / 6
    ref_m = sum(-naive_logsigmoid(float(c[i] - r[i] - m[i])) for i in range(6)) / 6
    assert L.bradley_terry_loss(c, r).item() == pytest.approx(ref, abs=1e-6)
    assert L.bradley_terry_loss(c, r, m).item() == pytest.approx(ref_m, abs=1e-6)
    assert L.bradley_terry_loss(torch.zeros(3), torch.zeros(3)).item() == pytest.approx(math.log(2))


def test_log_exp_loss_matches_formula_and_is_stable():
    c, r = torch.randn(6), torch.randn(6)
    ref = sum(math.log(1 + math.exp(float(r[i] - c[i]))) for i in range(6)) / 6
    assert L.log_exp_loss(c, r).item() == pytest.approx(ref, abs=1e-6)
    big = L.log_exp_loss(torch.tensor([0.0, 1000.0]), torch.tensor([1000.0, 0.0]))
    assert big.item() == pytest.approx(500.0)  # (1000 + ~0) / 2, no overflow


# ---- DPO -----------------------------------------------------------------------------------------

def test_dpo_loss_is_ln2_when_policy_equals_reference():
    c, r = torch.randn(4) * 10, torch.randn(4) * 10
    for ls in (0.0, 0.1):
        loss, cr, rr = L.dpo_loss(c, r, c.clone(), r.clone(), beta=0.1, label_smoothing=ls)
        assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
        assert cr.abs().max() == 0 and rr.abs().max() == 0


def test_dpo_label_smoothing_ipo_and_rewards_by_hand():
    pc, pr = torch.tensor([-3.0, -10.0], requires_grad=True), torch.tensor([-5.0, -9.0], requires_grad=True)
    rc, rr = torch.tensor([-4.0, -9.5]), torch.tensor([-4.5, -9.0])
    beta, ls = 0.5, 0.2
    z = [(-3 + 5) - (-4 + 4.5), (-10 + 9) - (-9.5 + 9)]  # [1.5, -0.5]
    ref = sum(-(1 - ls) * naive_logsigmoid(beta * x) - ls * naive_logsigmoid(-beta * x) for x in z) / 2
    loss, cr, rej = L.dpo_loss(pc, pr, rc, rr, beta, label_smoothing=ls)
    assert loss.item() == pytest.approx(ref, abs=1e-6)
    assert cr.tolist() == pytest.approx([beta * 1.0, beta * -0.5])
    assert rej.tolist() == pytest.approx([beta * -0.5, 0.0])
    assert not cr.requires_grad and not rej.requires_grad
    ipo, _, _ = L.dpo_loss(pc, pr, rc, rr, beta, ipo=True)
    assert ipo.item() == pytest.approx(sum((x - 1 / (2 * beta)) ** 2 for x in z) / 2, abs=1e-6)
    with pytest.raises(ValueError):
        L.dpo_loss(pc, pr, rc, rr, beta, label_smoothing=0.1, ipo=True)


# ---- PPO family ----------------------------------------------------------------------------------

def naive_policy_loss(logp, old, A, mask, el, eh, dual=None, agg="token_mean", w=None):
    B, T_ = logp.shape
    per, nclip, nvalid = [], 0, 0
    for b in range(B):
        row = []
        for t in range(T_):
            if not mask[b, t]:
                continue
            ratio = math.exp(float(logp[b, t] - old[b, t]))
            a = float(A[b, t])
            s1, s2 = ratio * a, min(max(ratio, 1 - el), 1 + eh) * a
            loss = -min(s1, s2)
            nclip += s2 < s1
            nvalid += 1
            if dual is not None and a < 0:
                loss = min(loss, -dual * a)
            if w is not None:
                loss *= float(w[b, t])
            row.append(loss)
        per.append(row)
    if agg == "token_mean":
        flat = [x for row in per for x in row]
        total = sum(flat) / len(flat)
    elif agg == "seq_mean_token_mean":
        rows = [sum(r) / len(r) for r in per if r]
        total = sum(rows) / len(rows)
    else:
        rows = [sum(r) / T_ for r in per if r]
        total = sum(rows) / len(rows)
    return total, nclip / nvalid


@pytest.mark.parametrize("agg", L.AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_matches_naive(agg, dual):
    mask = make_mask(LENGTHS, T)
    logp, old = rand_bt() * 0.3, rand_bt() * 0.3
    A, w = rand_bt(), torch.rand(len(LENGTHS), T)
    logp[mask == 0] = float("nan")  # padding garbage
    loss, clip_frac, kl = L.policy_loss(logp, old, A, mask, 0.2, 0.28, dual_clip=dual, agg=agg, is_weights=w)
    ref, ref_clip = naive_policy_loss(logp, old, A, mask, 0.2, 0.28, dual, agg, w)
    assert loss.item() == pytest.approx(ref, abs=1e-5)
    assert clip_frac.item() == pytest.approx(ref_clip, abs=1e-6)
    ratios = [math.exp(float(logp[b, t] - old[b, t])) for b, n in enumerate(LENGTHS) for t in range(n)]
    ref_kl = sum(r - 1 - math.log(r) for r in ratios) / len(ratios)  # k3 of KL(old || new)
    assert kl.item() == pytest.approx(ref_kl, abs=1e-6)


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    mask = make_mask(LENGTHS, T)
    logp, A = rand_bt(), rand_bt()
    loss, clip_frac, kl = L.policy_loss(logp, logp.clone(), A, mask, 0.2, 0.2)
    assert loss.item() == pytest.approx(-L.masked_mean(A, mask).item(), abs=1e-6)
    assert clip_frac.item() == 0.0 and kl.item() == pytest.approx(0.0, abs=1e-7)


def test_policy_loss_clipping_engages_exactly_beyond_the_bounds():
    el, eh, d = 0.2, 0.3, 1e-3
    ratios = torch.tensor([[1 + eh - d, 1 + eh + d, 1 - el + d, 1 - el - d]])
    A = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    old = torch.zeros(1, 4)
    logp = torch.log(ratios).requires_grad_()
    mask = torch.ones(1, 4)
    per_token = []
    for i in range(4):
        m = torch.zeros(1, 4)
        m[0, i] = 1
        loss, cf, _ = L.policy_loss(logp, old, A, m, el, eh)
        g, = torch.autograd.grad(loss, logp)
        per_token.append((loss.item(), cf.item(), g[0, i].item()))
    # inside the range: loss -r*A with a gradient; beyond it: the constant clipped value, no gradient
    assert per_token[0][:2] == pytest.approx((-(1 + eh - d), 0.0)) and per_token[0][2] != 0
    assert per_token[1] == pytest.approx((-(1 + eh), 1.0, 0.0))
    assert per_token[2][:2] == pytest.approx((1 - el + d, 0.0)) and per_token[2][2] != 0
    assert per_token[3] == pytest.approx((1 - el, 1.0, 0.0))
    _, cf, _ = L.policy_loss(logp, old, A, mask, el, eh)
    assert cf.item() == pytest.approx(0.5)
    # positive A with a small ratio and negative A with a large ratio are not clipped (pessimistic min)
    loss, cf, _ = L.policy_loss(torch.log(torch.tensor([[0.5, 2.0]])), torch.zeros(1, 2),
                                torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), el, eh)
    assert cf.item() == 0.0 and loss.item() == pytest.approx((-0.5 + 2.0) / 2)


def test_dual_clip_bounds_negative_advantage_loss():
    logp = torch.log(torch.tensor([[10.0, 10.0, 10.0]])).requires_grad_()
    A = torch.tensor([[-1.0, 2.0, -0.5]])
    loss, _, _ = L.policy_loss(logp, torch.zeros(1, 3), A, torch.ones(1, 3), 0.2, 0.2, dual_clip=3.0)
    # A<0: min(10 * |A|, 3 * |A|); A>0 clipped at 1.2 * A, untouched by the dual clip
    assert loss.item() == pytest.approx((3.0 - 1.2 * 2.0 + 1.5) / 3)
    without, _, _ = L.policy_loss(logp, torch.zeros(1, 3), A, torch.ones(1, 3), 0.2, 0.2)
    assert without.item() == pytest.approx((10.0 - 2.4 + 5.0) / 3)
    with pytest.raises(ValueError):
        L.policy_loss(logp, torch.zeros(1, 3), A, torch.ones(1, 3), 0.2, 0.2, dual_clip=0.9)


def test_agg_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert L.aggregate(loss, mask, "token_mean").item() == pytest.approx(20 / 5)
    assert L.aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2.5 + 10) / 2)
    assert L.aggregate(loss, mask, "seq_mean_token_sum_norm").item() == pytest.approx((10 / 4 + 10 / 4) / 2)
    with pytest.raises(ValueError, match="token_mean"):
        L.policy_loss(loss, loss, loss, mask, 0.2, 0.2, agg="sum")


def test_value_loss_matches_naive():
    mask = make_mask(LENGTHS, T)
    v, old, R = rand_bt(), rand_bt(), rand_bt()
    for clip in (None, 0.2):
        errs = []
        for b, n in enumerate(LENGTHS):
            for t in range(n):
                e = (float(v[b, t]) - float(R[b, t])) ** 2
                if clip is not None:
                    vc = float(old[b, t]) + min(max(float(v[b, t] - old[b, t]), -clip), clip)
                    e = max(e, (vc - float(R[b, t])) ** 2)
                errs.append(e)
        assert L.value_loss(v, old, R, mask, clip).item() == pytest.approx(0.5 * sum(errs) / len(errs), abs=1e-5)


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_sampler_gap_and_is_corrections_match_a_loop_over_valid_tokens(kind):
    torch.manual_seed(3)
    logp, gen = -torch.rand(4, 5) * 2, -torch.rand(4, 5) * 2
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
    gen[mask == 0] = 0.0  # what make_batch leaves at padding
    low, high = 0.5, 2.0
    stats, w = L.sampler_gap(logp, gen, mask, (kind, low, high))
    pairs = [(float(logp[i, t]), float(gen[i, t])) for i in range(4) for t in range(5) if mask[i, t]]
    assert stats["logprob_diff"] == pytest.approx(sum(abs(a - b) for a, b in pairs) / len(pairs), rel=1e-5)
    assert stats["prob_ratio"] == pytest.approx(sum(math.exp(a - b) for a, b in pairs) / len(pairs), rel=1e-5)
    assert stats["vllm_kl"] == pytest.approx(sum(b - a for a, b in pairs) / len(pairs), rel=1e-5)
    for i in range(4):  # the weights, token by token (OpenRLHF's tis / icepop / seq-mask-tis)
        toks = [t for t in range(5) if mask[i, t]]
        seq_ratio = math.exp(sum(float(logp[i, t] - gen[i, t]) for t in toks) / len(toks))
        for t in range(5):
            r = math.exp(float(logp[i, t] - gen[i, t]))
            if not mask[i, t]:
                ref = 0.0
            elif kind == "tis":
                ref = min(max(r, low), high)
            elif kind == "icepop":
                ref = r if low <= r <= high else 0.0
            else:
                ref = r if low <= seq_ratio <= high else 0.0
            assert float(w[i, t]) == pytest.approx(ref, rel=1e-5)
    # the shares each kind logs, in the unit its name says: valid tokens, or sequences for seq-mask-tis
    ratios = [[math.exp(float(logp[i, t] - gen[i, t])) for t in range(5) if mask[i, t]] for i in range(4)]
    outside = [[not low <= r <= high for r in row] for row in ratios]
    geo_out = [not low <= math.exp(sum(math.log(r) for r in row) / len(row)) <= high for row in ratios]
    tokens = sum(len(row) for row in ratios)
    if kind == "tis":
        expect = {"is_clipped_frac": sum(map(sum, outside)) / tokens}
    elif kind == "icepop":
        expect = {"is_masked_token_frac": sum(map(sum, outside)) / tokens}
    else:
        expect = {"is_masked_token_frac": sum(len(row) for row, o in zip(ratios, geo_out) if o) / tokens,
                  "is_masked_seq_frac": sum(geo_out) / len(ratios)}
    assert {k: stats[k] for k in stats if k.startswith("is_") and k != "is_weight_mean"} == pytest.approx(expect)
    assert all(0 < v < 1 for v in expect.values())  # the bounds bite here
    assert L.sampler_gap(logp, gen, mask)[1] is None and "is_weight_mean" not in L.sampler_gap(logp, gen, mask)[0]


def test_gspo_uses_one_geometric_mean_ratio_per_sequence():
    """GSPO (Zheng et al. 2025): s_i = exp(mean_t (logp - old)); loss_i = -min(s_i A_i, clip(s_i) A_i),
    each sequence's mean over its tokens, then the mean over sequences."""
    lengths = [3, 5, 1]
    mask = make_mask(lengths, 5)
    logp = (torch.randn(3, 5) * 0.2).requires_grad_()
    old, gen = torch.randn(3, 5) * 0.2, torch.randn(3, 5) * 0.2
    A = torch.tensor([1.0, -2.0, 0.5])[:, None].expand(3, 5)
    for ref_lp in (None, gen):
        loss, _, _ = L.policy_loss(logp, old, A, mask, 0.2, 0.3, agg="seq_mean_token_mean", loss_type="gspo", gen_logp=ref_lp)
        base = old if ref_lp is None else gen
        naive = 0.0
        for i, n in enumerate(lengths):
            s = torch.exp(sum(logp[i, t] - base[i, t] for t in range(n)) / n)
            a = float(A[i, 0])
            naive = naive + -torch.minimum(s * a, s.clamp(0.8, 1.3) * a) / len(lengths)
        assert loss.item() == pytest.approx(naive.item(), abs=1e-6)
        g1, = torch.autograd.grad(loss, logp)
        g2, = torch.autograd.grad(naive, logp)
        assert torch.allclose(g1, g2, atol=1e-6)


def test_aggregate_with_the_step_counts_gives_shares_that_add_up():
    """Two micro-batches of different widths: with the step's counts their shares add up to the
    whole batch's loss in every mode (Dr. GRPO's constant divisor included)."""
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0], [7.0, 5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    for mode in L.AGG_MODES:
        whole = L.aggregate(loss, mask, mode, norm_len=8)
        counts = dict(step_tokens=float(mask.sum()), step_seqs=3.0, norm_len=8)
        parts = L.aggregate(loss[:1], mask[:1], mode, **counts) + L.aggregate(loss[1:, :2], mask[1:, :2], mode, **counts)
        assert parts.item() == pytest.approx(whole.item()), mode
    assert L.aggregate(loss, mask, "seq_mean_token_sum_norm", norm_len=8).item() == pytest.approx((10 + 10 + 12) / 8 / 3)


# ---- extreme log-ratios, and the peers' GSPO and sequence-mask formulas ----------------------------

FMAX = torch.finfo(torch.float32).max
EXTREMES = [1e4, -1e4, 88.0, -88.0, 89.0, -89.0, 1e30, -1e30, FMAX, -FMAX]


def _extreme_pairs():
    """(logp, other) [B, T] whose differences are the extremes: all in one sequence, both ways, one
    per sequence, and finite log-probs whose difference overflows fp32."""
    d = torch.tensor(EXTREMES)
    z = torch.zeros_like(d)
    yield d[None], z[None]
    yield z[None], d[None]
    yield d[:, None], z[:, None]
    yield torch.tensor([[FMAX, -FMAX, 0.5]]), torch.tensor([[-FMAX, FMAX, 0.0]])


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
@pytest.mark.parametrize("correction", [None, "tis", "icepop", "seq-mask-tis"])
def test_no_nan_value_or_gradient_at_extreme_log_ratios(loss_type, correction):
    """Every ratio here (PPO's, GSPO's, the IS weights of each correction) stays finite, and so do the
    loss, its gradient and the logged statistics, for any finite log-probs."""
    agg = "seq_mean_token_mean" if loss_type == "gspo" else "token_mean"
    for base, other in _extreme_pairs():
        mask = torch.ones_like(base)
        A = torch.tensor([1.0, -1.0]).repeat(base.numel())[:base.numel()].view_as(base)
        for fresh in (False, True):  # the old log-probs: the extreme ones, or this forward's own
            logp = base.clone().requires_grad_()
            old = logp.detach() if fresh else other
            stats, w = L.sampler_gap(logp, other, mask, None if correction is None else (correction, 0.5, 5.0))
            assert not any(math.isnan(v) for v in stats.values()), stats
            assert w is None or torch.isfinite(w).all(), w
            loss, clip_frac, kl = L.policy_loss(logp, old, A, mask, 0.2, 0.28, dual_clip=3.0, agg=agg, is_weights=w,
                                                loss_type=loss_type, gen_logp=None if correction is None else other)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(clip_frac) and torch.isfinite(kl), (loss, clip_frac, kl)
            assert torch.isfinite(logp.grad).all(), logp.grad


def test_gspo_counts_a_token_past_20_in_full_as_openrlhf_and_trl():
    """OpenRLHF and TRL take exp of the sequence's mean log-ratio as it is; a token at 30 in a sequence
    of 8 (mean 3.9) counts in full here too. Clamping each token to 20 first, as this used to, cut it
    to 20 and its gradient to 0. Only the mean is clamped, to 20, where theirs overflows."""
    lr = torch.tensor([[30.0, 0.1, -0.2, 0.3, 0.0, 0.1, 0.2, 0.5]])
    mask, A = torch.ones(1, 8), torch.full((1, 8), -1.0)  # A < 0: the unclipped branch, so the ratio's gradient shows
    logp, peer_lp = lr.clone().requires_grad_(), lr.clone().requires_grad_()
    loss, _, _ = L.policy_loss(logp, torch.zeros(1, 8), A, mask, 0.2, 0.2, agg="seq_mean_token_mean", loss_type="gspo")
    s = torch.exp(peer_lp.sum() / 8)
    peer = -torch.minimum(-s, -s.clamp(0.8, 1.2))
    g, = torch.autograd.grad(loss, logp)
    g_peer, = torch.autograd.grad(peer, peer_lp)
    assert loss.item() == pytest.approx(peer.item(), rel=1e-6)
    assert torch.allclose(g, g_peer, rtol=1e-5) and g[0, 0] > 0
    far = torch.full((1, 8), 25.0, requires_grad=True)  # a mean past 20: e^20, no gradient, nothing infinite
    loss, _, _ = L.policy_loss(far, torch.zeros(1, 8), A, mask, 0.2, 0.2, agg="seq_mean_token_mean", loss_type="gspo")
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-5) and (far.grad == 0).all()


def test_gspo_with_is_correction_is_openrlhfs_and_meets_trls_when_the_sampler_agrees():
    """gspo with --enable_vllm_is_correction, as OpenRLHF: the sequence ratio against the engines'
    log-probs, no IS weight on the loss. TRL (importance_sampling_level="sequence" with its vLLM
    correction) keeps the ratio against the old log-probs and multiplies the loss by the IS weight of
    old vs sampler (default sequence_mask: exp of the summed log-ratio, zeroed above 3). Both are
    written out here: they agree when the engines' log-probs are the trainer's, and differ otherwise."""
    torch.manual_seed(5)
    lengths = [3, 5, 4]
    mask = make_mask(lengths, 5)
    logp = (torch.randn(3, 5) * 0.1 - 1).requires_grad_()
    old = logp.detach()  # one optimizer step per rollout (TRL: per_token_logps.detach())
    A = torch.tensor([1.0, -2.0, 0.5])[:, None].expand(3, 5)

    def gspo(base, i, n):
        s = torch.exp(sum(logp[i, t] - base[i, t] for t in range(n)) / n)
        return -torch.minimum(s * A[i, 0], s.clamp(0.8, 1.2) * A[i, 0])

    def openrlhf(gen):
        return sum(gspo(gen, i, n) for i, n in enumerate(lengths)) / len(lengths)

    def trl(gen):
        out = 0.0
        for i, n in enumerate(lengths):
            w = math.exp(sum(float(old[i, t] - gen[i, t]) for t in range(n)))
            out = out + gspo(old, i, n) * (w if w <= 3.0 else 0.0)
        return out / len(lengths)

    for gen, agree in ((old.clone(), True), (old - 0.3 * torch.rand(3, 5), False)):
        _, w = L.sampler_gap(old, gen, mask, ("tis", 0.5, 5.0))
        ours, _, _ = L.policy_loss(logp, old, A, mask, 0.2, 0.2, agg="seq_mean_token_mean", is_weights=w,
                                   loss_type="gspo", gen_logp=gen)
        for peer, same in ((openrlhf(gen), True), (trl(gen), agree)):
            g, = torch.autograd.grad(ours, logp, retain_graph=True)
            g_peer, = torch.autograd.grad(peer, logp, retain_graph=True)
            if same:
                assert ours.item() == pytest.approx(peer.item(), abs=1e-6) and torch.allclose(g, g_peer, atol=1e-6)
            else:
                assert abs(ours.item() - peer.item()) > 1e-2


def test_seq_mask_tis_filters_by_the_geometric_mean_as_openrlhf_not_by_trls_product():
    """seq-mask-tis (OpenRLHF): a sequence is kept when exp(mean of its log-ratios) is inside
    [low, high], and each kept token weighs its own (untruncated) ratio. TRL's sequence_mask takes
    exp(sum), the product of the token ratios, as the filter and as every token's weight. A response
    of 10 tokens with a gap of 0.1 on each: e^0.1 is kept here, e^1 = 2.7 > 2 is masked by TRL."""
    gen = -torch.rand(2, 10)
    logp = gen + torch.tensor([[0.1], [-0.1]])
    logp[1, 0] += 2.0  # row 1: one token at 1.9, nine at -0.1: the same mean, 0.1
    stats, w = L.sampler_gap(logp, gen, torch.ones(2, 10), ("seq-mask-tis", 0.5, 2.0))
    for i in range(2):
        gaps = [float(logp[i, t] - gen[i, t]) for t in range(10)]
        assert 0.5 <= math.exp(sum(gaps) / 10) <= 2.0  # kept here ...
        assert w[i].tolist() == pytest.approx([math.exp(g) for g in gaps], rel=1e-5)  # 6.7 for row 1's first token
        assert not 0.5 <= math.exp(sum(gaps)) <= 2.0  # ... masked by TRL's product
    assert stats["is_masked_seq_frac"] == 0.0 and stats["is_masked_token_frac"] == 0.0
