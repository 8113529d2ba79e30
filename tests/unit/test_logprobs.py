"""common.algo.logprobs: token log-probs and entropy against log_softmax and autograd, in every chunking,
and the compiled (GPU) kernels against the eager math."""
import math

import pytest
import torch

from common.algo import logprobs as L

torch.manual_seed(0)


@pytest.mark.parametrize("chunk", [1, 4, 7, 30, 4096])  # 7 does not divide B*T = 30
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_chunked_equals_log_softmax(chunk, temperature):
    B, T_, V = 3, 10, 50
    logits = torch.randn(B, T_, V) * 3
    labels = torch.randint(0, V, (B, T_))
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)
    got = L.token_logprobs(logits, labels, temperature=temperature, chunk_tokens=chunk)
    assert got.dtype == torch.float32 and got.shape == (B, T_)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_token_logprobs_gradient_matches_autograd_on_shifted_view(chunk):
    B, T_, V = 3, 11, 40
    ids = torch.randint(0, V, (B, T_))
    logits = (torch.randn(B, T_, V) * 2).requires_grad_()
    w = torch.randn(B, T_ - 1)
    # the caller's shift makes a non-contiguous view: the chunked path must handle it
    got = L.token_logprobs(logits[:, :-1], ids[:, 1:], temperature=0.8, chunk_tokens=chunk)
    (got * w).sum().backward()
    g_got = logits.grad.clone()
    logits.grad = None
    ref = torch.log_softmax(logits[:, :-1] / 0.8, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (ref * w).sum().backward()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(g_got, logits.grad, atol=1e-5, rtol=0)


def test_token_logprobs_bf16_input_is_fp32_math():
    logits = torch.randn(2, 6, 30).bfloat16().requires_grad_()
    labels = torch.randint(0, 30, (2, 6))
    got = L.token_logprobs(logits, labels, chunk_tokens=5)
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_no_full_fp32_logits_saved_for_backward():
    B, T_, V = 4, 8, 64
    logits = torch.randn(B, T_ + 1, V).bfloat16().requires_grad_()
    ids = torch.randint(0, V, (B, T_ + 1))
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = L.token_logprobs(logits[:, :-1], ids[:, 1:], chunk_tokens=5)
        ent = L.token_entropy(logits[:, :-1], chunk_tokens=5)
    assert saved and not any(d == torch.float32 and n >= 5 * V for d, n in saved), saved
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.shape == logits.shape and logits.grad[:, -1].abs().max() == 0


def test_token_logprobs_gradcheck_fp64():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(lambda x: L.token_logprobs(x, labels, 1.3, chunk_tokens=4), (logits,))
    assert torch.autograd.gradcheck(lambda x: L.token_entropy(x, chunk_tokens=4), (logits,))


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_token_entropy_chunked_equals_reference(chunk):
    B, T_, V = 3, 10, 50
    logits = (torch.randn(B, T_, V) * 3).requires_grad_()
    w = torch.randn(B, T_)
    got = L.token_entropy(logits, chunk_tokens=chunk)
    (got * w).sum().backward()
    g_got = logits.grad.clone()
    logits.grad = None
    logp = torch.log_softmax(logits, -1)
    ref = -(logp.exp() * logp).sum(-1)
    (ref * w).sum().backward()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(g_got, logits.grad, atol=1e-5, rtol=0)
    # uniform logits: entropy is ln V
    assert L.token_entropy(torch.zeros(1, 2, V), chunk).allclose(torch.full((1, 2), math.log(V)))


@pytest.mark.parametrize("chunk", [3, 7, 4096])
def test_token_stats_joint_pass_matches_autograd(chunk):
    """Log-probs and entropy in one pass, the gradient of a loss using both, at a temperature."""
    B, T_, V = 3, 9, 40
    logits = (torch.randn(B, T_, V) * 2).requires_grad_()
    labels = torch.randint(0, V, (B, T_))
    w1, w2 = torch.randn(B, T_), torch.randn(B, T_)
    lp, ent = L.token_stats(logits, labels, temperature=0.9, entropy=True, chunk_tokens=chunk)
    (lp * w1 + ent * w2).sum().backward()
    g_got = logits.grad.clone()
    logits.grad = None
    logp = torch.log_softmax(logits / 0.9, -1)
    ref_lp, ref_ent = logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    (ref_lp * w1 + ref_ent * w2).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(g_got, logits.grad, atol=1e-5, rtol=0)
    assert L.token_stats(logits, labels)[1] is None


def test_bad_chunk_size_raises():
    with pytest.raises(ValueError, match="chunk_tokens"):
        L.token_logprobs(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), chunk_tokens=0)


