"""--share_prompt_prefix: each prompt run once for its samples gives the plain forward's log-probs,
entropies and gradients (the built-in tiny model, fp32), also when a micro-batch boundary splits a group."""
from __future__ import annotations

import pytest
import torch

from common.algo.logprobs import token_stats
from common.rollout.samples import Samples, make_batch, trim
from common.algo.shared_prefix import prompt_groups, prompt_lengths, shared_prefix_stats

TEMPERATURE = 0.7


def _samples() -> Samples:
    """Four groups of three: prompts of 7, 3, 12 and 8 tokens (the last one the first prompt plus one
    token, so only the length tells them apart), responses of 0 to 9 tokens."""
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(10, 500, (n,), generator=g).tolist()

    prompts = [tokens(7), tokens(3), tokens(12)]
    prompts.append(prompts[0] + tokens(1))
    resp_lens = [4, 0, 6, 1, 2, 5, 3, 9, 2, 2, 1, 4]
    rows = [prompts[k // 3] for k in range(12)]
    return Samples(rows, [tokens(n) for n in resp_lens], [k // 3 for k in range(12)], [False] * 12)


def _plain(model, micro):
    """The worker's forward without sharing: whole rows, every position against the next token."""
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    lp, ent = token_stats(logits, torch.roll(micro["input_ids"], -1, dims=1), TEMPERATURE, True)
    return lp[:, :-1], ent[:, :-1]


def _run(model, batch, stats, micro_batch):
    """Log-probs and entropies [N, T-1] (off the action mask: 0) and every parameter's gradient of a
    masked loss summed over micro-batches, as the worker's train loop takes them."""
    model.zero_grad(set_to_none=True)
    W = batch["input_ids"].shape[1] - 1
    lps, ents = [], []
    for i in range(0, batch["input_ids"].shape[0], micro_batch):
        micro = trim({k: v[i: i + micro_batch] for k, v in batch.items()})
        lp, ent = stats(model, micro)
        mask = micro["action_mask"]
        loss = ((1.3 * lp - 0.2 * ent) * mask).sum() / mask.sum()
        loss.backward()
        lps.append(torch.nn.functional.pad((lp * mask).detach(), (0, W - lp.shape[1])))
        ents.append(torch.nn.functional.pad((ent * mask).detach(), (0, W - ent.shape[1])))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return torch.cat(lps), torch.cat(ents), grads


def test_prompt_lengths_and_groups():
    batch = make_batch(_samples(), pad_id=0)
    plen = prompt_lengths(batch["attention_mask"], batch["action_mask"])
    assert plen.tolist() == [7] * 3 + [3] * 3 + [12] * 3 + [8] * 3  # the empty response's row too
    assert prompt_groups(batch["input_ids"], plen).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    # the same prompt in rows that are not next to each other: two groups, each correct on its own
    order = [0, 3, 1, 2]
    assert prompt_groups(batch["input_ids"][order], plen[order]).tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_equals_plain_forward(attn):
    from transformers import AutoModelForCausalLM

    from common.training.tiny import tiny_model_path

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), attn_implementation=attn, dtype=torch.float32)
    model.train()  # as the actor trains (the tiny model has no dropout)
    batch = make_batch(_samples(), pad_id=0)
    lp, ent, grads = _run(model, batch, _plain, micro_batch=4)
    # micro-batches of 4 rows cut the groups of 3: each piece shares within itself
    shared = lambda m, micro: shared_prefix_stats(m, micro, TEMPERATURE, entropy=True)  # noqa: E731
    s_lp, s_ent, s_grads = _run(model, batch, shared, micro_batch=4)
    torch.testing.assert_close(s_lp, lp, atol=1e-5, rtol=1e-6)  # |log p| up to ~15: fp32 rounding
    torch.testing.assert_close(s_ent, ent, atol=1e-5, rtol=0)
    for name, g in grads.items():
        assert g.norm() > 0, name
        err = ((s_grads[name] - g).norm() / g.norm()).item()
        assert err < 1e-5, (name, err)


def test_shared_prefix_without_grad_and_without_entropy():
    """The reference's and the old policy's path: no_grad, log-probs only, one micro-batch."""
    from transformers import AutoModelForCausalLM

    from common.training.tiny import tiny_model_path

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32).eval()
    batch = make_batch(_samples(), pad_id=0)
    with torch.no_grad():
        lp, ent = shared_prefix_stats(model, batch, TEMPERATURE)
        ref = _plain(model, batch)[0]
    assert ent is None and not lp.requires_grad
    mask = batch["action_mask"]
    torch.testing.assert_close(lp * mask, ref * mask, atol=1e-5, rtol=1e-6)
    assert (lp[mask == 0] == 0).all()
