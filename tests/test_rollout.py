"""The policy's own generation (no vLLM): the static KV cache path answers as the dynamic one does."""
from __future__ import annotations

import torch


def test_static_kv_cache_generates_what_the_dynamic_cache_does():
    from common.models import load_causal_lm, load_tokenizer
    from common.prompts import build_prompts
    from common.rollout import hf_generate
    from common.tasks import prompt_rows
    from common.tiny import tiny_model_path

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
    from common.rollout import generation_note

    note = generation_note(use_gpu=True, vllm_engines=0, static_cache=False, zero_stage=2)
    assert "--static_kv_cache" in note and "--vllm_num_engines" in note
    # ZeRO-3 shards the policy, which the static cache refuses: only vLLM is suggested
    note3 = generation_note(use_gpu=True, vllm_engines=0, static_cache=False, zero_stage=3)
    assert "--static_kv_cache" not in note3 and "--vllm_num_engines" in note3
    assert generation_note(use_gpu=True, vllm_engines=1, static_cache=False, zero_stage=2) is None
    assert generation_note(use_gpu=True, vllm_engines=0, static_cache=True, zero_stage=2) is None
    assert generation_note(use_gpu=False, vllm_engines=0, static_cache=False, zero_stage=2) is None  # CPU: no compile win