def test_a_kernel_that_fails_to_compile_falls_back_to_eager(capsys):
    """Inductor compiles at the first call (e.g. it needs triton on GPU): a failure there is said once
    and the eager blocks take over, instead of the training step failing."""
    def broken(x):
        raise RuntimeError("no triton here")

    L._COMPILED.pop("test-broken", None)
    try:
        assert L._fused("test-broken", broken, torch.ones(2)) is None
        assert "torch.compile failed for the log-prob kernels" in capsys.readouterr().err
        assert L._fused("test-broken", broken, torch.ones(2)) is None and capsys.readouterr().err == ""
    finally:
        L._COMPILED.pop("test-broken", None)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_head_stats_from_the_hidden_state_equal_log_softmax_of_the_full_logits(chunk, temperature):
    """Log-probs and entropy from the last hidden state, the head's logits made `chunk` positions at
    a time (the GPU default: common.rl.workers), against log_softmax of the whole logits written out;
    gradients through a tied head (the embedding is the head's weight, as in Qwen2.5-0.5B), fp64."""
    g = torch.Generator().manual_seed(1)
    B, T, H, V = 3, 11, 8, 40
    emb = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    mix = torch.randn(H, H, generator=g, dtype=torch.float64)

    def run(fused: bool):
        hidden = torch.tanh(emb[ids] @ mix)  # [B, T, H]: depends on the head's weight too
        labels = torch.roll(ids, -1, dims=1)
        if fused:
            lp, ent = L.head_token_stats(hidden, emb, labels, temperature, True, chunk)
        else:
            logp = torch.log_softmax(hidden @ emb.T / temperature, -1)
            lp = logp.gather(-1, labels[..., None])[..., 0]
            ent = -(logp.exp() * logp).sum(-1)
        w = torch.linspace(-1, 1, B * T, dtype=torch.float64).view(B, T)
        (grad,) = torch.autograd.grad((lp * w).sum() + (ent * w.flip(1)).sum(), [emb])
        return lp, ent, grad

    for got, want in zip(run(True), run(False)):
        assert got.dtype == torch.float64
        assert torch.allclose(got, want, atol=1e-10, rtol=1e-9), (got - want).abs().max()


def test_head_stats_in_bf16_keep_no_full_logits_and_give_fp32():
    """bf16 hidden states and head: fp32 results, close to the full logits' path; the head's
    gradient in its own dtype; only [chunk, V] logits live at a time (the saved tensors: the hidden
    state, the weight, labels and [N] statistics)."""
    g = torch.Generator().manual_seed(2)
    N, H, V = 64, 16, 300
    hidden = torch.randn(N, H, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=g) / 4).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    def saved_sizes(fn):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            out = fn()
        return out, sizes

    (lp, _), sizes = saved_sizes(lambda: L.head_token_stats(hidden, w, labels, chunk_tokens=16))
    ref, full = saved_sizes(lambda: L.token_logprobs((hidden @ w.T)[None], labels[None])[0])
    assert lp.dtype == torch.float32 and torch.allclose(lp, ref, atol=1e-5)
    assert sizes and max(sizes) < N * V <= max(full)  # the whole-logits path keeps [N, V]; this one does not
    lp.sum().backward()
    assert w.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16 and w.grad.abs().sum() > 0


def test_the_chunked_head_is_used_only_where_the_logits_are_the_heads_output():
    """A model type that soft-caps or scales its logits after the head (Gemma 2), a biased head and
    ZeRO-3 keep the whole logits; the built-in Qwen2 takes the chunked path."""
    from transformers import AutoModelForCausalLM, Gemma2Config, Qwen2Config

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 vocab_size=64, head_dim=8)
    qwen = AutoModelForCausalLM.from_config(Qwen2Config(**small))
    head, chunk, dtype = L.chunked_head(qwen, 4096, 2, True)
    assert head is qwen.lm_head and chunk == 4096 and dtype == torch.bfloat16
    assert L.chunked_head(qwen, 4096, 3, False) is None and L.chunked_head(qwen, 0, 2, False) is None
    gemma = AutoModelForCausalLM.from_config(Gemma2Config(**small, final_logit_softcapping=30.0))
    assert L.chunked_head(gemma, 4096, 2, False) is None
    qwen.lm_head = torch.nn.Linear(16, 64, bias=True)
    assert L.chunked_head(qwen, 4096, 2, False) is None
