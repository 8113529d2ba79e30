"""RoPE's inverse frequencies stay fp32 in bf16 models (common.training.models.rope_in_fp32): ZeRO-3's zero.Init and a
frozen model's `.to(bfloat16)` round them, which doubled the trainer-vs-vLLM log-prob gap at 3B."""
from __future__ import annotations

import torch

from common.training import ds
from common.training.models import load_causal_lm, rope_in_fp32
from common.training.tiny import tiny_model_path


def test_rope_buffers_come_back_in_fp32():
    model = load_causal_lm(tiny_model_path(), dtype=torch.bfloat16)
    rot = model.model.rotary_emb
    exact = rot.inv_freq.clone()
    assert exact.dtype == torch.float32 and exact[1] != exact[1].bfloat16().float()  # bf16 cannot hold them
    model.to(torch.bfloat16)  # what zero.Init and a frozen model's cast do to the buffers
    assert rot.inv_freq.dtype == torch.bfloat16
    assert rope_in_fp32(model) == 1
    assert rot.inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq, exact)
    assert torch.equal(rot.original_inv_freq, exact) and rope_in_fp32(model) == 0
    assert next(model.parameters()).dtype == torch.bfloat16  # the weights are left alone


def test_a_frozen_bf16_model_keeps_fp32_rope():
    model = load_causal_lm(tiny_model_path(), dtype=torch.float32)
    frozen = ds.initialize_eval(model, ds.DSSettings(zero_stage=2, bf16=True), torch.bfloat16, torch.device("cpu"))
    assert frozen.model.rotary_emb.inv_freq.dtype == torch.float32
    assert next(frozen.parameters()).dtype == torch.bfloat16
