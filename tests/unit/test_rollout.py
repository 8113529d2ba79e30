"""The policy's own generation (no vLLM): the static KV cache path answers as the dynamic one does."""
from __future__ import annotations

import torch


def test_static_kv_cache_generates_what_the_dynamic_cache_does():
    from common.training.models import load_causal_lm, load_tokenizer
    from common.data.prompts import build_prompts
    from common.rollout.decode import hf_generate
    from common.data.tasks import prompt_rows
    from common.training.tiny import tiny_model_path

    path = tiny_model_path()
    tok = load_tokenizer(path)
    model = load_causal_lm(path).eval()
    # prompts of several lengths in one batch: left padding differs between the two paths
    prompts = [p.prompt_ids for p in build_prompts(prompt_rows(6, "eval", seed=5), "copy task", tok,
                                                    apply_chat_template=True)[0]]
    prompts[0] = prompts[0][-5:]
    kw = dict(n=1, temperature=1.0, top_p=1.0, max_new_tokens=10, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
              micro_batch=3, greedy=True)
    dynamic = hf_generate(model, prompts, **kw)
    static = hf_generate(model, prompts, static_cache=True, **kw)
    assert static.response_ids == dynamic.response_ids
    assert static.prompt_index == dynamic.prompt_index == [0, 1, 2, 3, 4, 5]
    assert any(len(r) > 2 for r in static.response_ids)
    torch.manual_seed(0)
    sampled = hf_generate(model, prompts, static_cache=True, **dict(kw, n=2, greedy=False))
    assert len(sampled.response_ids) == 12 and all(1 <= len(r) <= 10 for r in sampled.response_ids)


def test_generation_note_points_gpu_users_at_the_fast_generation_paths():
    from common.rollout.samples import generation_note

    note = generation_note(use_gpu=True, vllm_engines=0, static_cache=False, zero_stage=2)
    assert "--static_kv_cache" in note and "--vllm_num_engines" in note
    # ZeRO-3 shards the policy, which the static cache refuses: only vLLM is suggested
    note3 = generation_note(use_gpu=True, vllm_engines=0, static_cache=False, zero_stage=3)
    assert "--static_kv_cache" not in note3 and "--vllm_num_engines" in note3
    assert generation_note(use_gpu=True, vllm_engines=1, static_cache=False, zero_stage=2) is None
    assert generation_note(use_gpu=True, vllm_engines=0, static_cache=True, zero_stage=2) is None
    assert generation_note(use_gpu=False, vllm_engines=0, static_cache=False, zero_stage=2) is None  # CPU: no compile win


def test_make_batch_equals_a_row_by_row_build():
    """make_batch builds the rows from flat lists and masks; each tensor must equal the naive
    row-by-row construction (right padding, the action mask on the response's predicting positions,
    the engine's log-probs there), including empty responses; mismatched log-probs name the sample."""
    import random

    import pytest

    from common.rollout.samples import Samples, make_batch

    rng = random.Random(0)
    responses = [[rng.randint(4, 500) for _ in range(rng.randint(0, 40))] for _ in range(33)]
    prompts = [[rng.randint(4, 500) for _ in range(rng.randint(1, 20))] for _ in range(33)]
    logprobs = [[-rng.random() for _ in r] for r in responses]
    batch = make_batch(Samples(prompts, responses, list(range(33)), [False] * 33, logprobs), pad_id=3)

    T = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids, attn = torch.full((33, T), 3), torch.zeros((33, T), dtype=torch.long)
    action, gen = torch.zeros((33, T - 1)), torch.zeros((33, T - 1))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        attn[i, :n] = 1
        action[i, len(p) - 1: n - 1] = 1
        if r:
            gen[i, len(p) - 1: n - 1] = torch.tensor(logprobs[i])
    for key, want in (("input_ids", ids), ("attention_mask", attn), ("action_mask", action), ("gen_logprobs", gen)):
        assert batch[key].dtype == want.dtype and torch.equal(batch[key], want), key
    assert "gen_logprobs" not in make_batch(Samples(prompts, responses, list(range(33)), [False] * 33), pad_id=3)

    i = next(i for i, r in enumerate(responses) if r)
    logprobs[i] = logprobs[i][:-1]
    with pytest.raises(ValueError, match=f"sample {i}: {len(responses[i]) - 1} log-probs for {len(responses[i])} response"):
        make_batch(Samples(prompts, responses, list(range(33)), [False] * 33, logprobs), pad_id=3)


