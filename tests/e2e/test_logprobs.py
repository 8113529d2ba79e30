"""common.algo.logprobs: token log-probs and entropy against log_softmax and autograd, in every chunking,
and the compiled (GPU) kernels against the eager math."""

import torch

from common.algo import logprobs as L

torch.manual_seed(0)


def test_compiled_kernels_equal_eager_math():
    """The functions torch.compile fuses on GPU, compiled here by inductor's CPU backend: same numbers
    as eager, within 1e-5 in fp32 (forward and backward, with entropy and temperature)."""
    x, y = torch.randn(2, 5, 50) * 3, torch.randint(0, 50, (2, 5))
    stats, grad = torch.compile(L._stats, dynamic=True), torch.compile(L._grad, dynamic=True)
    got, ref = stats(x, y, 0.9, True), L._stats(x, y, 0.9, True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    lse, _, ent = ref
    g_lp, g_ent = torch.randn(2, 5), torch.randn(2, 5)
    torch.testing.assert_close(grad(x, y, lse, ent, g_lp, g_ent, 0.9), L._grad(x, y, lse, ent, g_lp, g_ent, 0.9),
                               atol=1e-5, rtol=0)
