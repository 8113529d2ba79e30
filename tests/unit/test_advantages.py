"""common.algo.advantages against naive per-element Python references."""
import math
import statistics

import pytest
import torch

from common.algo import advantages as A

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
                # clamped to [-10, 10], as OpenRLHF: one near-impossible token must not swamp the reward
                assert got[b, t].item() == pytest.approx(min(max(f(float(logp[b, t] - ref[b, t])), -10), 10), abs=1e-5)
    assert (A.kl_estimate(logp, ref, "k3") >= 0).all()
    assert A.kl_estimate(torch.tensor([[0.0]]), torch.tensor([[-30.0]]), "k1").item() == 10.0
    assert A.kl_estimate(logp, logp, "k3").abs().max() == 0
    with pytest.raises(ValueError, match="k3"):
        A.kl_estimate(logp, ref, "k4")


FMAX = torch.finfo(torch.float32).max
EXTREMES = [1e4, -1e4, 88.0, -88.0, 89.0, -89.0, 1e30, -1e30, FMAX, -FMAX]


def _naive_kl(kind, d):
    """Schulman's estimator of one log-ratio in Python floats, clamped to [-10, 10] (OpenRLHF's)."""
    if kind == "k1":
        v = d
    elif kind == "k2":
        v = d * d / 2 if abs(d) < 1e150 else math.inf
    else:
        v = (math.exp(-d) if -d < 700 else math.inf) - 1 + d
    return min(max(v, -10.0), 10.0)


@pytest.mark.parametrize("kind", A.KL_KINDS)
def test_kl_estimates_have_no_nan_value_or_gradient_at_extreme_log_ratios(kind):
    """k3's exp overflowed below a log-ratio of about -89 in fp32 and its gradient was 0 * inf = NaN;
    now every finite pair of log-probs gives OpenRLHF's clamped value and a finite gradient."""
    d, z = torch.tensor(EXTREMES), torch.zeros(len(EXTREMES))
    for lp, ref in [(d, z), (z, d), (torch.tensor([FMAX, -FMAX]), torch.tensor([-FMAX, FMAX]))]:
        lp = lp.clone().requires_grad_()
        got = A.kl_estimate(lp[None], ref[None], kind)[0]
        got.sum().backward()
        ref_vals = [_naive_kl(kind, float(x) - float(y)) for x, y in zip(lp.tolist(), ref.tolist())]
        assert got.tolist() == pytest.approx(ref_vals, rel=1e-6), (kind, lp, ref)
        # every extreme is past the clamp: no gradient at all, rather than NaN
        assert (lp.grad == 0).all(), (kind, lp.grad)
    # inside the clamp the gradient is the formula's: d/dx of exp(-x) - 1 + x is 1 - exp(-x)
    x = torch.tensor([-1.5, 0.3, 4.0], requires_grad=True)
    A.kl_estimate(x, torch.zeros(3), "k3").sum().backward()
    assert x.grad.tolist() == pytest.approx([1 - math.exp(1.5), 1 - math.exp(-0.3), 1 - math.exp(-4.0)], rel=1e-5)


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
    # --no_advantage_std_norm: the mean only
    assert_rows(A.whiten(x, mask, std_norm=False), [[v - mean for v in row] for row in rows(x)])
    # one valid token: zero variance gives 0, not NaN
    one = A.whiten(torch.tensor([[4.0, 1.0]]), torch.tensor([[1, 0]]))
    assert one.tolist() == [[0.0, 0.0]]


# ---- group baselines -----------------------------------------------------------------------------

def test_group_kinds_on_hand_example():
    s = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    std = statistics.stdev([1, 0, 0, 1])  # unbiased: sqrt(1/3)
    g = A.group_advantages(s, 4, "group_norm")
    a = 0.5 / (std + 1e-9)  # OpenRLHF's epsilon
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
                ref = (x - mean) / (statistics.stdev(g) + 1e-9)
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


