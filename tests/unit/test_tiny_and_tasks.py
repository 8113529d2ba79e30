"""The built-in copy-words task and the built-in tiny model.

One build of the tiny model per session: two spawned processes race to build it into an empty cache
(the concurrency test), and every model test reuses that folder.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os

import pytest

from common.data import tasks
from common.data.tasks import (
    WORDS, copy_reward, preference_rows, pretrain_texts, prompt_rows, reward_func,
)
from common.training.tiny import TINY_VERSION, tiny_model_dir, tiny_model_path


def _words_of(user_content: str) -> tuple[str, ...]:
    assert user_content.startswith("Repeat: ")
    return tuple(user_content[len("Repeat: "):].split())


# ---------------------------------------------------------------- reward

@pytest.mark.parametrize("completion, label, want", [
    ("red cat dog", "red cat dog", 1.0),
    ("  red\ncat  dog \n", "red cat dog", 1.0),   # any whitespace splits, ends are stripped
    ("red fish dog", "red cat dog", 2 / 3),
    ("red cat dog sun", "red cat dog", 3 / 4),    # an extra word costs like a wrong one
    ("red cat", "red cat dog", 2 / 3),
    ("red", "red cat", 1 / 2),
    ("cat dog", "red cat dog", 0.0),              # positions, not bags of words
    ("", "red cat", 0.0),
    ("   \n", "red cat", 0.0),
])
def test_copy_reward(completion, label, want):
    assert copy_reward(completion, label) == pytest.approx(want)


def test_reward_func_is_batched_copy_reward():
    labels = ["red cat", "sun moon star", "dog fish"]
    completions = ["red cat", "sun moon", "fish dog"]
    got = reward_func(["p1", "p2", "p3"], completions, labels)
    assert got == [copy_reward(c, y) for c, y in zip(completions, labels)] == [1.0, 2 / 3, 0.0]
    with pytest.raises(ValueError, match="one entry per sample"):
        reward_func(["p"], ["a", "b"], ["a", "b"])


# ---------------------------------------------------------------- rows

def test_prompt_rows_format():
    rows = prompt_rows(200, "train", seed=3)
    assert len(rows) == 200
    for r in rows:
        assert set(r) == {"prompt", "label"}
        (msg,) = r["prompt"]
        assert msg["role"] == "user" and msg["content"] == f"Repeat: {r['label']}"
        words = r["label"].split()
        assert 2 <= len(words) <= 3 and all(w in WORDS for w in words)
    assert {len(r["label"].split()) for r in rows} == {2, 3}


def test_words_are_short_lowercase_ascii():
    assert 20 <= len(WORDS) == len(set(WORDS)) <= 30
    assert all(w.isascii() and w.isalpha() and w.islower() and len(w) <= 5 for w in WORDS)


def test_splits_are_disjoint_and_about_ten_percent_eval():
    train = {_words_of(r["prompt"][0]["content"]) for r in prompt_rows(3000, "train", seed=0)}
    train |= {_words_of(r["chosen"][0]["content"]) for r in preference_rows(1000, "train", seed=1)}
    train |= {_words_of(u) for u, _ in pretrain_texts(3000, seed=2)}
    evals = {_words_of(r["prompt"][0]["content"]) for r in prompt_rows(500, "eval", seed=0)}
    evals |= {_words_of(r["chosen"][0]["content"]) for r in preference_rows(300, "eval", seed=5)}
    assert len(evals) > 300 and len(train) > 3000
    assert not train & evals
    every = [t for k in (2, 3) for t in itertools.product(WORDS, repeat=k)]
    frac = sum(tasks._split_of(t) == "eval" for t in every) / len(every)
    assert 0.08 < frac < 0.12
    with pytest.raises(ValueError, match="split"):
        prompt_rows(1, "test")


def test_preference_rows_differ_in_exactly_one_word():
    rows = preference_rows(300, "train", seed=7)
    for r in rows:
        user, good = r["chosen"]
        user2, bad = r["rejected"]
        assert user == user2 and user["role"] == "user"
        assert good["role"] == bad["role"] == "assistant"
        assert good["content"].split() == list(_words_of(user["content"]))
        g, b = good["content"].split(), bad["content"].split()
        assert len(g) == len(b)
        diff = [i for i in range(len(g)) if g[i] != b[i]]
        assert len(diff) == 1 and b[diff[0]] in WORDS
        assert copy_reward(bad["content"], good["content"]) == pytest.approx(1 - 1 / len(g))
    # the swapped word lands on every position
    assert {next(i for i, (a, b) in enumerate(zip(r["chosen"][1]["content"].split(),
                                                   r["rejected"][1]["content"].split())) if a != b)
            for r in rows} == {0, 1, 2}


def test_rows_are_deterministic():
    for make in (prompt_rows, preference_rows):
        assert make(50, "train", seed=4) == make(50, "train", seed=4)
        assert make(50, "eval", seed=4) == make(50, "eval", seed=4)
        assert make(50, "train", seed=4) != make(50, "train", seed=5)
        assert make(20, "train", seed=4) == make(50, "train", seed=4)[:20]  # n only truncates
    assert pretrain_texts(50, seed=1) == pretrain_texts(50, seed=1) != pretrain_texts(50, seed=2)


def test_pretrain_texts_correct_word_rate():
    exact = pretrain_texts(300, seed=0, p_correct=1.0)
    assert all(u == f"Repeat: {a}" for u, a in exact)
    pairs = pretrain_texts(3000, seed=0, p_correct=0.4)
    hits = [a == b for u, ans in pairs for a, b in zip(_words_of(u), ans.split())]
    want = 0.4 + 0.6 / len(WORDS)  # a wrong draw from WORDS is right 1/24 of the time
    assert abs(sum(hits) / len(hits) - want) < 0.03
    assert all(len(ans.split()) == len(_words_of(u)) for u, ans in pairs)


# ---------------------------------------------------------------- tiny model

def _child_build(cache_dir: str, queue) -> None:
    queue.put(tiny_model_path(cache_dir))


@pytest.fixture(scope="module")
def raced_cache(tmp_path_factory):
    """Two spawned processes call tiny_model_path on one empty cache at once (the one build)."""
    cache = tmp_path_factory.mktemp("hybridrl-cache")
    # What a build killed mid-way leaves: must be neither published nor reused.
    debris = cache / f".tiny-{TINY_VERSION}.tmp-killed"
    debris.mkdir()
    (debris / "config.json").write_text("{half written")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child_build, args=(str(cache), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    paths = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return cache, paths, [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def tiny(raced_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_path(str(raced_cache[0]))  # already built: returns at once
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return path, model, tok


def test_default_folder_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDRL_CACHE", str(tmp_path))
    assert tiny_model_dir() == str(tmp_path / f"tiny-{TINY_VERSION}")
    monkeypatch.delenv("HYBRIDRL_CACHE")
    assert tiny_model_dir() == os.path.expanduser(f"~/.cache/hybridrl/tiny-{TINY_VERSION}")
    assert tiny_model_dir("/x/y") == f"/x/y/tiny-{TINY_VERSION}"
