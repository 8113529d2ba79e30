"""The policy's own sampling without vLLM: a preallocated KV cache and one decode step per token
that the host launches without waiting for the GPU.

transformers' `generate` with a static cache compiles the forward pass, but its loop still runs
logits processors, stopping criteria and a host sync (`unfinished.max()`) at every token. Here the
rows' prompts are left-padded into one batch, the cache is filled by one prefill, and on GPU each
decode step (the compiled forward, the sample, the finished rows' bookkeeping) is one CUDA graph
replay; the host looks at the GPU's progress only every 16 tokens, to stop once every row has
ended. On an H200, 64 rows x 256 tokens of the 0.5B shape: 0.53-0.63 s against 1.16-1.34 s for
transformers' compiled static cache, and about vLLM's time on that host (docs/performance.md).
"""
from __future__ import annotations

import functools

import torch

from common.rollout.samples import Samples

# tokens between the host's checks on GPU whether every row has ended (each check waits for the GPU;
# on CPU there is nothing to wait for, so it checks every token)
CHECK_EVERY = 16
# prompts are left-padded to a multiple of this on GPU, so that rollouts whose longest prompt
# differs a little reuse the same cache and compiled graphs
PAD_MULTIPLE = 64

_DECODERS: dict = {}


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [b, V] -> sampled ids [b]: softmax(logits / temperature) restricted to the smallest set of
    tokens whose probability reaches top_p. Drawn as argmax(p / E) with E ~ Exp(1) per token, which
    picks token i with probability p_i and needs no host sync (unlike a search over the CDF)."""
    logits = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # a token stays when the mass strictly before it is below top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


class _Decoder:
    """The buffers of one (model, rows, length, sampling) shape, and on GPU the decode step captured
    as one CUDA graph: the forward (compiled by inductor), the sample and the bookkeeping, so the
    host spends ~10 us per token instead of running Python per kernel."""

    def __init__(self, model, b: int, L: int, device, sampling: tuple, fwd):
        from transformers import StaticCache

        self.model, self.sampling, self.fwd = model, sampling, fwd
        self.cache = StaticCache(config=model.config, max_cache_len=L)
        self.mask = torch.ones((b, L), dtype=torch.long, device=device)
        self.tok = torch.zeros((b, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((b, 1), dtype=torch.long, device=device)
        self.t = torch.zeros(1, dtype=torch.long, device=device)
        self.done = torch.zeros(b, dtype=torch.bool, device=device)
        self.out = torch.zeros((b, L), dtype=torch.long, device=device)   # sampled ids from column 0
        self.graph = None
        self.params = _param_pointers(model)

    def take(self, logits: torch.Tensor) -> None:
        """logits [b, V] of each row's last position -> its next token at column t (pad_id once the
        row has ended); the token becomes the next step's input."""
        temperature, top_p, greedy, eos_id, pad_id = self.sampling
        tok = logits.argmax(-1) if greedy else sample_tokens(logits, temperature, top_p)
        self.out.index_copy_(1, self.t, torch.where(self.done, pad_id, tok)[:, None])
        self.done |= tok == eos_id
        self.tok.copy_(tok[:, None])
        self.t.add_(1)

    def body(self) -> None:
        """One token for every row: the forward of the last token (tok at pos), then the next token."""
        self.take(self.fwd(self.model, self.tok, self.mask, self.pos, self.cache))
        self.pos.add_(1)

    def capture(self) -> None:
        """Record body() as a CUDA graph (after two runs on a side stream, as CUDA graphs need).
        The runs advance the cache; the caller resets it and prefills again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.body()

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()


ATTENTION = "hybridrl_decode"


def _decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """Attention of one new token per row over the static cache, query [b, h, 1, d], key/value
    [b, kv, L, d] -> [b, 1, h, d]. transformers' SDPA path first copies each KV head for the query
    heads sharing it (GQA) and then runs a masked kernel built for long queries: on the 0.5B shape
    that was half of each decode step (46 of ~115 us per layer on an H200). Here the query heads
    are grouped by their KV head and attend with two batched matmuls, reading the cache once.
    Longer queries (the prefill) take transformers' SDPA path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q_len, d = query.shape
    if q_len != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    kv = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b, kv, h // kv, d)               # query head i reads KV head i // (h // kv)
    # fp32 scores and weights (the cache is small: ~10 MB per layer at 64 x 320 in fp32), so the
    # samples follow the trainer's log-probs at least as closely as SDPA's kernels do
    scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scale   # [b, kv, h/kv, L]
    if attention_mask is not None:                     # [b, 1, 1, L]: bool (True: attend) or additive
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    out = torch.matmul(scores.softmax(-1), value.float())   # [b, kv, h/kv, d]
    return out.reshape(b, 1, h, d).to(query.dtype), None


@functools.cache
def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _decode_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class _attention:
    """Within the block the model's attention is `_decode_attention` (the config is shared by its layers)."""

    def __init__(self, model):
        self.config = model.config

    def __enter__(self):
        _register_attention()
        self.before = self.config._attn_implementation
        self.config._attn_implementation = ATTENTION

    def __exit__(self, *exc):
        self.config._attn_implementation = self.before


