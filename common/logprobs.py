"""Token log-probs and entropy from full-vocabulary logits, in one pass (fused on GPU).

Shapes: B sequences, T tokens, V vocabulary. Math in fp32 (fp64 inputs stay fp64) whatever the
logits' dtype; the gradient comes back in the logits' dtype.
"""
from __future__ import annotations

import torch

# A [B, T, V] fp32 copy of the logits is ~10 GB for B*T = 16k tokens and a 150k vocabulary, so
# neither the forward nor the backward ever holds one: the Function below keeps only the (bf16)
# logits and a [B, T] log-normaliser (and entropy) and recomputes the softmax in backward. On CPU the
# math runs in blocks of about `chunk_tokens` positions, each block a view of the logits (no copy,
# also for the caller's shifted `logits[:, :-1]`). On GPU the same math is compiled by torch.compile
# into a few fused kernels over the whole tensor: the forward reads the logits twice (max, then
# the exp-sums with the label's logit and the entropy), the backward reads them once and writes the
# gradient, with no fp32 intermediate in memory (the eager blocks took 10x longer there:
# docs/performance.md).

def _blocks(B: int, T: int, chunk_tokens: int):
    """(batch slice, time slice) blocks of about `chunk_tokens` positions covering [B, T]."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if chunk_tokens < T:
        for b in range(B):
            for t in range(0, T, chunk_tokens):
                yield slice(b, b + 1), slice(t, min(t + chunk_tokens, T))
    else:
        step = chunk_tokens // T
        for b in range(0, B, step):
            yield slice(b, min(b + step, B)), slice(0, T)


def _stats(logits, labels, temperature: float, entropy: bool):
    """logits [b, t, V], labels [b, t] -> (log-normaliser, log p(label), entropy or None), [b, t] each."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        z = z / temperature
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - m)
    s = e.sum(-1)
    lse = m.squeeze(-1) + torch.log(s)
    lp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    ent = lse - (e * z).sum(-1) / s if entropy else None  # H = log Z - E_p[z]
    return lse, lp, ent


def _grad(logits, labels, lse, ent, g_lp, g_ent, temperature: float):
    """d(sum g_lp * log p(label) + g_ent * H) / d logits, in the logits' dtype: [b, t, V]."""
    z = logits.to(lse.dtype)
    if temperature != 1.0:
        z = z / temperature
    logp = z - lse.unsqueeze(-1)
    p = torch.exp(logp)
    d = -p * g_lp.unsqueeze(-1)  # d log p_y / d z_v = 1[v = y] - p_v
    if g_ent is not None:  # dH / dz_v = -p_v (log p_v + H)
        d = d - p * (logp + ent.unsqueeze(-1)) * g_ent.unsqueeze(-1)
    hit = torch.arange(logits.shape[-1], device=logits.device) == labels.unsqueeze(-1)
    d = torch.where(hit, d + g_lp.unsqueeze(-1), d)
    if temperature != 1.0:
        d = d / temperature
    return d.to(logits.dtype)


_COMPILED: dict = {}


def _fused(name: str, fn, *args):
    """fn(*args) compiled by torch.compile, once per process (the callers pass CUDA tensors); None
    where it cannot run: HYBRIDRL_FUSED_LOGPROBS=0, or compilation failed (inductor compiles at the
    first call, e.g. without triton), which is said once on stderr; the caller then runs eager blocks."""
    import os

    if os.environ.get("HYBRIDRL_FUSED_LOGPROBS", "1") == "0" or _COMPILED.get(name, fn) is None:
        return None
    if name not in _COMPILED:
        from common.models import compile_in_process

        compile_in_process()
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    try:
        return _COMPILED[name](*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        import sys

        print(f"hybridrl: torch.compile failed for the log-prob kernels ({type(e).__name__}: {e}); "
              "using eager blocks", file=sys.stderr)
        _COMPILED[name] = None
        return None


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_tokens, entropy):
        B, T, _ = logits.shape
        fused = _fused("stats", _stats, logits, labels, temperature, entropy) if logits.is_cuda else None
        if fused is not None:
            lse, lp, ent = fused
        else:
            dt = torch.promote_types(logits.dtype, torch.float32)
            lse = torch.empty(B, T, dtype=dt, device=logits.device)
            lp = torch.empty_like(lse)
            ent = torch.empty_like(lse) if entropy else None
            for b, t in _blocks(B, T, chunk_tokens):
                lse[b, t], lp[b, t], e = _stats(logits[b, t], labels[b, t], temperature, entropy)
                if entropy:
                    ent[b, t] = e
        ctx.save_for_backward(logits, labels, lse, *([ent] if entropy else []))
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.mark_non_differentiable(lse)
        return lse, lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _g_lse, g_lp, g_ent):
        logits, labels, lse, *ent = ctx.saved_tensors
        ent = ent[0] if ent else None
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        g_ent = None if g_ent is None or ent is None else g_ent.to(lse.dtype)
        fused = _fused("grad", _grad, logits, labels, lse, ent, g_lp, g_ent, ctx.temperature) if logits.is_cuda else None
        if fused is not None:
            return fused, None, None, None, None
        grad = torch.empty_like(logits)
        for b, t in _blocks(*lse.shape, ctx.chunk_tokens):
            grad[b, t] = _grad(logits[b, t], labels[b, t], lse[b, t], None if ent is None else ent[b, t], g_lp[b, t],
                               None if g_ent is None else g_ent[b, t], ctx.temperature)
        return grad, None, None, None, None


def token_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, entropy: bool = False,
                chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(logits / temperature)[labels], its entropy or None), in one pass over the logits.

    logits: [B, T, V] (any float dtype), labels: [B, T] valid token ids (padding positions need a
    valid id too, e.g. the pad id; mask them afterwards). Returns [B, T] fp32 (fp64 for fp64
    logits), both differentiable in `logits`.
    """
    _, lp, ent = _TokenStats.apply(logits, labels.long(), float(temperature), int(chunk_tokens), bool(entropy))
    return lp, ent


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_tokens: int = 4096
) -> torch.Tensor:
    """log softmax(logits / temperature)[labels]: [B, T] (see `token_stats`). The caller shifts:
    `token_logprobs(logits[:, :-1], ids[:, 1:])`."""
    return token_stats(logits, labels, temperature, False, chunk_tokens)[0]


def token_entropy(logits: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
    """Entropy of softmax(logits) per position. logits: [B, T, V] -> [B, T] fp32, differentiable."""
    labels = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    return token_stats(logits, labels, 1.0, True, chunk_tokens)[1]
