"""common.advantages against naive per-element Python references."""
import math
import statistics

import pytest
import torch

from common import advantages as A

torch.manual_seed(0)

LENGTHS = [6, 1, 4, 0, 2]  # full row, one valid token, padded rows, all-masked row
T = 6


def make_mask(lengths, T_=T):
    return torch.tensor([[1.0] * n + [0.0] * (T_ - n) for n in lengths])


def rand_bt():
    return torch.randn(len(LENGTHS), T)


def rows(x, lengths=LENGTHS):
    return [[float(x[b, t]) for t in range(n)] for b, n in enumerate(lengths)]


def assert_rows(got, ref_rows, T_=T, atol=1e-5):
    """`got` [B, T] equals the per-row lists on valid tokens and is exactly 0 on padding."""
    for b, row in enumerate(ref_rows):
        assert got[b, :len(row)].tolist() == pytest.approx(row, abs=atol)
        assert (got[b, len(row):] == 0).all()
    assert torch.isfinite(got).all()


# ---- KL and token rewards ------------------------------------------------------------------------

def test_kl_estimators_match_formulas():
    logp, ref = rand_bt(), rand_bt()
    for kind, f in [("k1", lambda d: d), ("k2", lambda d: d * d / 2),
                    ("k3", lambda d: math.exp(-d) - 1 + d)]:
        got = A.kl_estimate(logp, ref, kind)
        for b in range(logp.shape[0]):
            for t in range(T):
                assert got[b, t].item() == pytest.approx(f(float(logp[b, t] - ref[b, t])), abs=1e-5)
    assert (A.kl_estimate(logp, ref, "k3") >= 0).all()
    assert A.kl_estimate(logp, logp, "k3").abs().max() == 0
    with pytest.raises(ValueError, match="k3"):
        A.kl_estimate(logp, ref, "k4")


def test_token_rewards_put_score_on_last_valid_token():
    mask, kl, scores = make_mask(LENGTHS), rand_bt(), torch.randn(len(LENGTHS))
    kl[mask == 0] = float("inf")  # padding garbage must not leak
    got = A.token_rewards(scores, kl, mask, kl_coef=0.05)
    ref = []
    for b, row in enumerate(rows(kl)):
        r = [-0.05 * k for k in row]
        if r:
            r[-1] += float(scores[b])
        ref.append(r)
    assert_rows(got, ref)


def test_last_valid_index():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    assert A.last_valid_index(mask).tolist() == [1, 0, 0, 3, 2]


# ---- GAE and returns -----------------------------------------------------------------------------

def naive_gae(r, v, gamma, lambd):
    """One sequence's valid tokens as lists; the value after the last token is 0."""
    n = len(r)
    adv, last = [0.0] * n, 0.0
    for t in reversed(range(n)):
        next_v = v[t + 1] if t + 1 < n else 0.0
        last = r[t] + gamma * next_v - v[t] + gamma * lambd * last
        adv[t] = last
    return adv, [a + x for a, x in zip(adv, v)]