def _param_pointers(model) -> tuple:
    # a graph reads the weights where they were at capture: moved weights (DeepSpeed's sleep) need a new one
    return tuple(p.data_ptr() for p in model.parameters())


def _forward_last(model, ids, mask, pos, cache):
    """ids, pos [b, q]; mask [b, L] -> logits of the last position [b, V]."""
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]


_compiled_forward = None


@torch.no_grad()
def static_generate(model, rows: list[list[int]], *, temperature: float, top_p: float, max_new_tokens: int,
                    eos_id: int, pad_id: int, greedy: bool = False, seed: int = 0,
                    compile: bool | None = None) -> list[list[int]]:
    """Sample one response per row of prompt ids: [len(rows)][max_new_tokens] token ids, pad_id after
    a row's eos_id. Samples come from torch's default generator, seeded with `seed`.

    compile: compile the forward and capture each decode step as a CUDA graph (default: on GPU)."""

    global _compiled_forward
    device = next(model.parameters()).device
    graph = (device.type == "cuda") if compile is None else compile
    b = len(rows)
    P = max(len(r) for r in rows)
    if device.type == "cuda":
        P = -(-P // PAD_MULTIPLE) * PAD_MULTIPLE
    L = P + max_new_tokens
    ids, prompt_mask = left_pad(rows, pad_id, P)
    # 0 on the left padding only: causality comes from the cache's position
    mask = torch.cat([prompt_mask, torch.ones((b, max_new_tokens), dtype=torch.long)], 1)
    ids = ids.to(device)
    fwd = _forward_last
    if graph:
        if _compiled_forward is None:
            _compiled_forward = torch.compile(_forward_last, dynamic=False)
        fwd = _compiled_forward
    sampling = (temperature, top_p, greedy, eos_id, pad_id)
    key = (id(model), b, L, sampling, graph)
    dec = _DECODERS.get(key)
    if dec is None or dec.params != _param_pointers(model):
        # two shapes kept (a run's rollouts and its evaluations); a third frees the oldest, ~0.25 GiB
        # of cache for a 0.5B model at 64 x 320
        _DECODERS.pop(key, None)
        while len(_DECODERS) >= 2:
            _DECODERS.pop(next(iter(_DECODERS)))
        dec = _DECODERS[key] = _Decoder(model, b, L, device, sampling, fwd)
    torch.manual_seed(seed)

    def prefill() -> None:
        dec.cache.reset()
        dec.mask.copy_(mask)
        pos = (dec.mask[:, :P].cumsum(1) - 1).clamp(min=0)            # [b, P]
        dec.out.fill_(pad_id)
        dec.done.zero_()
        dec.t.zero_()
        dec.take(_forward_last(model, ids, dec.mask, pos, dec.cache))
        dec.pos.copy_(pos[:, -1:] + 1)

    with _attention(model):
        prefill()
        if graph and dec.graph is None:
            dec.capture()
            torch.manual_seed(seed)
            prefill()
        every = CHECK_EVERY if device.type == "cuda" else 1
        for t in range(1, max_new_tokens):
            if t % every == 0 and bool(dec.done.all()):
                break
            dec.step()
    return dec.out[:, :max_new_tokens].tolist()


def left_pad(rows: list[list[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids -> (ids, mask) [b, width] (default: the longest row), each row at the right end."""
    width = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, r in enumerate(rows):
        ids[j, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[j, width - len(r):] = 1
    return ids, mask


@torch.no_grad()
def hf_generate(model, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float,
                max_new_tokens: int, eos_id: int, pad_id: int, micro_batch: int, synced_gpus: bool = False,
                greedy: bool = False, static_cache: bool = False, seed: int = 0) -> Samples:
    """Sample n responses per prompt, `micro_batch` prompts at a time: with transformers' `generate`
    (left-padded prompt batches), or with `static_cache` through `common.rollout.decode` (a preallocated KV
    cache; on GPU each decode step is one CUDA graph), sampling from torch's generator seeded with `seed`."""
    device = next(model.parameters()).device
    out_p, out_r, out_i, out_t = [], [], [], []
    for start in range(0, len(prompt_ids), micro_batch):
        chunk = prompt_ids[start: start + micro_batch]
        if static_cache:  # [len(chunk) * n rows, max_new_tokens], pad_id after each row's eos
            gen = static_generate(model, [p for p in chunk for _ in range(n)], temperature=temperature, top_p=top_p,
                                  greedy=greedy, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                                  seed=seed + start)
        else:
            ids, mask = left_pad(chunk, pad_id)
            gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=not greedy,
                                 temperature=temperature if not greedy else None, top_p=top_p if not greedy else None,
                                 top_k=0 if not greedy else None, max_new_tokens=max_new_tokens,
                                 num_return_sequences=n, eos_token_id=eos_id, pad_token_id=pad_id,
                                 synced_gpus=synced_gpus, use_cache=True)
            gen = gen[:, ids.shape[1]:].tolist()
        for k, row in enumerate(gen):
            j = k // n
            resp = row[: row.index(eos_id) + 1] if eos_id in row else [t for t in row if t != pad_id]
            out_p.append(chunk[j])
            out_r.append(resp)
            out_i.append(start + j)
            out_t.append(eos_id not in row)
    return Samples(out_p, out_r, out_i, out_t)
