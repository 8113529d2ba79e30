"""The built-in copy-words task and the built-in tiny model.

One build of the tiny model per session: two spawned processes race to build it into an empty cache
(the concurrency test), and every model test reuses that folder.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from common.data.tasks import (
    WORDS, preference_rows, prompt_rows,
)
from common.training.tiny import TINY_VERSION, sample_copy_reward, tiny_model_dir, tiny_model_path


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


def test_concurrent_build_publishes_one_folder(raced_cache):
    cache, paths, exitcodes = raced_cache
    assert exitcodes == [0, 0]
    assert paths[0] == paths[1] == tiny_model_dir(str(cache)) == str(cache / f"tiny-{TINY_VERSION}")
    # Only the published folder and its lock remain: the debris and the loser's nothing are gone.
    assert sorted(os.listdir(cache)) == [f"tiny-{TINY_VERSION}", f"tiny-{TINY_VERSION}.lock"]
    files = set(os.listdir(paths[0]))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(paths[0])


def test_shape_and_special_tokens(tiny):
    path, model, tok = tiny
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.vocab_size == len(tok) == 512
    assert cfg.hidden_size // cfg.num_attention_heads >= 32  # vLLM CPU attention needs >= 32
    assert not cfg.tie_word_embeddings
    specials = (tok.bos_token, tok.eos_token, tok.pad_token)
    assert specials == ("<|endoftext|>", "<|im_end|>", "<|pad|>")
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (
        tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    for w in WORDS:  # the task's words are cheap: at the start of a message and after a space
        assert len(tok.encode(w, add_special_tokens=False)) <= 2
        assert len(tok.encode(" " + w, add_special_tokens=False)) <= 2


def test_auto_tokenizer_matches_tokenizer_json(tiny):
    """AutoTokenizer rebuilds qwen2 tokenizers from vocab + merges: it must match tokenizer.json."""
    from transformers import PreTrainedTokenizerFast

    path, _, tok = tiny
    raw = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
    texts = [tok.apply_chat_template(r["chosen"], tokenize=False)
             for r in preference_rows(100, "eval", seed=0)]
    texts += ["Hello, World! 42\n\n  tabs\tand ünïcödé", "<|im_start|>user\nRepeat: x<|im_end|>"]
    for t in texts:
        assert tok.encode(t, add_special_tokens=False) == raw.encode(t, add_special_tokens=False)
        assert tok.decode(tok.encode(t, add_special_tokens=False)) == t


def test_chat_template_renders(tiny):
    _, _, tok = tiny
    msgs = [{"role": "user", "content": "Repeat: red cat"},
            {"role": "assistant", "content": "red cat"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>user\nRepeat: red cat<|im_end|>\n<|im_start|>assistant\nred cat<|im_end|>\n")
    assert tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nRepeat: red cat<|im_end|>\n<|im_start|>assistant\n")


def test_reload_gives_identical_logits(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    text = tok.apply_chat_template(preference_rows(1, "eval")[0]["chosen"], tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]  # [1, T]
    assert ids[0].tolist() == tok2.encode(text, add_special_tokens=False)
    with torch.no_grad():
        a, b = model(ids).logits, model2(ids).logits  # [1, T, 512]
    assert a.shape == (1, ids.shape[1], 512)
    assert torch.equal(a, b)


def test_greedy_generation_stops_at_im_end(tiny):
    import torch

    _, model, tok = tiny
    row = prompt_rows(1, "eval", seed=11)[0]
    prompt = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=16)
    new = out[0, ids.shape[1]:].tolist()
    assert tok.eos_token_id in new and len(new) < 16
    assert new.index(tok.eos_token_id) == len(new) - 1  # generation_config's eos stopped it
    answer = tok.decode(new, skip_special_tokens=True)
    assert len(answer.split()) == len(row["label"].split())


def test_base_model_copies_weakly(tiny):
    """Sampled at temperature 1 the base model has the format but copies only some words."""
    _, model, tok = tiny
    mean, ended = sample_copy_reward(model, tok, prompt_rows(64, "eval", seed=0), seed=0)
    assert ended > 0.9
    assert 0.15 < mean < 0.8
