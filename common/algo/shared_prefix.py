"""Log-probs of sampled responses with each distinct prompt run once (`--share_prompt_prefix`).

In GRPO a prompt is sampled n times, so the rows of a batch repeat the same prompt tokens n times.
Here consecutive rows with the same prompt form a group: the group's prompt runs once, its keys and
values are copied to the group's rows (an indexing op, so gradients from every response flow back
into the one prompt forward), and the responses run on top of that cache. Attention, positions and
therefore the log-probs and gradients are those of the plain forward over whole rows; the FLOPs of
the prompt part shrink by the group size.

Shapes: b rows of width t (right-padded `[prompt, response, pad]`), G groups, P the longest prompt
of the micro-batch, R its longest response, V the vocabulary.
"""
from __future__ import annotations

import torch

from common.algo.logprobs import token_stats


def prompt_lengths(attention_mask: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Where each row's response starts: [b, t], [b, t-1] -> [b].

    The first action column is the position that predicts the first response token, so the prompt
    ends one column later; a row without actions (an empty response) is all prompt. The split only
    decides what is shared: tokens after it are run per row, so every action position is covered
    whatever the action mask holds.
    """
    has = action_mask.bool()
    first = has.long().argmax(1)  # the first 1 of each row (0 for a row of zeros, replaced below)
    return torch.where(has.any(1), first + 1, attention_mask.sum(1))


def prompt_groups(input_ids: torch.Tensor, plen: torch.Tensor) -> torch.Tensor:
    """Group index of each row: consecutive rows with the same prompt (length and tokens) share one.
    input_ids [b, t], plen [b] -> [b] long, 0 .. G-1 in row order."""
    # over the full width, masked past each prompt: no host sync for the longest prompt (the caller has one)
    cols = torch.arange(input_ids.shape[1], device=input_ids.device)
    same_tokens = ((input_ids[1:] == input_ids[:-1]) | (cols[None, :] >= plen[1:, None])).all(1)
    new = torch.ones_like(plen, dtype=torch.bool)
    new[1:] = ~(same_tokens & (plen[1:] == plen[:-1]))
    return new.long().cumsum(0) - 1


def _span(ids: torch.Tensor, start: torch.Tensor, length: torch.Tensor, width: int, right: bool):
    """Columns start .. start+length-1 of each row of ids [rows, T] as (ids, mask) [rows, width], set
    against the right end (`right`: a prompt, padding before) or the left end (a response, padding after).
    Padding columns hold some token of the row; the mask leaves them out."""
    cols = torch.arange(width, device=ids.device)
    offset = (width - length)[:, None] if right else torch.zeros_like(length)[:, None]
    mask = (cols[None, :] >= offset) & (cols[None, :] < offset + length[:, None])
    src = (start[:, None] + cols[None, :] - offset).clamp(0, ids.shape[1] - 1)
    return ids.gather(1, src), mask.long()


def shared_prefix_stats(model, micro: dict, temperature: float = 1.0, entropy: bool = False):
    """(log-probs [b, t-1], entropy [b, t-1] or None) of each next token from the prompt's last position on,
    as `token_stats` over the plain forward's `logits[:, :-1]` gives them there; zeros before it.

    micro: a micro-batch of `common.rollout.samples.make_batch` rows, input_ids and attention_mask [b, t]
    (right-padded), action_mask [b, t-1] (see `prompt_lengths`). `model`: a causal LM, or a DeepSpeed
    engine around one, that takes a key/value cache and `logits_to_keep` (transformers' causal LMs do).
    """
    input_ids, attention_mask = micro["input_ids"], micro["attention_mask"]
    t = input_ids.shape[1]
    lens = attention_mask.sum(1)
    plen = prompt_lengths(attention_mask, micro["action_mask"])
    group = prompt_groups(input_ids, plen)
    heads = torch.nonzero(torch.diff(group, prepend=group.new_full((1,), -1))).squeeze(1)  # [G] first row of each
    P = int(plen.max())
    # The prompts, left-padded so each ends at column P-1: its last position's logits (the only ones
    # wanted) sit in one column, and the responses continue every prompt from column P on.
    p_ids, p_mask = _span(input_ids[heads], torch.zeros_like(heads), plen[heads], P, right=True)
    p_pos = (p_mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_select_indices(group)  # [G, ...] -> [b, ...] per layer: an index op, gradients flow back

    rlen = lens - plen
    R = int(rlen.max())
    r_ids, r_mask = _span(input_ids, plen, rlen, max(R, 1), right=False)
    # The first response token is predicted by the prompt's last position, the others by the response's.
    first_lp, first_ent = token_stats(out.logits[group], r_ids[:, :1], temperature, entropy)  # [b, 1]
    lp, ent = first_lp, first_ent
    if R > 1:
        r_pos = plen[:, None] + torch.arange(R, device=input_ids.device)[None, :]
        mask = torch.cat([p_mask[group], r_mask], 1)  # [b, P + R]: the group's prompt, then this row's response
        logits = model(input_ids=r_ids, attention_mask=mask, position_ids=r_pos, past_key_values=cache,
                       use_cache=True).logits
        # Each position against the next token, the last against an arbitrary one, dropped after: the
        # logits stay one contiguous tensor, as in the plain path.
        rest_lp, rest_ent = token_stats(logits, torch.roll(r_ids, -1, dims=1), temperature, entropy)
        lp = torch.cat([first_lp, rest_lp[:, :-1]], 1)  # [b, R]: log p(response token j)
        ent = torch.cat([first_ent, rest_ent[:, :-1]], 1) if entropy else None

    # Back to the plain layout: response token j of a row is predicted at column plen - 1 + j.
    cols = torch.arange(t - 1, device=input_ids.device)
    j = cols[None, :] - (plen[:, None] - 1)
    valid = (j >= 0) & (j < rlen[:, None])
    j = j.clamp(0, lp.shape[1] - 1)

    def place(x):
        return torch.where(valid, x.gather(1, j), torch.zeros((), dtype=x.dtype, device=x.device))

    return place(lp), (place(ent) if entropy else None)
