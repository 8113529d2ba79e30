"""Data loading: file formats, preference-pair row formats and truncation, prompts, batch order.

The tokenizer is a real byte-level BPE trained in a fixture on a tiny corpus, wrapped by
transformers with a Qwen-style chat template, so decoding the ids gives back the exact text.
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.data.rows import build_prompts, epoch_order, iterate_batches, load_rows
from common.data.preferences import PreferencePair, build_preference_pairs, collate_pairs
from common.errors import UserError

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROWS = [{"prompt": "hello", "chosen": "world", "rejected": "cat"},
        {"prompt": "how are you", "chosen": "the cat sat", "rejected": "on the mat"}]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["hello world how are you", "the cat sat on the mat",
                           "user assistant system"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>",
                                   pad_token="<|pad|>", chat_template=TEMPLATE)


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def user_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    return str(e.value)


# ---- load_rows ---------------------------------------------------------------------------------

def test_load_each_format(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text(json.dumps(ROWS[0]) + "\n\n  \n" + json.dumps(ROWS[1]) + "\n")
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    (tmp_path / "c.json").write_text(json.dumps({"data": ROWS}))
    (tmp_path / "d.json").write_text(json.dumps({"test": ROWS}))
    (tmp_path / "e.json").write_text("\n".join(json.dumps(r) for r in ROWS))  # JSON lines
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "f.parquet")
    (tmp_path / "g.csv").write_text('prompt,chosen,rejected\nhello,world,cat\n'
                                    '"how are you","the cat sat","on the mat"\n')
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(tmp_path / "saved_dict"))
    for name in ("a.jsonl", "b.json", "c.json", "e.json", "f.parquet", "g.csv", "saved",
                 "saved_dict"):
        assert load_rows(str(tmp_path / name)) == ROWS, name
    assert load_rows(str(tmp_path / "d.json"), split="test") == ROWS
    assert load_rows(str(tmp_path / "saved_dict"), split="test") == ROWS[:1]
    assert load_rows(str(tmp_path / "a.jsonl"), max_samples=1) == ROWS[:1]
    assert load_rows(str(tmp_path / "f.parquet"), max_samples=1) == ROWS[:1]
    assert load_rows(str(tmp_path / "saved"), max_samples=1) == ROWS[:1]
    msg = user_error(load_rows, str(tmp_path / "saved_dict"), split="validation")
    assert "no split 'validation'" in msg and "['test', 'train']" in msg


def test_load_errors(tmp_path, monkeypatch):
    missing = str(tmp_path / "nope.jsonl")
    assert user_error(load_rows, missing) == f"{missing}: file not found"

    bad = tmp_path / "data.jsonl"
    bad.write_text('{"a": 1}\n\n{"a": 2 "b": 3}\n')
    assert user_error(load_rows, str(bad)).startswith(
        f"{bad}, line 3: not valid JSON (Expecting ',' delimiter")

    bad.write_text('{"a": 1}\n[1, 2]\n')
    assert user_error(load_rows, str(bad)) == (
        f'{bad}, line 2: expected an object ({{"key": value, ...}}), got list')

    bad.write_text("\n\n")
    assert user_error(load_rows, str(bad)) == f"{bad}: no rows"

    (tmp_path / "x.json").write_text('{"rows": []}')
    assert "under 'data', 'train' or 'train'; found keys [rows]" in user_error(
        load_rows, str(tmp_path / "x.json"))
    (tmp_path / "x.txt").write_text("hi")
    assert "unknown file type '.txt'" in user_error(load_rows, str(tmp_path / "x.txt"))
    assert "no such file or folder" in user_error(load_rows, "./some/dir/gone")

    # Without network the hub answers at once only in offline mode; force it so the test is quick.
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    msg = user_error(load_rows, "no-such-org/no-such-dataset")
    assert msg.startswith("no-such-org/no-such-dataset: does not exist locally and could not be "
                          "fetched from the hub (")
    assert "\n" not in msg


# ---- preference pairs: row formats -------------------------------------------------------------

def test_plain_strings(tok, tmp_path):
    eos = tok.eos_token_id
    pairs, dropped = build_preference_pairs(ROWS, "d.jsonl", tok)  # no prompt key: no prompt
    assert dropped == 0
    assert pairs[0] == PreferencePair([], enc(tok, "world") + [eos], enc(tok, "cat") + [eos], None)

    pairs, _ = build_preference_pairs(ROWS, "d.jsonl", tok, prompt_key="prompt")
    assert pairs[1].prompt_ids == enc(tok, "how are you")
    assert pairs[1].chosen_ids == enc(tok, "the cat sat") + [eos]

    # A response that already ends with eos gets no second one.
    pairs, _ = build_preference_pairs([{"chosen": "world<|im_end|>", "rejected": "cat"}], "d",
                                      tok)
    assert pairs[0].chosen_ids == enc(tok, "world") + [eos]

    # With the template a string prompt becomes one user turn, a response one assistant turn.
    pairs, _ = build_preference_pairs(ROWS, "d.jsonl", tok, prompt_key="prompt",
                                      apply_chat_template=True)
    assert tok.decode(pairs[0].prompt_ids) == (
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(pairs[0].chosen_ids) == "world<|im_end|>"  # eos ends it, not the newline
    assert pairs[0].chosen_ids[-1] == eos and pairs[0].chosen_ids.count(eos) == 1


def conversation(prompt, answer):
    return [{"role": "system", "content": "be kind"}, {"role": "user", "content": prompt},
            {"role": "assistant", "content": answer}]


def test_message_formats_agree(tok):
    system_user = "<|im_start|>system\nbe kind<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
    want_prompt = system_user + "<|im_start|>assistant\n"
    whole = {"chosen": conversation("hello", "world"), "rejected": conversation("hello", "cat")}
    trl = {"prompt": conversation("hello", "")[:2],
           "chosen": [{"role": "assistant", "content": "world"}],
           "rejected": [{"role": "assistant", "content": "cat"}]}
    both = {**whole, "prompt": trl["prompt"]}  # whole conversations beside a prompt column
    results = [build_preference_pairs([whole], "d", tok, apply_chat_template=True)[0][0],
               build_preference_pairs([trl], "d", tok, prompt_key="prompt",
                                      apply_chat_template=True)[0][0],
               build_preference_pairs([both], "d", tok, prompt_key="prompt",
                                      apply_chat_template=True)[0][0]]
    for pair in results:
        assert tok.decode(pair.prompt_ids) == want_prompt
        assert tok.decode(pair.chosen_ids) == "world<|im_end|>"
        assert tok.decode(pair.rejected_ids) == "cat<|im_end|>"
        assert pair == results[0]

    other = {"chosen": whole["chosen"], "rejected": conversation("bye", "cat")}
    assert "differ before their last message" in user_error(
        build_preference_pairs, [ROWS[0], other], "d.jsonl", tok, apply_chat_template=True)
    msg = user_error(build_preference_pairs, [whole], "d.jsonl", tok)
    assert msg.startswith("d.jsonl, row 1: 'chosen' is a list of chat messages; add "
                          "--apply_chat_template")
    msg = user_error(build_preference_pairs, [{**ROWS[0], "prompt": trl["prompt"]}], "d.jsonl",
                     tok, prompt_key="prompt")
    assert "'prompt' is a list of chat messages; add --apply_chat_template" in msg
    last_user = {"chosen": whole["chosen"][:2], "rejected": whole["chosen"][:2]}
    assert "last message of 'chosen' must be the assistant's reply" in user_error(
        build_preference_pairs, [last_user], "d", tok, apply_chat_template=True)


def test_pair_errors(tok):
    good = ROWS[0]
    msg = user_error(build_preference_pairs, [good, {"prompt": "x", "answer": "y"}], "d.jsonl",
                     tok)
    assert msg == ("d.jsonl, row 2: 'chosen' is missing (the row has keys [prompt, answer]); "
                   "set --chosen_key to the key that holds it")
    assert "set --prompt_key" in user_error(build_preference_pairs, [good], "d.jsonl", tok,
                                            prompt_key="question")
    msg = user_error(build_preference_pairs, [{**good, "chosen": 5}], "d.jsonl", tok)
    assert msg.startswith("d.jsonl, row 1: 'chosen' must be a string or a non-empty list") and \
        msg.endswith("got int")
    assert user_error(build_preference_pairs, [{**good, "rejected": "  "}], "d.jsonl", tok) == (
        "d.jsonl, row 1: 'rejected' is empty")
    assert "must be a number" in user_error(build_preference_pairs, [{**good, "margin": "x"}],
                                            "d", tok)
    bad_msg = {"chosen": [{"role": "assistant"}], "rejected": [{"role": "assistant"}]}
    assert "message 1 of 'chosen' needs string 'role' and 'content'" in user_error(
        build_preference_pairs, [bad_msg], "d", tok, apply_chat_template=True)
    assert "--max_len 3 is too small" in user_error(build_preference_pairs, ROWS, "d", tok,
                                                    max_len=3)
    # chosen == rejected is allowed, and margins come through (numeric strings too, for CSV).
    pairs, _ = build_preference_pairs([{**good, "rejected": "world", "margin": "0.5"},
                                       {**good, "margin": 2}], "d", tok)
    assert pairs[0].chosen_ids == pairs[0].rejected_ids
    assert [p.margin for p in pairs] == [0.5, 2.0]


def test_truncation_keeps_eos_and_fits(tok):
    eos = tok.eos_token_id
    long_prompt = " ".join(["hello world"] * 20)
    long_answer = " ".join(["the cat sat on the mat"] * 10)
    rows = [{"prompt": long_prompt, "chosen": long_answer, "rejected": "cat"}]
    full_p = enc(tok, long_prompt)
    for max_len in (4, 5, 16, 33):
        pair = build_preference_pairs(rows, "d", tok, prompt_key="prompt", max_len=max_len)[0][0]
        assert len(pair.prompt_ids) + len(pair.chosen_ids) == max_len  # the longer side fills it
        assert len(pair.prompt_ids) + len(pair.rejected_ids) <= max_len
        assert pair.chosen_ids[-1] == eos and pair.rejected_ids[-1] == eos
        assert len(pair.chosen_ids) == max_len // 2
        assert pair.chosen_ids[:-1] == enc(tok, long_answer)[:max_len // 2 - 1]
        assert pair.prompt_ids == full_p[len(full_p) - len(pair.prompt_ids):]  # cut from the left
    # A short prompt leaves the response more than half.
    rows = [{"prompt": "hello", "chosen": long_answer, "rejected": "cat"}]
    pair = build_preference_pairs(rows, "d", tok, prompt_key="prompt", max_len=16)[0][0]
    assert pair.prompt_ids == enc(tok, "hello")
    assert len(pair.chosen_ids) == 16 - len(pair.prompt_ids)


def test_collate_pairs_by_hand():
    pairs = [PreferencePair([5, 6], [7, 2], [8, 9, 2], 1.5), PreferencePair([], [3, 2], [2], None)]
    batch = collate_pairs(pairs, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 2, 0], [3, 2, 0, 0, 0],
                                           [5, 6, 8, 9, 2], [2, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0],
                                                [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [1, 1, 0, 0, 0],
                                           [0, 0, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert torch.equal(batch["margin"], torch.tensor([1.5, 0.0]))
    assert batch["has_margin"] is True
    assert collate_pairs(pairs[1:], pad_id=0)["has_margin"] is False


# ---- any row either loads or raises UserError --------------------------------------------------

_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.text(max_size=8))
_junk = st.recursive(_scalar, lambda s: st.lists(s, max_size=2) |
                     st.dictionaries(st.text(max_size=3), s, max_size=2), max_leaves=4)
_text = st.one_of(st.text(min_size=1, max_size=8),
                  st.sampled_from(["", " ", "hello", "\ud800", "<|im_end|>"]))
_msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                              "content": _text})
_bad_msg = st.dictionaries(st.sampled_from(["role", "content", "x"]), _scalar, max_size=3)


def _turn(text):
    return [{"role": "assistant", "content": text}]


def _formats(text, msg):
    """Row strategies for: plain strings, whole conversations, TRL's prompt + assistant turn."""
    return [st.fixed_dictionaries({"prompt": text, "chosen": text, "rejected": text}),
            st.builds(lambda head, a, b: {"chosen": head + _turn(a), "rejected": head + _turn(b)},
                      st.lists(msg, max_size=2), text, text),
            st.builds(lambda p, a, b: {"prompt": p, "chosen": _turn(a), "rejected": _turn(b)},
                      st.lists(msg, min_size=1, max_size=2), text, text)]


