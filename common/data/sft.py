"""Supervised fine-tuning data: tokenized sequences with a loss mask, from rows in any of the
accepted layouts, and their batches.

Row layouts (OpenRLHF's `--input_key` / `--output_key`, and TRL's two SFT formats):
  {"input": "..", "output": ".."}          a prompt and its response, strings or message lists
  {"input": [messages]}                    a whole conversation (no --output_key), with --apply_chat_template
  {"messages": [messages]}                 TRL's conversational format (read as --input_key messages)
  {"prompt": .., "completion": ..}         TRL's prompt-completion format (--input_key prompt --output_key completion)
The loss covers the response: the last assistant turn, or with `multiturn` every assistant turn;
with `pretrain_mode` every token of the text. Every problem the user can fix raises `UserError`
naming the source and the 1-based row.
"""
from __future__ import annotations

from dataclasses import dataclass, field as dc_field
from typing import Any

from common.errors import UserError
from common.data.prompts import (as_text_or_messages, encode, field, fill_template, needs_template, render_chat,
                            user_turn)

OPENRLHF_SFT_TEMPLATE = "User: {}\nAssistant: "  # OpenRLHF's train_sft default --input_template


@dataclass(frozen=True)
class SFTKeys:
    """How to read a row (the script's data flags)."""
    input_key: str = "input"
    output_key: str | None = None
    apply_chat_template: bool = False
    input_template: str | None = OPENRLHF_SFT_TEMPLATE  # plain-text prompts only
    multiturn: bool = False
    pretrain_mode: bool = False
    max_len: int = 2048


@dataclass(frozen=True)
class SFTExample:
    ids: list[int]
    loss_mask: list[int]  # 1 on the tokens the loss predicts, at their `ids` positions
    prompt_len: int       # tokens before the first response token (what generation starts from)


@dataclass
class SFTStats:
    dropped: int = 0            # prompts that left fewer than 2 tokens of --max_len for a response
    first_dropped: str = ""     # "file, row 7 (612 prompt tokens)"
    truncated: int = 0          # rows cut to --max_len (eos kept last)
    formats: list[str] = dc_field(default_factory=list)


def resolve_keys(row: dict, keys: SFTKeys, source: str) -> tuple[SFTKeys, str | None]:
    """TRL's layouts when the row has no `input` column and the keys are OpenRLHF's defaults:
    (keys to use, a note for the banner or None)."""
    if keys.input_key != "input" or keys.output_key is not None or "input" in row:
        return keys, None
    from dataclasses import replace

    if "messages" in row:
        return replace(keys, input_key="messages"), f"{source}: rows hold 'messages' (TRL's conversational format)"
    if "prompt" in row and "completion" in row:
        return (replace(keys, input_key="prompt", output_key="completion"),
                f"{source}: rows hold 'prompt' and 'completion' (TRL's prompt-completion format)")
    if "text" in row and keys.pretrain_mode:
        return replace(keys, input_key="text"), f"{source}: rows hold 'text' (read as --input_key text)"
    return keys, None


def build_sft_examples(rows: list[dict], source: str, tokenizer, keys: SFTKeys) -> tuple[list[SFTExample], SFTStats]:
    """Tokenized sequences and what was dropped or cut. As OpenRLHF, a row whose prompt leaves fewer than
    2 tokens of `max_len` is dropped (counted), a longer one is cut to `max_len` with eos last; all
    dropped is an error."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer has no eos token; set one in the model's tokenizer_config")
    stats = SFTStats()
    if not rows:
        return [], stats
    keys, note = resolve_keys(rows[0], keys, source)
    if note:
        stats.formats.append(note)
    out, longest = [], 0
    for i, row in enumerate(rows, start=1):
        where = f"{source}, row {i}"
        ids, mask = [], []
        for text, trained in _segments(row, where, tokenizer, keys):
            piece = encode(tokenizer, text) if text else []
            ids += piece
            mask += [int(trained)] * len(piece)
        if not keys.pretrain_mode and (not ids or ids[-1] != eos):  # the model learns to stop
            ids, mask = ids + [eos], mask + [1]
        prompt_len = mask.index(1) if 1 in mask else len(ids)
        if not keys.pretrain_mode and prompt_len > keys.max_len - 2:
            stats.dropped += 1
            longest = max(longest, prompt_len)
            stats.first_dropped = stats.first_dropped or f"{where} ({prompt_len} prompt tokens)"
            continue
        if len(ids) > keys.max_len:
            ids, mask = ids[:keys.max_len], mask[:keys.max_len]
            if not keys.pretrain_mode:
                ids[-1], mask[-1] = eos, 1
            stats.truncated += 1
        if sum(mask[1:]) == 0:  # pretrain mode, one token: nothing to predict
            raise UserError(f"{where}: the text is a single token; nothing to train on")
        out.append(SFTExample(ids, mask, prompt_len))
    if not out and stats.dropped:
        raise UserError(f"{source}: every prompt leaves no room for its response within --max_len {keys.max_len} "
                        f"(the first: {stats.first_dropped}; the longest has {longest}); raise --max_len")
    return out, stats


def _segments(row: dict, where: str, tokenizer, k: SFTKeys) -> list[tuple[str, bool]]:
    """The row's text as (piece, trained) pieces, in order."""
    value = as_text_or_messages(field(row, k.input_key, "--input_key", where), k.input_key, where)
    response = None
    if k.output_key is not None:
        response = as_text_or_messages(field(row, k.output_key, "--output_key", where), k.output_key, where)
    chat = not isinstance(value, str) or (response is not None and not isinstance(response, str))
    if chat and not k.apply_chat_template:
        raise needs_template(k.input_key if not isinstance(value, str) else k.output_key, where)
    if k.pretrain_mode and not k.apply_chat_template:  # OpenRLHF's continued pretraining: the raw text
        return [(value if response is None else value + response, True)]
    if not k.apply_chat_template:
        if response is None:
            raise UserError(f"{where}: '{k.input_key}' is a plain string and there is no response column: set "
                            "--output_key to the column with the response, or --pretrain_mode to train on the whole text")
        return [(fill_template(k.input_template, value), False), (response, True)]

    # chat: one conversation, the assistant turns to train on
    if response is not None:
        prompt = user_turn(value)
        answer = [{"role": "assistant", "content": response}] if isinstance(response, str) else response
        conv, first = prompt + answer, len(prompt)
    else:
        if isinstance(value, str):
            raise UserError(f"{where}: '{k.input_key}' is a plain string and there is no response column: set "
                            "--output_key, or give the whole conversation as a message list")
        conv, first = value, len(value) - 1
        if conv[-1]["role"] != "assistant":
            raise UserError(f"{where}: the last message of '{k.input_key}' must be the assistant's reply, got role "
                            f"'{conv[-1]['role']}' (or set --output_key to the response column)")
    full = render_chat(tokenizer, conv, False, where)
    if k.pretrain_mode:
        return [(full, True)]
    key = k.output_key or k.input_key
    # (first message, last message) of each trained span: every assistant turn, or the response as one
    turns = [(j, j) for j, m in enumerate(conv) if m["role"] == "assistant"] if k.multiturn else [(first, len(conv) - 1)]
    spans, pos = [], 0
    for j0, j1 in turns:
        if not any(m["content"].strip() for m in conv[j0:j1 + 1]):
            raise UserError(f"{where}: the response in '{key}'" + (f" (message {j0 + 1})" if k.multiturn else "")
                            + " is empty")
        start = len(_prefix(tokenizer, conv[:j0], True, full, where)) if j0 else 0
        stop = len(full) if j1 == len(conv) - 1 else len(_prefix(tokenizer, conv[:j1 + 1], False, full, where))
        end = start + len(_turn_end(full[start:stop], tokenizer.eos_token))
        spans += [(full[pos:start], False), (full[start:end], True)]
        pos = end
    tail = full[pos:]  # after the last turn: the template's trailing newline ends nothing the model says
    return spans + ([(tail, False)] if tail.strip() else [])


