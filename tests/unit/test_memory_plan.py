"""The memory plan (common/cluster/memory_plan.py) on CPU: its byte counts against real DeepSpeed engines, the
refusal of a layout that cannot fit with the flags that would make it fit, and the dry run's table."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from common.algo import HEAD_CHUNK
from common.cluster import gpu_memory
from common.cluster import memory_plan as mp
from common.errors import UserError
from common.cluster.resources import plan_resources
from tests.helpers import ROOT

GiB = 2**30


# Llama-3-8B's shape (bench/make_model.py's, where it has one)
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)


def _shape_dir(tmp_path, name: str, cfg: dict) -> str:
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from make_model import SHAPES  # noqa: PLC0415
    finally:
        sys.path.pop(0)
    cfg = {**cfg, **SHAPES.get(name, {})}
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16", **cfg}))
    return str(path)


def _grpo(pretrain: str, **kw) -> dict:
    a = dict(pretrain=pretrain, reward_pretrain=None, bf16=True, torch_autocast=False, zero_stage=2, adam_offload=False,
             gradient_checkpointing=False, flash_attn=False, packing_samples=False, n_samples_per_prompt=8,
             prompt_max_len=1024, generate_max_len=1024, micro_train_batch_size=4, micro_rollout_batch_size=16,
             rollout_batch_size=16, deepspeed_enable_sleep=False, ref_reward_offload=False,
             vllm_gpu_memory_utilization=0.5, vllm_enable_sleep=False, vllm_sync_bucket_mb=256)
    a.update(kw)
    return a


def _plan(gpus: int = 1, engines: int = 1):
    return plan_resources(actor=(1, gpus), critic=None, ref=(1, gpus), reward=None, vllm_num_engines=engines, vllm_tp=1,
                          colocate_actor_ref=False, colocate_critic_reward=False, colocate_all_models=True, use_gpu=True)


def test_a_layout_that_cannot_fit_is_refused_with_the_flags_that_would(tmp_path):
    """8B GRPO with every role and vLLM on one 80 GiB GPU: refused, naming the fixes most saving first."""
    path = _shape_dir(tmp_path, "8b", LLAMA_8B)
    plan = mp.from_options(_grpo(path), "grpo", _plan(), gpu_bytes=80 * GiB)
    assert plan.job.models[0].shape.params == pytest.approx(8.03e9, rel=0.01)
    with pytest.raises(UserError) as e:
        mp.check_memory(plan)
    msg = str(e.value)
    for flag in ("--adam_offload", "--gradient_checkpointing", "--deepspeed_enable_sleep --vllm_enable_sleep",
                 "--vllm_gpu_memory_utilization", "--actor_num_gpus_per_node 2"):
        assert flag in msg, msg
    saved = [float(x) for x in re.findall(r"\(-([\d.]+) GiB", msg)]
    assert saved == sorted(saved, reverse=True) and len(saved) >= 5, msg
    assert "--zero_stage 3 (3x slower on one GPU)" in msg  # nothing to shard, but the master steps in sub-groups
    # the same 8B with OpenRLHF's hybrid-engine flags and ZeRO-3 over 8 GPUs fits
    fits = _grpo(path, zero_stage=3, gradient_checkpointing=True, deepspeed_enable_sleep=True, vllm_enable_sleep=True,
                 micro_train_batch_size=1, micro_rollout_batch_size=4)
    mp.check_memory(mp.from_options(fits, "grpo", _plan(8, 8), gpu_bytes=80 * GiB))
    # DPO at 8B on one GPU: the policy's states alone are 16 bytes per parameter
    dpo = dict(pretrain=path, bf16=True, zero_stage=2, adam_offload=False, gradient_checkpointing=True,
               micro_train_batch_size=1, max_len=2048, ref_offload=False)
    with pytest.raises(UserError, match=r"--adam_offload \(-[\d.]+ GiB, fits\)"):
        mp.check_memory(mp.from_options(dpo, "dpo", gpu_bytes=80 * GiB))


def test_phases_sleep_and_metrics(tmp_path):
    """The hybrid engine's sleep frees the actor for vLLM's generate; `mem/` keys pair measured and predicted."""
    path = _shape_dir(tmp_path, "8b", LLAMA_8B)
    awake = mp.from_options(_grpo(path, zero_stage=3), "grpo", _plan(8, 8), gpu_bytes=140 * GiB)
    asleep = mp.from_options(_grpo(path, zero_stage=3, deepspeed_enable_sleep=True, vllm_enable_sleep=True),
                             "grpo", _plan(8, 8), gpu_bytes=140 * GiB)
    actor = {p.process: p for p in asleep.processes}["actor"]
    # asleep, the actor keeps only its shard of the bf16 weights on the GPU (OpenRLHF's sleep set), beside the
    # reference's shard: colocated, the reference lives in the actor's processes (common.rl.guests)
    shard = 2 * mp.read_shape(path).params // 8
    assert "ref" not in {p.process for p in asleep.processes}
    assert actor.allocated["generate"] == 2 * shard and actor.phases["generate"] < 6 * GiB < actor.phases["train"]
    assert {p.process: p for p in asleep.processes}["vllm"].phases["train"] < 3 * GiB
    assert asleep.worst() < awake.worst()
    row = mp.rows(asleep)[-1]
    assert row["process"] == "= one GPU" and "fits" in row["at its peak (GiB)"]
    keys = gpu_memory.mem_metrics("actor", {"peak_gb": 1.0, "peak_reserved_gb": 1.5}, asleep, seq=256)
    assert set(keys) == {"mem/actor_peak_gb", "mem/actor_peak_reserved_gb", "mem/actor_predicted_gb",
                         "mem/actor_predicted_reserved_gb", "mem/actor_predicted_device_gb"}
    assert keys["mem/actor_predicted_gb"] < actor.allocated_peak / GiB  # redone for the shorter sequences
    # the device's share adds the context to the allocator's hold; vLLM's is its fraction of the GPU
    assert keys["mem/actor_predicted_device_gb"] - keys["mem/actor_predicted_reserved_gb"] == pytest.approx(0.75)
    engine = gpu_memory.mem_metrics("vllm", {"device_peak_gb": 40.0}, asleep)
    assert engine["mem/vllm_predicted_device_gb"] == pytest.approx(0.5 * 140, rel=1e-6)
    assert engine["mem/vllm_device_peak_gb"] == 40.0


def test_a_hub_id_is_planned_only_from_the_cache():
    """No download for a plan: a hub id not in the local cache gets a note, never a refusal."""
    plan = mp.from_options(_grpo("no-such-org/not-cached-model"), "grpo", _plan(), gpu_bytes=80 * GiB)
    assert plan.job is None and "local folder" in plan.note
    mp.check_memory(plan)


def test_too_little_for_vllm_is_refused(tmp_path):
    path = _shape_dir(tmp_path, "8b", LLAMA_8B)
    with pytest.raises(UserError, match=r"--vllm_gpu_memory_utilization 0.1 gives each vLLM worker 8.0 GiB, less than its"):
        mp.check_memory(mp.from_options(_grpo(path, vllm_gpu_memory_utilization=0.1), "grpo", _plan(8, 8), gpu_bytes=80 * GiB))


def test_the_gpu_a_vllm_engine_of_its_own_needs_holds_its_weights_and_a_kv_cache(tmp_path):
    """No GPU visible (a dry run): an engine on GPUs of its own has no bytes in the plan, only its share of the
    GPU, and the table said 'needs a GPU of 0.0 GiB'. The GPU it names is the smallest whose share holds the
    weights and a KV cache: check_memory takes one 0.1 GiB larger and refuses one 0.5 GiB smaller."""
    path = _shape_dir(tmp_path, "8b", LLAMA_8B)
    a = _grpo(path)
    apart = plan_resources(actor=(1, 1), critic=None, ref=(1, 1), reward=None, vllm_num_engines=1, vllm_tp=1,
                           colocate_actor_ref=False, colocate_critic_reward=False, colocate_all_models=False, use_gpu=True)
    (row,) = [r for r in mp.rows(mp.from_options(a, "grpo", apart))
              if r["GPUs"] == "1 x vllm" and r["process"] == "= one GPU"]
    m = re.fullmatch(r"peak at generate, needs a GPU of ([\d.]+) GiB or more "
                     r"\(0\.5 of it for vLLM's weights and KV cache\)", row["at its peak (GiB)"])
    assert m, row
    need = float(m.group(1))
    assert 30 < need < 36  # Llama-3-8B's 15 GiB of bf16 weights and 2 GiB of cache in half of the GPU

    def refusal(gib: float) -> str:
        try:
            mp.check_memory(mp.from_options(a, "grpo", apart, gpu_bytes=int(gib * GiB)))
        except UserError as e:
            return str(e)
        return ""

    assert "vLLM worker" not in refusal(need + 0.1)  # the actor may not fit there: that is another row's figure
    assert "--vllm_gpu_memory_utilization 0.5 gives each vLLM worker" in refusal(need - 0.5)


def test_partial_adam_offload_keeps_the_gpu_share_of_the_optimizer(tmp_path):
    """--adam_offload_ratio: ZeRO-3's partial offload in DeepSpeed's config and in the plan, which keeps
    the GPU's sub-groups (master, moments, fp32 gradients) there through DeepSpeed's sleep too."""
    from common.training import ds

    path = _shape_dir(tmp_path, "7b", {})
    flags = dict(zero_stage=3, adam_offload=True, deepspeed_enable_sleep=True, vllm_enable_sleep=True)
    full = {p.process: p for p in mp.from_options(_grpo(path, **flags), "grpo", _plan(), gpu_bytes=140 * GiB).processes}
    half = {p.process: p for p in mp.from_options(_grpo(path, **flags, adam_offload_ratio=0.5), "grpo", _plan(),
                                                  gpu_bytes=140 * GiB).processes}
    n = mp.read_shape(path).params
    assert half["actor"].breakdown["moments"] == pytest.approx(0.5 * 8 * n, rel=0.01)
    assert half["actor"].allocated["generate"] >= 0.5 * 16 * n > full["actor"].allocated["generate"]
    cfg = ds.train_config(ds.DSSettings(zero_stage=3, adam_offload=True, adam_offload_ratio=0.5), 1, torch_float32())
    assert cfg["zero_optimization"]["offload_optimizer"]["ratio"] == 0.5
    cfg = ds.train_config(ds.DSSettings(zero_stage=3, adam_offload=True), 1, torch_float32())
    assert "ratio" not in cfg["zero_optimization"]["offload_optimizer"]


def test_expandable_segments_only_where_asked_and_on_a_gpu(monkeypatch):
    from common.training import ds

    calls = []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.memory._set_allocator_settings", calls.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("HYBRIDRL_EXPANDABLE_SEGMENTS", raising=False)
    assert ds.use_expandable_segments() == "expandable_segments:True" and calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's setting wins
    assert ds.use_expandable_segments() is None
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("HYBRIDRL_EXPANDABLE_SEGMENTS", "0")
    assert ds.use_expandable_segments() is None and len(calls) == 1


def torch_float32():
    import torch

    return torch.float32


def test_with_no_gpu_visible_the_needed_gpu_is_the_largest_over_phases():
    """A colocated engine takes a share of the GPU while generating and little at the weight sync: the
    dry run's 'needs a GPU of' is the largest bytes / (1 - share) over the phases (the reference GRPO
    command on 8B: 73.7 GiB at sync, where a guessed 100 GiB GPU had named 56.6 at generate)."""
    from common.cluster.memory_estimate import GiB, MemoryPlan, ProcessMemory

    phases = {"generate": int(28.3 * GiB), "sync": int(73.7 * GiB)}
    proc = ProcessMemory("g", "actor", 8, phases, dict(phases), {}, gpu_fraction={"generate": 0.5})
    job = type("J", (), {"phases": ("generate", "sync")})()
    phase, need, frac = MemoryPlan([proc], gpu_bytes=None, job=job).group_peak("g")
    assert (phase, frac) == ("sync", 0.0) and need == phases["sync"]
    # a known GPU: where the bytes peak (28.3 + 100 > 73.7)
    assert MemoryPlan([proc], gpu_bytes=200 * GiB, job=job).group_peak("g")[0] == "generate"


def test_the_plan_counts_a_chunk_of_logits_only_where_the_workers_make_them_in_chunks(tmp_path):
    """The RL workers on a GPU make the head's logits 2048 positions at a time (common.algo.logprobs.chunked_head)
    for Qwen2/3, Llama, Mistral under ZeRO 0-2; a model type that soft-caps its logits after the head
    (Gemma 2) or ZeRO-3 keeps them whole, and the plan must count those whole: 64 rows x 290 tokens of
    Qwen2.5-0.5B's 152k vocabulary in bf16, twice in training, against a chunk's."""
    cfg = dict(vocab_size=151936, tie_word_embeddings=True)
    flags = dict(micro_train_batch_size=64, micro_rollout_batch_size=64, rollout_batch_size=8,
                 prompt_max_len=34, generate_max_len=256)

    from common.cluster.memory_estimate import _tokens

    def logits(kind: str, **kw):
        folder = tmp_path / f"{kind}{len(kw)}"
        folder.mkdir()
        path = _shape_dir(folder, "0.5b", {**cfg, "model_type": kind})
        plan = mp.from_options(_grpo(path, **flags, **kw), "grpo", _plan(), gpu_bytes=140 * GiB)
        return plan.job.head_chunk, _tokens(plan.job.models[0], plan.job, 64, True)["logits"]

    whole = 2 * 64 * 290 * 151936 * 2
    chunk, qwen = logits("qwen2")
    assert chunk == HEAD_CHUNK and qwen == 2 * 2048 * 151936 * 2 + 151936 * 896 * 6 < whole / 2
    assert logits("gemma2") == (0, whole)
    assert logits("qwen2", zero_stage=3) == (0, whole)


def test_sleep_moves_openrlhfs_states_and_all_with_adam_offload():
    """--deepspeed_enable_sleep sends what OpenRLHF's does (moments, master, gradients, reduce buckets; the bf16
    weights stay); with --adam_offload, where OpenRLHF does not sleep, everything DeepSpeed keeps on the GPU."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    from common.training.ds_sleep import sleep_states

    assert set(sleep_states(False)) == {S.optim_states, S.contiguous_grad_buffer, S.hp_params, S.lp_grads}
    assert sleep_states(True) is None
