"""Preference pairs for the reward model and DPO: tokenized (prompt, chosen, rejected) triples from
rows in any of the accepted layouts, and their batches.

Every problem the user can fix raises `UserError` naming the source and the 1-based row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from common.errors import UserError
from common.data.prompts import (as_text_or_messages, encode, field, fill_template, needs_template, render_chat,
                            render_response, type_name, user_turn)


@dataclass(frozen=True)
class PreferencePair:
    prompt_ids: list[int]  # shared prompt tokens (empty when there is no prompt)
    chosen_ids: list[int]  # response tokens, ending with eos
    rejected_ids: list[int]
    margin: float | None


def build_preference_pairs(rows: list[dict], source: str, tokenizer, *, chosen_key: str = "chosen",
                           rejected_key: str = "rejected", prompt_key: str | None = None,
                           apply_chat_template: bool = False, max_len: int = 512,
                           margin_key: str = "margin", input_template: str | None = None
                           ) -> tuple[list[PreferencePair], int]:
    """Tokenized (prompt, chosen, rejected) triples; the second value (rows dropped) is always 0.

    Rows hold chosen/rejected as strings (with an optional `prompt_key` string or message list),
    as whole conversations (message lists; the prompt is all but the last message and must be the
    same on both sides), or as the assistant turn alone beside a `prompt_key` (TRL's
    conversational form). Truncation never drops a pair: each response keeps at least
    max_len // 2 tokens (more when the prompt is shorter) with eos last, then the prompt is cut
    from the left so prompt + longer response fits in `max_len`. Without the chat template,
    `input_template` ("Q: {}\nA: ") wraps a string prompt.
    """
    if max_len < 4:
        raise UserError(f"--max_len {max_len} is too small for a prompt and a response; use >= 4")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer has no eos token; set one in the model's tokenizer_config")
    pairs = []
    for i, row in enumerate(rows, start=1):
        where = f"{source}, row {i}"
        prompt, chosen, rejected = _pair_texts(row, where, tokenizer, chosen_key, rejected_key,
                                               prompt_key, apply_chat_template, input_template)
        p = encode(tokenizer, prompt) if prompt else []
        c, r = (_with_eos(encode(tokenizer, t), eos) for t in (chosen, rejected))
        keep = max(max_len // 2, max_len - len(p))
        c, r = (ids if len(ids) <= keep else ids[:keep - 1] + [eos] for ids in (c, r))
        p = p[max(0, len(p) - (max_len - max(len(c), len(r)))):]
        pairs.append(PreferencePair(p, c, r, _margin(row, margin_key, where)))
    return pairs, 0


def _pair_texts(row, where, tokenizer, chosen_key, rejected_key, prompt_key, apply_chat_template,
                input_template=None):
    """(prompt text, chosen response text, rejected response text) of one row."""
    chosen = as_text_or_messages(field(row, chosen_key, "--chosen_key", where), chosen_key, where)
    rejected = as_text_or_messages(field(row, rejected_key, "--rejected_key", where),
                                   rejected_key, where)
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise UserError(f"{where}: '{chosen_key}' and '{rejected_key}' must both be strings or "
                        "both be message lists")
    prompt = None
    if prompt_key is not None:
        prompt = as_text_or_messages(field(row, prompt_key, "--prompt_key", where), prompt_key,
                                     where)
    is_chat = not isinstance(chosen, str) or (prompt is not None and not isinstance(prompt, str))
    if is_chat and not apply_chat_template:
        key = prompt_key if isinstance(chosen, str) else chosen_key
        raise needs_template(key, where)
    if not apply_chat_template:
        return fill_template(input_template, prompt) if prompt else "", chosen, rejected

    if isinstance(chosen, str):
        prompt_msgs = user_turn(prompt) if prompt is not None else []
        chosen, rejected = ([{"role": "assistant", "content": t}] for t in (chosen, rejected))
    elif prompt is not None:
        prompt_msgs = user_turn(prompt)
        # Accept whole conversations beside a prompt column too: drop the repeated prompt.
        n = len(prompt_msgs)
        chosen, rejected = (m[n:] if len(m) > n and m[:n] == prompt_msgs else m
                            for m in (chosen, rejected))
    else:
        prompt_msgs = chosen[:-1]
        if rejected[:-1] != prompt_msgs:
            raise UserError(f"{where}: '{chosen_key}' and '{rejected_key}' differ before their "
                            "last message, so they do not share a prompt; the conversation up to "
                            "the last message must be identical on both sides")
        for key, msgs in ((chosen_key, chosen), (rejected_key, rejected)):
            if msgs[-1]["role"] != "assistant":
                raise UserError(f"{where}: the last message of '{key}' must be the assistant's "
                                f"reply, got role '{msgs[-1]['role']}'")
        chosen, rejected = chosen[-1:], rejected[-1:]
    prompt_text = render_chat(tokenizer, prompt_msgs, True, where) if prompt_msgs else ""
    return (prompt_text, *(render_response(tokenizer, prompt_msgs, prompt_text, m, key, where)
                           for m, key in ((chosen, chosen_key), (rejected, rejected_key))))


def _with_eos(ids: list[int], eos: int) -> list[int]:
    return ids if ids and ids[-1] == eos else ids + [eos]


def _margin(row: dict, key: str, where: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        margin = float(value)  # numbers, and numeric strings from CSV
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{where}: '{key}' must be a number, got {type_name(value)} "
                        f"{value!r:.40}") from None
    if not math.isfinite(margin):
        raise UserError(f"{where}: '{key}' must be finite, got {margin}")
    return margin


def load_preference_data(dataset: str | None, eval_dataset: str | None, tokenizer, *, max_samples: int | None,
                         dataset_probs: str | None = None, dataset_split: str = "train", eval_split: str = "test",
                         default_eval_split: str = "test", seed: int = 42,
                         **keys) -> tuple[list[PreferencePair], str, list[PreferencePair], str | None]:
    """(train pairs, source, eval pairs, source): the built-in copy task when `dataset` is None.

    `dataset` and `eval_dataset` may name several sources, comma-separated; the training sources are
    mixed with `dataset_probs` (seeded by `seed`), the held-out ones concatenated (`common.data.blend`)."""
    from common.data.blend import EVAL_FLAGS, load_mixture

    if dataset is None:  # chat messages with their own keys
        from common.data.tasks import preference_rows
        keys = dict(keys, chosen_key="chosen", rejected_key="rejected", prompt_key=None, apply_chat_template=True,
                    input_template=None)
        train_rows, train_src = preference_rows(4000, "train", seed=0)[:max_samples], "built-in copy task"
        eval_rows, eval_src = preference_rows(256, "eval", seed=0), "built-in copy task (held out)"
    else:
        train_rows, train_src = load_mixture(dataset, dataset_probs, split=dataset_split, max_samples=max_samples,
                                             seed=seed)
        eval_rows, eval_src = None, None
    if eval_dataset is not None:
        eval_rows, eval_src = load_mixture(eval_dataset, split=eval_split, default_split=default_eval_split,
                                           flags=EVAL_FLAGS)
    held_out = build_preference_pairs(eval_rows, eval_src, tokenizer, **keys)[0] if eval_rows else []
    return build_preference_pairs(train_rows, train_src, tokenizer, **keys)[0], train_src, held_out, eval_src


def collate_pairs(pairs: list[PreferencePair], pad_id: int) -> dict[str, Any]:
    """One batch of 2B right-padded sequences: rows 0..B-1 prompt+chosen, B..2B-1 prompt+rejected.

    Returns input_ids [2B, T] long, attention_mask [2B, T] long (1 on real tokens), loss_mask
    [2B, T] long (1 on response tokens at their input_ids positions; use `loss_mask[:, 1:]` with
    `logits[:, :-1]`), margin [B] float (0 where a row has none) and has_margin (python bool: any
    pair has one).
    """
    import torch

    if not pairs:
        raise ValueError("collate_pairs needs at least one pair")
    seqs = [(p.prompt_ids, p.chosen_ids) for p in pairs] + [(p.prompt_ids, p.rejected_ids)
                                                            for p in pairs]
    T = max(len(a) + len(b) for a, b in seqs)
    input_ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), T), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for k, (prompt, response) in enumerate(seqs):
        n = len(prompt) + len(response)
        input_ids[k, :n] = torch.tensor(prompt + response, dtype=torch.long)
        attention_mask[k, :n] = 1
        loss_mask[k, len(prompt):n] = 1
    margin = torch.tensor([p.margin or 0.0 for p in pairs], dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "margin": margin, "has_margin": any(p.margin is not None for p in pairs)}
