"""Datasets for the training scripts: rows from files or the hub, preference pairs, batch order.

Every problem the user can fix raises `UserError` naming the file and the 1-based line (JSON lines)
or row (everything else, and the `build_*` functions, where row N is the N-th row that loaded).
Prompts for online RL (`build_prompts`) and the chat-template helpers live in `common/prompts.py`
and are re-exported here, so scripts import everything data-related from `common.data`.

`datasets`, `pyarrow` and `torch` are imported inside the functions that need them, so importing
this module stays cheap.
"""
from __future__ import annotations

import csv
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Iterator

from common.errors import UserError
from common.prompts import (PromptExample, as_text_or_messages, build_prompts, encode, field,
                            keys_of, needs_template, one_line, render_chat, render_response,
                            type_name, user_turn)

__all__ = ["load_rows", "PreferencePair", "build_preference_pairs", "collate_pairs",
           "PromptExample", "build_prompts", "epoch_order", "iterate_batches"]

_JSON_CONTAINER_KEYS = ("data", "train")


def load_rows(source: str, *, split: str = "train", max_samples: int | None = None) -> list[dict]:
    """Rows of a .jsonl/.json/.parquet/.csv file, a `save_to_disk` folder, or a hub dataset id.

    `max_samples` keeps the first N rows (files are read only that far where the format allows).
    """
    if os.path.isfile(source):
        ext = os.path.splitext(source)[1].lower()
        readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet,
                   ".csv": _read_csv}
        if ext not in readers:
            raise UserError(f"{source}: unknown file type '{ext}'; use .jsonl, .json, .parquet or "
                            ".csv, a folder written by datasets' save_to_disk, or a hub dataset id")
        try:
            rows = readers[ext](source, split, max_samples)
        except UnicodeDecodeError as e:
            raise UserError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    elif os.path.isdir(source):
        rows = _read_folder(source, split, max_samples)
    elif os.path.splitext(source)[1].lower() in (".jsonl", ".json", ".parquet", ".csv"):
        raise UserError(f"{source}: file not found")
    elif source.startswith(("/", ".", "~")) or source.count("/") > 1:  # hub ids are "org/name"
        raise UserError(f"{source}: no such file or folder (and not a hub id like 'org/name')")
    else:
        rows = _read_hub(source, split, max_samples)
    if max_samples is not None:
        rows = rows[:max_samples]
    if not rows:
        raise UserError(f"{source}: no rows")
    return rows


def _read_jsonl(path: str, split: str, max_samples: int | None) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            if max_samples is not None and len(rows) >= max_samples:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}, line {lineno}: not valid JSON "
                                f"({e.msg}, column {e.colno})") from None
            _check_object(row, f"{path}, line {lineno}")
            rows.append(row)
    return rows


def _read_json(path: str, split: str, max_samples: int | None) -> list[dict]:
    with open(path, encoding="utf-8-sig") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines saved under a .json name: a common mix-up
            return _read_jsonl(path, split, max_samples)
        raise UserError(f"{path}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno})") \
            from None
    if isinstance(data, dict):
        for key in (*_JSON_CONTAINER_KEYS, split):
            if isinstance(data.get(key), list):
                data = data[key]
                break
        else:
            raise UserError(f"{path}: expected a list of objects, or an object with the list "
                            f"under 'data', 'train' or '{split}'; found keys {keys_of(data)}")
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of objects, got {type_name(data)}")
    for i, row in enumerate(data, start=1):
        _check_object(row, f"{path}, row {i}")
    return data


def _read_parquet(path: str, split: str, max_samples: int | None) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise UserError(f"{path}: cannot read as Parquet ({one_line(e)})") from None
    if max_samples is not None:
        table = table.slice(0, max_samples)
    return table.to_pylist()


def _read_csv(path: str, split: str, max_samples: int | None) -> list[dict]:
    # Python's csv keeps every cell a string, so a column of digits stays text; numeric fields
    # (margin) accept numeric strings for this reason.
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        rows = []
        for i, row in enumerate(reader, start=1):
            if max_samples is not None and len(rows) >= max_samples:
                break
            if None in row:
                raise UserError(f"{path}, row {i}: more cells than header columns "
                                f"{reader.fieldnames}")
            rows.append(row)
    return rows