@pytest.mark.parametrize("gamma,lambd", [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_naive(gamma, lambd):
    mask, r, v = make_mask(LENGTHS), rand_bt(), rand_bt()
    v[mask == 0] = float("nan")
    adv, ret = A.gae(r, v, mask, gamma, lambd)
    ref = [naive_gae(rr, vv, gamma, lambd) for rr, vv in zip(rows(r), rows(v))]
    assert_rows(adv, [a for a, _ in ref])
    assert_rows(ret, [x for _, x in ref])


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value():
    mask, r, v = make_mask(LENGTHS), rand_bt(), rand_bt()
    adv, ret = A.gae(r, v, mask, 1.0, 1.0)
    rtg = [[sum(row[t:]) for t in range(len(row))] for row in rows(r)]
    assert_rows(adv, [[g - x for g, x in zip(g_row, v_row)] for g_row, v_row in zip(rtg, rows(v))])
    assert_rows(ret, rtg)


def test_gae_skips_masked_holes():
    # a hole (e.g. tool output) is skipped: same as the sequence with the hole removed
    r, v = torch.tensor([[1.0, 5.0, 2.0, 3.0]]), torch.tensor([[0.5, 9.0, 0.2, 0.1]])
    adv, _ = A.gae(r, v, torch.tensor([[1, 0, 1, 1]]), 0.9, 0.7)
    ref, _ = naive_gae([1.0, 2.0, 3.0], [0.5, 0.2, 0.1], 0.9, 0.7)
    assert adv[0, [0, 2, 3]].tolist() == pytest.approx(ref) and adv[0, 1] == 0


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns_match_naive(gamma):
    mask, r = make_mask(LENGTHS), rand_bt()
    got = A.discounted_returns(r, mask, gamma)
    ref = [[sum(gamma ** (k - t) * row[k] for k in range(t, len(row))) for t in range(len(row))]
           for row in rows(r)]
    assert_rows(got, ref)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_naive(shift_mean):
    mask, x = make_mask(LENGTHS), rand_bt() * 3 + 2
    x[mask == 0] = float("inf")
    got = A.whiten(x, mask, shift_mean=shift_mean)
    flat = [v for row in rows(x) for v in row]
    mean, std = statistics.fmean(flat), statistics.pstdev(flat)
    ref = [[(v - mean) / std + (0 if shift_mean else mean) for v in row] for row in rows(x)]
    assert_rows(got, ref)
    # one valid token: zero variance gives 0, not NaN
    one = A.whiten(torch.tensor([[4.0, 1.0]]), torch.tensor([[1, 0]]))
    assert one.tolist() == [[0.0, 0.0]]


# ---- group baselines -----------------------------------------------------------------------------

def test_group_kinds_on_hand_example():
    s = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    std = statistics.stdev([1, 0, 0, 1])  # unbiased: sqrt(1/3)
    g = A.group_advantages(s, 4, "group_norm")
    a = 0.5 / (std + 1e-6)
    assert g.tolist() == pytest.approx([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    half = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert A.group_advantages(s, 4, "group_norm", std_norm=False).tolist() == pytest.approx(half)
    assert A.group_advantages(s, 4, "dr_grpo").tolist() == pytest.approx(half)
    assert A.group_advantages(s, 4, "reinforce_baseline").tolist() == pytest.approx(half)
    # rloo: 1 - 1/3, 0 - 2/3, ...
    assert A.group_advantages(s, 4, "rloo").tolist() == pytest.approx(
        [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0])
    assert A.group_all_equal(s, 4).tolist() == [False, True]


@pytest.mark.parametrize("kind", A.GROUP_KINDS)
def test_group_advantages_match_naive(kind):
    n, P = 5, 4
    s = torch.randn(P * n)
    got = A.group_advantages(s, n, kind)
    for p in range(P):
        g = [float(x) for x in s[p * n:(p + 1) * n]]
        mean = sum(g) / n
        for i, x in enumerate(g):
            if kind == "rloo":
                ref = x - (sum(g) - x) / (n - 1)
            elif kind == "group_norm":
                ref = (x - mean) / (statistics.stdev(g) + 1e-6)
            else:
                ref = x - mean
            assert got[p * n + i].item() == pytest.approx(ref, abs=1e-5)


def test_group_advantages_errors():
    s = torch.zeros(6)
    with pytest.raises(ValueError, match="n_samples_per_prompt > 1"):
        A.group_advantages(s, 1, "group_norm")
    with pytest.raises(ValueError, match="divisible"):
        A.group_advantages(s, 4, "rloo")
    with pytest.raises(ValueError, match="unknown"):
        A.group_advantages(s, 2, "ppo")


def test_group_all_equal():
    s = torch.tensor([0.5, 0.5, 0.2, 0.3, 0.0, 0.0])
    assert A.group_all_equal(s, 2).tolist() == [True, False, True]
    assert A.group_all_equal(s, 1).tolist() == [True] * 6