TIES = [2 / 3, 0.1, 0.7, 1 / 3, 0.2, -0.1, 1.0]  # most of them no float holds exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", A.GROUP_KINDS)
def test_tied_groups_get_exactly_zero_and_the_others_match_a_loop(kind, dtype):
    """The mean of n copies of 2/3 in fp32 is off by a rounding error, which group_norm divided by a
    std of that size + 1e-9: 0.92 for a lone group, 60 in a batch (OpenRLHF's formula). A tied group
    now gets exactly 0 with every estimator and dtype; the other groups still follow the formula."""
    for n in (3, 7, 8):
        free = torch.randn(2 * n, dtype=torch.float64).to(dtype)
        s = torch.cat([free[:n], torch.tensor([v for v in TIES for _ in range(n)], dtype=dtype), free[n:]])
        for std_norm in (True, False):
            got = A.group_advantages(s, n, kind, std_norm=std_norm)
            for p in range(len(s) // n):
                g = [float(x) for x in s[p * n:(p + 1) * n]]
                mean = sum(g) / n
                for i, x in enumerate(g):
                    if len(set(g)) == 1:
                        assert got[p * n + i].item() == 0.0, (kind, dtype, n, g)
                        continue
                    if kind == "rloo":
                        ref = x - (sum(g) - x) / (n - 1)
                    elif kind == "group_norm" and std_norm:
                        ref = (x - mean) / (statistics.stdev(g) + 1e-9)
                    else:
                        ref = x - mean
                    assert got[p * n + i].item() == pytest.approx(ref, abs=1e-5)
        for v in TIES:  # a lone group
            assert (A.group_advantages(torch.full((n,), v, dtype=dtype), n, kind) == 0).all(), (kind, dtype, n, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_batch_whose_values_all_tie_whitens_to_exactly_zero(dtype):
    """Whitening divides by the batch std (variance floored at 1e-8), so the mean's rounding error on a
    tied batch became up to 6e-4; now 0, and so are reinforce's advantages when every score ties."""
    mask = make_mask(LENGTHS)
    for v in TIES:
        x = torch.full((len(LENGTHS), T), v, dtype=dtype)
        x[mask == 0] = 5.0  # padding does not count
        for std_norm in (True, False):
            assert (A.whiten(x, mask, std_norm=std_norm) == 0).all(), (dtype, v, std_norm)
        scores = torch.full((len(LENGTHS),), v, dtype=dtype)
        for est, n in (("reinforce", 1), ("reinforce_baseline", len(LENGTHS)), ("group_norm", len(LENGTHS))):
            adv, _ = A.rl_advantages(scores, torch.zeros(len(LENGTHS), T), mask, estimator=est, n=n, kl_coef=0.0)
            assert (adv == 0).all(), (dtype, v, est)


# ---- every estimator end to end: scores and KL in, token advantages out (rl_advantages) ----------

def _naive_estimator(scores, kl, lengths, *, estimator, n, beta, clip=(-10.0, 10.0), std_norm=True,
                     values=None, gamma=1.0, lambd=1.0):
    """The papers' formulas as loops: a sequence-level advantage A_i (GRPO: (r - mean) / (std + eps);
    Dr. GRPO and REINFORCE++-baseline: r - mean; RLOO: r - mean of the others; reinforce/gae: r),
    clipped, then token t's advantage A_i - beta * sum_{k >= t} KL_k (REINFORCE++: the KL is a
    per-token reward and the return accumulates it to the end), or GAE on the per-token rewards;
    gae, reinforce and reinforce_baseline are then whitened over all valid tokens. std_norm False:
    GRPO's A_i is r - mean, and the whitening only subtracts the mean. A tied group's A_i is 0."""
    B = len(lengths)
    seq = []
    for i in range(B):
        g = [float(x) for x in scores[(i // n) * n:(i // n + 1) * n]]
        r, mean = float(scores[i]), statistics.fmean(g)
        if estimator in A.GROUP_KINDS and len(set(g)) == 1:
            a = 0.0
        elif estimator == "group_norm":
            a = (r - mean) / (statistics.stdev(g) + 1e-9) if std_norm else r - mean
        elif estimator in ("dr_grpo", "reinforce_baseline"):
            a = r - mean
        elif estimator == "rloo":
            a = r - (sum(g) - r) / (n - 1)
        else:
            a = r
        seq.append(min(max(a, clip[0]), clip[1]))
    out = []
    for i, L in enumerate(lengths):
        rew = [-beta * float(kl[i, t]) for t in range(L)]
        if L:
            rew[-1] += seq[i]
        if estimator == "gae":
            v = [float(values[i, t]) for t in range(L)] + [0.0]
            adv, run = [0.0] * L, 0.0
            for t in reversed(range(L)):
                run = rew[t] + gamma * v[t + 1] - v[t] + gamma * lambd * run
                adv[t] = run
        else:
            adv = [sum(gamma ** (k - t) * rew[k] for k in range(t, L)) for t in range(L)]
        out.append(adv)
    if estimator in ("gae", "reinforce", "reinforce_baseline"):
        flat = [x for row in out for x in row]
        mean, std = statistics.fmean(flat), statistics.pstdev(flat)
        out = [[(x - mean) / (std if std_norm else 1.0) if std_norm else x - mean for x in row] for row in out]
    return out


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo", "reinforce_baseline", "reinforce", "gae"])
def test_every_estimator_puts_the_kl_in_the_token_rewards_and_accumulates_it(estimator):
    n, lengths = 4, [6, 1, 4, 3, 5, 2, 6, 0]
    mask = make_mask(lengths)
    scores, kl, values = torch.rand(len(lengths)) * 2, rand8() * 0.3, rand8()
    kl[mask == 0] = float("nan")  # padding garbage must not leak
    got, returns = A.rl_advantages(scores, kl, mask, estimator=estimator, n=n, kl_coef=0.1, values=values, lambd=0.9)
    ref = _naive_estimator(scores, kl, lengths, estimator=estimator, n=n, beta=0.1, values=values, lambd=0.9)
    assert_rows(got, ref, atol=1e-4)
    if estimator == "group_norm":  # the sequence advantage minus the KL still to come, token by token
        i = 0
        a_seq = ref[i][0] + 0.1 * sum(float(kl[i, k]) for k in range(lengths[i]))
        assert ref[i][-1] == pytest.approx(a_seq - 0.1 * float(kl[i, lengths[i] - 1]), abs=1e-6)


def rand8():
    return torch.randn(8, T)


def test_reward_clip_and_std_norm_and_gamma():
    n, lengths = 2, [3, 2, 4, 1]
    mask, kl = make_mask(lengths), torch.zeros(4, T)
    scores = torch.tensor([30.0, -30.0, 1.0, 0.0])
    got, _ = A.rl_advantages(scores, kl, mask, estimator="reinforce", n=n, kl_coef=0.0, reward_clip=(-5.0, 5.0),
                             std_norm=False)
    assert_rows(got, _naive_estimator(scores, kl, lengths, estimator="reinforce", n=n, beta=0.0, clip=(-5, 5),
                                      std_norm=False))
    with pytest.raises(ValueError, match="gamma 1"):
        A.rl_advantages(scores, kl, mask, estimator="group_norm", n=n, kl_coef=0.0, gamma=0.9)


@pytest.mark.parametrize("estimator", ["group_norm", "reinforce_baseline", "reinforce", "gae"])
def test_no_advantage_std_norm_matches_a_loop(estimator):
    """--no_advantage_std_norm: group_norm's advantage is r - group mean (it used to be divided by the
    group std all the same); gae, reinforce and reinforce_baseline are only mean-centred over the batch."""
    n, lengths = 4, [6, 1, 4, 3, 5, 2, 6, 0]
    mask = make_mask(lengths)
    scores, kl, values = torch.rand(len(lengths)) * 2, rand8() * 0.3, rand8()
    scores[4:] = 2 / 3  # one tied group
    got, _ = A.rl_advantages(scores, kl, mask, estimator=estimator, n=n, kl_coef=0.1, values=values, lambd=0.9,
                             std_norm=False)
    assert_rows(got, _naive_estimator(scores, kl, lengths, estimator=estimator, n=n, beta=0.1, values=values,
                                      lambd=0.9, std_norm=False), atol=1e-4)
    if estimator == "group_norm":
        with_std, _ = A.rl_advantages(scores, kl, mask, estimator=estimator, n=n, kl_coef=0.1)
        assert not torch.allclose(got, with_std)


@pytest.mark.parametrize("estimator", ["dr_grpo", "rloo"])
def test_no_std_norm_is_refused_by_the_estimators_without_a_std(estimator):
    mask = make_mask([2, 3, 1, 2])
    with pytest.raises(ValueError, match="never divides by a std"):
        A.rl_advantages(torch.rand(4), torch.zeros(4, T), mask, estimator=estimator, n=2, kl_coef=0.0, std_norm=False)


@pytest.mark.parametrize("name", ["train_grpo", "train_ppo"])
@pytest.mark.parametrize("estimator", ["dr_grpo", "rloo"])
def test_both_rl_scripts_refuse_no_advantage_std_norm_where_it_changes_nothing(name, estimator, monkeypatch, tmp_path):
    """Exit 2 with the reason and the change to make, before anything loads; group_norm takes the flag."""
    import importlib

    from typer.testing import CliRunner

    module = importlib.import_module(name)
    trained = []
    monkeypatch.setattr(module, "train", lambda a, *rest: trained.append(a))
    run = lambda *flags: CliRunner().invoke(module.app, [*flags, "--save_path", str(tmp_path / "o")])  # noqa: E731
    r = run("--advantage_estimator", estimator, "--no_advantage_std_norm")
    assert r.exit_code == 2 and not trained, r.output
    assert f"--no_advantage_std_norm with --advantage_estimator {estimator}" in r.output
    assert "never divided by a std" in r.output and "drop it" in r.output
    r = run("--advantage_estimator", "group_norm", "--no_advantage_std_norm")
    assert r.exit_code == 0 and trained[-1]["no_advantage_std_norm"], r.output


def test_length_penalties_match_dapo_and_prorl():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.5])
    lens, cut = torch.tensor([10, 14, 20, 16]), torch.tensor([False, False, True, True])
    got, stats = A.length_penalties(scores, lens, cut, max_new_tokens=16, overlong_buffer_len=4, overlong_penalty_factor=2.0)
    # expected length 12: 10 -> no penalty; 14 -> 2/4 * 2; 20 -> capped at 4/4 * 2; 16 -> 4/4 * 2
    assert got.tolist() == pytest.approx([1.0, 0.0, -1.0, -1.5]) and stats["overlong_frac"] == 0.75
    assert A.length_penalties(scores, lens, cut, max_new_tokens=16, stop_properly_penalty_coef=0.5)[0].tolist() == \
        pytest.approx([1.0, 1.0, 0.5, 0.25])
    assert A.length_penalties(scores, lens, cut, max_new_tokens=16, stop_properly_penalty_coef=-0.5)[0].tolist() == \
        pytest.approx([1.0, 1.0, -0.5, -0.5])


def test_adaptive_kl_controller():
    c = A.KLController(0.1, target=0.05, horizon=1000)
    c.update(0.1, 100)  # twice the target: +0.2 (clipped) * 100 / 1000
    assert c.value == pytest.approx(0.1 * 1.02)
    fixed = A.KLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