# Valid rows of each format, which mutations below then break: a key deleted or set to junk.
_valid = st.one_of(_formats(_text, _msg))
_mutation = st.tuples(st.sampled_from(["prompt", "chosen", "rejected", "margin", "other"]),
                      st.one_of(st.none(), _junk, _text, st.lists(_bad_msg, max_size=2),
                                st.lists(_msg, max_size=2), st.floats()))
_row = st.builds(lambda row, muts: {**{k: v for k, v in row.items()
                                       if all(m[0] != k or m[1] is not None for m in muts)},
                                    **{k: v for k, v in muts if v is not None}},
                 _valid, st.lists(_mutation, max_size=2))
_line = st.one_of(_row.map(json.dumps), _row.map(json.dumps), _row.map(json.dumps),
                  _row.map(json.dumps), _junk.map(json.dumps), st.text(max_size=10))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_line, max_size=4), prompt_key=st.sampled_from([None, "prompt"]),
       template=st.booleans(), max_len=st.integers(3, 40))
def test_any_jsonl_loads_or_raises_user_error(tok, lines, prompt_key, template, max_len):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r.jsonl")
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write("\n".join(lines))
        try:
            rows = load_rows(path)
            pairs, _ = build_preference_pairs(rows, path, tok, prompt_key=prompt_key,
                                              apply_chat_template=template, max_len=max_len)
        except UserError:
            return
    for pair in pairs:
        for response in (pair.chosen_ids, pair.rejected_ids):
            assert response[-1] == tok.eos_token_id
            assert len(pair.prompt_ids) + len(response) <= max_len