def _read_folder(path: str, split: str, max_samples: int | None) -> list[dict]:
    import datasets

    saved = any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))
    if not saved:  # a folder of data files: let `datasets` pick the builder
        return _read_hub(path, split, max_samples, local=True)
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # a half-copied folder fails in many ways inside `datasets`
        raise UserError(f"{path}: cannot load this save_to_disk folder ({one_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"{path}: no split '{split}'; the saved splits are {sorted(ds)}")
        ds = ds[split]
    return _to_rows(ds, max_samples)


def _read_hub(source: str, split: str, max_samples: int | None, local: bool = False) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as e:  # offline, unknown id, unknown split, bad files: all end the same way
        where = ("exists but `datasets` cannot load it" if local else
                 "does not exist locally and could not be fetched from the hub")
        raise UserError(f"{source}: {where} ({one_line(e)})") from None
    return _to_rows(ds, max_samples)


def _to_rows(ds, max_samples: int | None) -> list[dict]:
    if max_samples is not None and max_samples < len(ds):
        ds = ds.select(range(max_samples))
    return ds.to_list()


def _check_object(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object ({{\"key\": value, ...}}), "
                        f"got {type_name(row)}")


# ---- preference pairs --------------------------------------------------------------------------

@dataclass(frozen=True)
class PreferencePair:
    prompt_ids: list[int]  # shared prompt tokens (empty when there is no prompt)
    chosen_ids: list[int]  # response tokens, ending with eos
    rejected_ids: list[int]
    margin: float | None


def build_preference_pairs(rows: list[dict], source: str, tokenizer, *, chosen_key: str = "chosen",
                           rejected_key: str = "rejected", prompt_key: str | None = None,
                           apply_chat_template: bool = False, max_len: int = 512,
                           margin_key: str = "margin") -> tuple[list[PreferencePair], int]:
    """Tokenized (prompt, chosen, rejected) triples; the second value (rows dropped) is always 0.

    Rows hold chosen/rejected as strings (with an optional `prompt_key` string or message list),
    as whole conversations (message lists; the prompt is all but the last message and must be the
    same on both sides), or as the assistant turn alone beside a `prompt_key` (TRL's
    conversational form). Truncation never drops a pair: each response keeps at least
    max_len // 2 tokens (more when the prompt is shorter) with eos last, then the prompt is cut
    from the left so prompt + longer response fits in `max_len`.
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
                                               prompt_key, apply_chat_template)
        p = encode(tokenizer, prompt) if prompt else []
        c, r = (_with_eos(encode(tokenizer, t), eos) for t in (chosen, rejected))
        keep = max(max_len // 2, max_len - len(p))
        c, r = (ids if len(ids) <= keep else ids[:keep - 1] + [eos] for ids in (c, r))
        p = p[max(0, len(p) - (max_len - max(len(c), len(r)))):]
        pairs.append(PreferencePair(p, c, r, _margin(row, margin_key, where)))
    return pairs, 0


def _pair_texts(row, where, tokenizer, chosen_key, rejected_key, prompt_key, apply_chat_template):
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
        return prompt or "", chosen, rejected

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
                         **keys) -> tuple[list[PreferencePair], str, list[PreferencePair], str | None]:
    """(train pairs, source, eval pairs, source): the built-in copy task when `dataset` is None."""
    if dataset is None:  # chat messages with their own keys
        from common.tasks import preference_rows
        keys = dict(keys, chosen_key="chosen", rejected_key="rejected", prompt_key=None, apply_chat_template=True)
        train_rows, train_src = preference_rows(4000, "train", seed=0)[:max_samples], "built-in copy task"
        eval_rows, eval_src = preference_rows(256, "eval", seed=0), "built-in copy task (held out)"
    else:
        train_rows, train_src = load_rows(dataset, max_samples=max_samples), dataset
        eval_rows, eval_src = None, None
    if eval_dataset is not None:
        eval_rows, eval_src = load_rows(eval_dataset, split="test"), eval_dataset
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


# ---- resumable data order ----------------------------------------------------------------------

def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """A permutation of range(n) fixed by (seed, epoch): a resumed run can rebuild its order."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def iterate_batches(n: int, batch_size: int, seed: int, start_epoch: int = 0, start_step: int = 0,
                    drop_last: bool = True) -> Iterator[tuple[int, int, list[int]]]:
    """Yield (epoch, step_in_epoch, indices) forever, starting at (start_epoch, start_step).

    With drop_last the last partial batch of each epoch is skipped; otherwise it is yielded short.
    """
    steps = (n // batch_size if drop_last else -(-n // batch_size)) if batch_size > 0 else 0
    if steps == 0:
        raise UserError(f"{n} samples do not fill one batch of {batch_size}; use more data or a "
                        "smaller batch size")
    if not 0 <= start_step < steps:
        raise ValueError(f"start_step {start_step} is outside an epoch of {steps} steps")
    epoch, step = start_epoch, start_step
    while True:
        order = epoch_order(n, seed, epoch)
        for s in range(step, steps):
            yield epoch, s, order[s * batch_size:(s + 1) * batch_size]
        epoch, step = epoch + 1, 0