def test_decode_attention_equals_sdpa_with_repeated_kv_heads():
    """One query per row against a left-padded cache: grouped matmuls = transformers' SDPA path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from common.rollout.decode import _decode_attention

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal, training = 4, True, False

    g = torch.Generator().manual_seed(0)
    b, kv, h, L, d = 3, 2, 8, 11, 32
    q = torch.randn(b, h, 1, d, generator=g)
    k, v = torch.randn(b, kv, L, d, generator=g), torch.randn(b, kv, L, d, generator=g)
    mask = torch.ones(b, 1, 1, L, dtype=torch.bool)
    mask[0, ..., :4] = False                  # row 0: four left-pad positions
    mask[2, ..., -1] = False                  # row 2: a future position
    ours, _ = _decode_attention(Layer(), q, k, v, mask, scaling=d ** -0.5)
    ref, _ = sdpa_attention_forward(Layer(), q, k, v, mask, scaling=d ** -0.5)
    assert ours.shape == ref.shape == (b, 1, h, d)
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_sampled_tokens_follow_the_tempered_nucleus():
    """argmax(p / Exp(1)) draws token i with probability p_i: frequencies over 40k rows against the
    softmax at temperature 0.7, and with top_p 0.8 only the nucleus, renormalized."""
    from common.rollout.decode import sample_tokens

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = 40_000
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(logits / 0.7, -1)
    freq = torch.bincount(sample_tokens(logits.expand(rows, 5), 0.7, 1.0, g), minlength=5) / rows
    assert torch.allclose(freq, p, atol=0.01), (freq, p)
    # nucleus: the smallest top set whose mass reaches 0.8
    keep = (torch.cumsum(p, 0) - p) < 0.8
    q = torch.where(keep, p, torch.zeros(())) / p[keep].sum()
    freq = torch.bincount(sample_tokens(logits.expand(rows, 5), 0.7, 0.8, g), minlength=5) / rows
    assert keep.sum() < 5 and torch.allclose(freq, q, atol=0.01), (freq, q)


def test_static_decoding_marks_truncated_rows_and_stops_at_eos():
    from common.training.models import load_causal_lm
    from common.rollout.decode import hf_generate
    from common.training.tiny import tiny_model_path

    model = load_causal_lm(tiny_model_path()).eval()
    rows = [[1, 5, 6, 7], [1, 8, 9]]

    def decode(eos_id):
        s = hf_generate(model, rows, n=1, temperature=1.0, top_p=1.0, max_new_tokens=6, eos_id=eos_id, pad_id=3,
                        micro_batch=2, greedy=True, static_cache=True)
        return s.response_ids, s.truncated

    full, trunc = decode(-1)
    assert [len(r) for r in full] == [6, 6] and trunc == [True, True]
    # the greedy tokens are the full forward's argmax over each row's own prefix (no padding there)
    with torch.no_grad():
        for r, resp in zip(rows, full):
            logits = model(torch.tensor([r + resp])).logits[0, len(r) - 1:-1]
            assert logits.argmax(-1).tolist() == resp
    # with one of row 0's tokens as the stop token, each row ends at its first occurrence (or runs on)
    eos = full[0][-1]
    out, trunc = decode(eos)
    want = [f[: f.index(eos) + 1] if eos in f else f for f in full]
    assert out == want and trunc == [eos not in f for f in full] and trunc[0] is False


def test_positions_note_counts_the_longest_prompt_not_the_flag(tmp_path):
    """--generate_max_len past the model's positions cut 26% of responses silently (#22): warned in the
    banner from the actual longest prompt, so the default task on a 512-position model is not warned."""
    import json

    from common.rollout.samples import positions_note

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert positions_note(str(tmp_path), 20, 492) is None
    note = positions_note(str(tmp_path), 20, 1024)
    assert "longest prompt (20 tokens) + --generate_max_len 1024 exceeds the model's 512 positions" in note
    assert positions_note(str(tmp_path / "missing"), 20, 1024) is None  # a hub id: nothing to read, no warning