_clean = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8).filter(
    str.strip)
_clean_msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": _clean})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.integers(0, 2), data=st.data())
def test_valid_rows_round_trip(tok, fmt, data):
    """Untruncated, prompt + response decodes to the rendered conversation (eos ends the turn)."""
    rows = data.draw(st.lists(_formats(_clean, _clean_msg)[fmt], min_size=1, max_size=3))
    prompt_key = None if fmt == 1 else "prompt"
    pairs, dropped = build_preference_pairs(rows, "d", tok, prompt_key=prompt_key,
                                            apply_chat_template=fmt > 0, max_len=10_000)
    assert len(pairs) == len(rows) and dropped == 0
    for row, pair in zip(rows, pairs):
        for key, ids in (("chosen", pair.chosen_ids), ("rejected", pair.rejected_ids)):
            assert ids[-1] == tok.eos_token_id
            text = tok.decode(pair.prompt_ids + ids)
            if fmt == 0:
                eos = "" if row[key].endswith("<|im_end|>") else "<|im_end|>"
                assert text == row["prompt"] + row[key] + eos
            else:
                conversation = row[key] if fmt == 1 else row["prompt"] + row[key]
                assert text == tok.apply_chat_template(conversation, tokenize=False).rstrip()
        max_len = data.draw(st.integers(4, 30))
        short = build_preference_pairs([row], "d", tok, prompt_key=prompt_key,
                                       apply_chat_template=fmt > 0, max_len=max_len)[0][0]
        for ids in (short.chosen_ids, short.rejected_ids):
            assert ids[-1] == tok.eos_token_id and len(short.prompt_ids) + len(ids) <= max_len