def _prefix(tokenizer, msgs: list[dict], gen: bool, full: str, where: str) -> str:
    text = render_chat(tokenizer, msgs, gen, where)
    if not full.startswith(text):
        raise UserError(f"{where}: the chat template renders the first {len(msgs)} messages differently alone and "
                        "inside the conversation, so the assistant turns cannot be split off; use a template whose "
                        "generation prompt is a prefix of the full conversation")
    return text


def _turn_end(text: str, eos: str | None) -> str:
    """An assistant turn up to and including its eos ("a b<|im_end|>\\n" -> "a b<|im_end|>")."""
    if eos and eos in text:
        return text[:text.index(eos) + len(eos)]
    return text


def load_sft_data(dataset: str | None, eval_dataset: str | None, tokenizer, keys: SFTKeys, *, max_samples: int | None,
                  dataset_probs: str | None = None, dataset_split: str = "train", eval_split: str = "train",
                  seed: int = 42) -> tuple[list[SFTExample], str, list[SFTExample], str | None, list[str]]:
    """(train, source, eval, source, notes): the built-in copy task (chat messages) when `dataset` is None."""
    from dataclasses import replace

    from common.data.blend import EVAL_FLAGS, load_mixture

    if dataset is None:
        from common.data.tasks import sft_rows

        keys = replace(keys, input_key="messages", output_key=None, apply_chat_template=True)
        train_rows, train_src = sft_rows(4000, "train", seed=0)[:max_samples], "built-in copy task"
        eval_rows, eval_src = sft_rows(256, "eval", seed=0), "built-in copy task (held out)"
    else:
        train_rows, train_src = load_mixture(dataset, dataset_probs, split=dataset_split, max_samples=max_samples,
                                             seed=seed)
        eval_rows, eval_src = None, None
    if eval_dataset is not None:
        eval_rows, eval_src = load_mixture(eval_dataset, split=eval_split, default_split="train", flags=EVAL_FLAGS)
    train, st = build_sft_examples(train_rows, train_src, tokenizer, keys)
    held, se = build_sft_examples(eval_rows, eval_src, tokenizer, keys) if eval_rows else ([], SFTStats())
    notes = st.formats + se.formats
    for s, src in ((st, train_src), (se, eval_src)):
        if s.dropped:
            notes.append(f"{src}: {s.dropped} rows dropped, their prompts leaving no room for a response within "
                         f"--max_len {keys.max_len} (the first: {s.first_dropped})")
        if s.truncated:
            notes.append(f"{src}: {s.truncated} rows cut to --max_len {keys.max_len} (eos kept last)")
    return train, train_src, held, eval_src, notes


def collate_sft(examples: list[SFTExample], pad_id: int) -> dict[str, Any]:
    """One right-padded batch: input_ids [b, t] long, attention_mask [b, t] long, loss_mask [b, t] long
    (use `loss_mask[:, 1:]` against the log-probs of `input_ids[:, 1:]`)."""
    import torch

    T = max(len(e.ids) for e in examples)
    out = {k: torch.full((len(examples), T), pad_id if k == "input_ids" else 0, dtype=torch.long)
           for k in ("input_ids", "attention_mask", "loss_mask")}
    for r, e in enumerate(examples):
        n = len(e.ids)
        out["input_ids"][r, :n] = torch.tensor(e.ids)
        out["attention_mask"][r, :n] = 1
        out["loss_mask"][r, :n] = torch.tensor(e.loss_mask)
    return out
