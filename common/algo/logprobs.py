"""Token log-probs and entropy from full-vocabulary logits, in one pass (fused on GPU).

Shapes: B sequences, T tokens, V vocabulary. Math in fp32 (fp64 inputs stay fp64) whatever the
logits' dtype; the gradient comes back in the logits' dtype.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from common.algo import PLAIN_HEAD  # the plan counts the same choice (Gemma 2 soft-caps after the head)

# A [B, T, V] fp32 copy of the logits is ~10 GB for B*T = 16k tokens and a 150k vocabulary, so
# neither the forward nor the backward ever holds one: the Function below keeps only the (bf16)
# logits and a [B, T] log-normaliser (and entropy) and recomputes the softmax in backward. On CPU the
# math runs in blocks of about `chunk_tokens` positions, each block a view of the logits (no copy,
# also for the caller's shifted `logits[:, :-1]`). On GPU the same math is compiled by torch.compile
# into a few fused kernels over the whole tensor: the forward reads the logits twice (max, then
# the exp-sums with the label's logit and the entropy), the backward reads them once and writes the
# gradient, with no fp32 intermediate in memory (the eager blocks took 10x longer there:
# dev/LOG.md).

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
        from common.training.models import compile_in_process

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


# ---------------------------------------------------------------- from the last hidden state
# The [B, T, V] logits themselves are the largest tensor of a small model's training step (5.6 GB in
# bf16 for 64 rows of ~290 tokens and Qwen2.5's 152k vocabulary, twice with their gradient). Taken
# from the last hidden state instead, the head's matmul runs over chunks of `chunk_tokens` positions
# and backward recomputes each chunk's logits: [chunk, V] at a time, for one more head matmul.
class _HeadStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_tokens, entropy, dtype):
        N = hidden.shape[0]
        w = weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)
        lse, lp = (torch.empty(N, dtype=acc, device=hidden.device) for _ in range(2))
        ent = torch.empty_like(lse) if entropy else None
        for s in range(0, N, chunk_tokens):
            e = min(s + chunk_tokens, N)
            z = hidden[s:e].to(dtype) @ w.T
            out = _fused("stats", _stats, z, labels[s:e], temperature, entropy) if z.is_cuda else None
            lse[s:e], lp[s:e], part = out if out is not None else _stats(z, labels[s:e], temperature, entropy)
            if entropy:
                ent[s:e] = part
            # else the next chunk's logits are made while this one's are still bound: two [chunk, V] at the peak
            del z, out, part
        ctx.save_for_backward(hidden, weight, labels, lse, *([ent] if entropy else []))
        ctx.temperature, ctx.chunk_tokens, ctx.dtype = temperature, chunk_tokens, dtype
        ctx.mark_non_differentiable(lse)
        return lse, lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _g_lse, g_lp, g_ent):
        hidden, weight, labels, lse, *ent = ctx.saved_tensors
        ent = ent[0] if ent else None
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        g_ent = None if g_ent is None or ent is None else g_ent.to(lse.dtype)
        w = weight.to(ctx.dtype)
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # the head's gradient summed in fp32 (fp64 weights: fp64) over the chunks, cast once
        dw = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk_tokens):
            e = min(s + ctx.chunk_tokens, hidden.shape[0])
            h = hidden[s:e].to(ctx.dtype)
            z = h @ w.T
            args = (z, labels[s:e], lse[s:e], None if ent is None else ent[s:e], g_lp[s:e],
                    None if g_ent is None else g_ent[s:e], ctx.temperature)
            d = _fused("grad", _grad, *args) if z.is_cuda else None
            d = _grad(*args) if d is None else d  # [c, V] in the compute dtype
            del z, args  # one [chunk, V] less while d is used, and none carried into the next chunk
            if dh is not None:
                dh[s:e] = d @ w
            if dw is not None:
                dw += (d.T @ h).to(dw.dtype)
            del d
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None, None, None


def head_token_stats(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     entropy: bool = False, chunk_tokens: int = 4096, dtype: torch.dtype | None = None):
    """`token_stats` of the logits hidden @ weight.T without holding them: (log p(label), entropy or None).

    hidden: [..., H] (the model's last hidden state), weight: [V, H] (a bias-free head), labels: [...]
    valid ids. The head's matmul runs in `dtype` (default: the weight's; bf16 under autocast). Returns
    [...] fp32, differentiable in hidden and weight."""
    shape = labels.shape
    _, lp, ent = _HeadStats.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1).long(),
                                  float(temperature), int(chunk_tokens), bool(entropy), dtype or weight.dtype)
    return lp.view(shape), None if ent is None else ent.view(shape)


@contextmanager
def head_stats(head: torch.nn.Module, labels: torch.Tensor, temperature: float, entropy: bool, chunk_tokens: int,
               dtype: torch.dtype | None):
    """Within it, the model's output head (a bias-free nn.Linear) returns [B, T, 2] (log p(label),
    entropy) or [B, T, 1] instead of the [B, T, V] logits: the model's forward runs as it is (its
    framework's hooks included) and only the head's output changes. labels: [B, T]."""
    def forward(hidden):
        lp, ent = head_token_stats(hidden, head.weight, labels, temperature, entropy, chunk_tokens, dtype)
        return torch.stack([lp, ent], -1) if entropy else lp.unsqueeze(-1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def chunked_head(model, chunk_tokens: int, zero_stage: int, autocast_bf16: bool):
    """(head, chunk_tokens, compute dtype) for `head_stats` when a causal LM's log-probs can come from its
    last hidden state, else None: a bias-free linear head whose output is the logits (PLAIN_HEAD), outside
    ZeRO-3 (whose partitioned weight only the head's own hooks gather, for its own forward). Under
    DeepSpeed's torch_autocast, which covers its own forward only, the head's matmul runs in bf16 as it
    would there."""

    head = model.get_output_embeddings()
    plain = getattr(model.config, "model_type", None) in PLAIN_HEAD
    if not chunk_tokens or zero_stage == 3 or not plain or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    return head, chunk_tokens, torch.bfloat16 if autocast_bf16 else None
