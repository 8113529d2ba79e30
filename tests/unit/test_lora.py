"""LoRA and QLoRA (common/training/lora.py) on the built-in tiny model, in this process: the reference by
disabled adapter against a separately loaded frozen copy, the value head through save, load and merge,
the adapter-only state, the flags' parsing and refusals, and the memory plan without a reference or base
optimizer state."""
from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from common.errors import UserError
from common.training import lora as L
from common.training.tiny import tiny_model_path


def _randomised(model, seed: int = 0):
    """Fresh adapters start as the identity (lora_B = 0): give B and a trained head some values."""
    g = torch.Generator().manual_seed(seed)
    for n, p in model.named_parameters():
        if "lora_B" in n or "modules_to_save" in n:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # one right-padded row
    return ids, mask


def test_reference_by_disabled_adapter_equals_a_frozen_copy(batch):
    from transformers import AutoModelForCausalLM

    from common.algo.packing import next_token_logprobs

    path = tiny_model_path()
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    note = L.apply_lora(policy, L.LoraSettings(rank=8, alpha=16))
    _randomised(policy)
    frozen = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, mask = batch
    with torch.no_grad():
        with L.adapter_disabled(policy):
            off = next_token_logprobs(policy, ids, mask, packing=False)
        on = next_token_logprobs(policy, ids, mask, packing=False)
        ref = next_token_logprobs(frozen, ids, mask, packing=False)
    assert torch.allclose(off, ref, atol=1e-6, rtol=0), (off - ref).abs().max()
    assert (on - ref).abs().max() > 1e-2  # the adapter is on again after the block, and it changes the policy
    # only the adapter trains, and the note says how much of the model that is
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert "LoRA rank 8" in note and f"{sum(p.numel() for p in policy.parameters() if p.requires_grad):,}" in note


def test_reward_model_head_trains_and_round_trips_through_save_load_and_merge(tmp_path, batch):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from common.training.models import load_reward_model, reward_scores

    path = tiny_model_path()
    torch.manual_seed(0)
    rm = load_reward_model(path)  # an LM folder: a new head
    L.apply_lora(rm, L.LoraSettings(rank=4, target_modules=("q_proj", "v_proj")), head="score")
    assert rm.score.modules_to_save["default"].weight.requires_grad  # the head trains in full, not frozen
    _randomised(rm, seed=2)
    ids, mask = batch
    with torch.no_grad():
        before = reward_scores(rm, ids, mask)
    state = L.adapter_state(rm)
    assert any(k.endswith("score.weight") for k in state), list(state)
    assert all("lora_" in k or "score" in k for k in state)
    out = str(tmp_path / "rm")
    L.save_adapter(rm, None, out, rank=0)
    cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    assert cfg["base_model_name_or_path"] == path and cfg["r"] == 4
    # peft's own loader, unmerged
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, out)
    with torch.no_grad():
        unmerged = reward_scores(peft.base_model.model, ids, mask)
        loaded = reward_scores(load_reward_model(out), ids, mask)  # ours: base + adapter merged
    assert torch.allclose(unmerged, before, atol=1e-5), (unmerged, before)
    assert torch.allclose(loaded, before, atol=1e-5), (loaded, before)
    merged = L.merge(out, str(tmp_path / "merged"), is_rm=True)
    plain = AutoModelForSequenceClassification.from_pretrained(merged, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(reward_scores(plain, ids, mask), before, atol=1e-5)
    assert not any("lora" in k for k in plain.state_dict())


def test_a_bad_target_module_names_those_that_exist():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
    with pytest.raises(UserError) as e:
        L.apply_lora(model, L.LoraSettings(rank=8, target_modules=("q_proj", "qkv_proj")))
    msg = str(e.value)
    assert msg.startswith("--target_modules qkv_proj: no such layer") and "q_proj" in msg.split("layers are")[1]
    assert "gate_proj" in msg and "all-linear" in msg


def test_4bit_is_refused_where_bitsandbytes_cannot_run():
    with pytest.raises(UserError, match="CUDA GPUs only"):
        L.quantization(L.LoraSettings(rank=8, load_in_4bit=True), torch.device("cpu"))
    assert L.quantization(L.LoraSettings(rank=8), torch.device("cpu")) == {}


@pytest.mark.parametrize("script", ["train_sft", "train_rm", "train_dpo", "train_ppo", "train_grpo"])
def test_openrlhf_lora_flags_parse_and_shape_flags_need_a_rank(script, tmp_path, monkeypatch):
    import importlib

    module = importlib.import_module(script)
    got = {}
    monkeypatch.setattr(module, "train", lambda a, *rest: got.update(a=a))
    args = ["--lora_rank", "8", "--lora_alpha", "32", "--target_modules", "q_proj", "v_proj", "--lora_dropout", "0.05",
            "--save_path", str(tmp_path / "a")]
    r = CliRunner().invoke(module.app, args)
    assert r.exit_code == 0, r.output
    s = L.LoraSettings.from_options(got["a"])
    assert s == L.LoraSettings(rank=8, alpha=32, target_modules=("q_proj", "v_proj"), dropout=0.05)
    for flags in (["--load_in_4bit"], ["--target_modules", "q_proj"], ["--lora_alpha", "32"]):
        r = CliRunner().invoke(module.app, [*flags, "--save_path", str(tmp_path / "b")])
        assert r.exit_code == 2 and f"{flags[0]} shapes a LoRA adapter" in r.output and "--lora_rank" in r.output, r.output


def test_memory_plan_has_no_reference_and_no_base_optimizer_state(tmp_path):
    from common.cluster import memory_plan as mp
    from common.cluster.memory_estimate import adapter_params, read_shape

    path = tiny_model_path()
    a = dict(pretrain=path, zero_stage=2, bf16=True, adam_offload=False, gradient_checkpointing=False,
             micro_train_batch_size=2, max_len=64)
    full = mp.from_options(a, "dpo")
    lora = mp.from_options(dict(a, lora_rank=8), "dpo")
    assert [m.role for m in full.job.models] == ["policy", "reference"]
    assert [m.role for m in lora.job.models] == ["policy"]
    shape = read_shape(path)
    n = adapter_params(shape, 8)
    assert n == shape.layers * 8 * (7 * shape.hidden + 2 * shape.q_dim + 2 * shape.kv_dim + 3 * shape.inter)
    (p_full,), (p_lora,) = full.processes, lora.processes
    assert p_lora.breakdown["moments"] == 8 * n  # Adam's two fp32 moments of the adapter alone
    assert p_full.breakdown["moments"] == 8 * shape.params
    assert p_lora.allocated_peak < p_full.allocated_peak