# ---- prompts -----------------------------------------------------------------------------------

def test_build_prompts(tok):
    rows = [{"prompt": "hello", "label": "world"}, {"prompt": "the cat", "label": 42},
            {"prompt": [{"role": "user", "content": "how are you"}]}]
    examples, dropped = build_prompts(rows, "p.jsonl", tok, apply_chat_template=True)
    assert dropped == 0
    assert examples[0].prompt_text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert examples[0].prompt_ids == enc(tok, examples[0].prompt_text)
    assert [e.label for e in examples] == ["world", "42", None]

    examples, _ = build_prompts(rows[:2], "p.jsonl", tok, label_key=None)
    assert examples[1].prompt_text == "the cat" and examples[1].label is None
    assert user_error(build_prompts, rows, "p.jsonl", tok).startswith(
        "p.jsonl, row 3: 'prompt' is a list of chat messages; add --apply_chat_template")
    assert "set --input_key" in user_error(build_prompts, rows, "p.jsonl", tok, input_key="q")


def test_long_prompts_dropped_and_counted(tok):
    rows = [{"prompt": "hello"}, {"prompt": "hello world how are you " * 3}, {"prompt": "cat"}]
    limit = len(enc(tok, "hello"))
    examples, dropped = build_prompts(rows, "p.jsonl", tok, prompt_max_len=limit)
    assert [e.prompt_text for e in examples] == ["hello", "cat"] and dropped == 1
    longest = len(enc(tok, rows[1]["prompt"]))
    assert user_error(build_prompts, rows[1:2], "p.jsonl", tok, prompt_max_len=limit) == (
        f"p.jsonl: all 1 prompts are longer than --prompt_max_len {limit} tokens (the longest "
        f"has {longest}); raise --prompt_max_len")


# ---- data order --------------------------------------------------------------------------------

def test_epoch_order_is_a_fixed_permutation():
    a = epoch_order(50, seed=3, epoch=1)
    assert sorted(a) == list(range(50)) and a == epoch_order(50, seed=3, epoch=1)
    assert a != epoch_order(50, seed=3, epoch=2) and a != epoch_order(50, seed=4, epoch=1)


def test_resume_equals_tail_of_fresh_iteration():
    def take(it, k):
        return [next(it) for _ in range(k)]

    fresh = take(iterate_batches(10, 3, seed=7), 12)  # 3 steps per epoch, 4 epochs
    assert [(e, s) for e, s, _ in fresh[:4]] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert all(len(idx) == 3 for _, _, idx in fresh)
    assert set(sum((idx for _, _, idx in fresh[:3]), [])) < set(range(10))  # one left out
    for k in (1, 4, 8):
        epoch, step, _ = fresh[k]
        assert take(iterate_batches(10, 3, seed=7, start_epoch=epoch, start_step=step),
                    12 - k) == fresh[k:]
    short = take(iterate_batches(10, 3, seed=7, drop_last=False), 4)
    assert [len(idx) for _, _, idx in short] == [3, 3, 3, 1]
    assert sorted(sum((idx for _, _, idx in short), [])) == list(range(10))
    assert "do not fill one batch of 4" in user_error(next, iterate_batches(3, 4, seed=0))
