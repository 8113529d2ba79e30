"""The memory plan (common/cluster/memory_plan.py) on CPU: its byte counts against real DeepSpeed engines, the
refusal of a layout that cannot fit with the flags that would make it fit, and the dry run's table."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from common.cluster import memory_plan as mp
from common.cluster.resources import plan_resources
from tests.helpers import PY, ROOT, env

GiB = 2**30

# Each rank's bytes of module parameters (ZeRO-3: its shards), of the fp32 master tensors the optimizer
# steps (those not sharing the parameters' storage) and of their Adam moments, after one step.
COUNT = r"""
import json, sys, torch
from common.training import ds
from common.training.models import load_causal_lm
from common.training.tiny import tiny_model_path

dist = ds.setup_distributed()
out = open(f"{sys.argv[1]}/rank{dist.rank}.jsonl", "w")  # ranks' prints would interleave on one stdout
ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))

def nbytes(tensors):
    seen = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()): t.numel() * t.element_size() for t in tensors}
    return sum(seen.values()), {k[0] for k in seen}

for mode in ("bf16", "fp32"):
    for stage in (0, 1, 2, 3):
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        s = ds.DSSettings(zero_stage=stage, bf16=mode == "bf16", micro_train_batch_size=1, train_batch_size=dist.world_size)
        keep = ds.zero3_loading(ds.train_config(s, dist.world_size, dtype))
        model = load_causal_lm(tiny_model_path(), dtype=torch.float32, attn_impl="sdpa")
        numel = sum(p.numel() for p in model.parameters()) if stage != 3 else None
        e = ds.initialize(model, s, dist, dtype, lr=1e-3, total_steps=2)
        e.backward(e(input_ids=ids[dist.rank:dist.rank + 1]).logits.float().logsumexp(-1).mean())
        e.step()
        weights, ptrs = nbytes([getattr(p, "ds_tensor", p).data for p in e.module.parameters()])
        inner = getattr(e.optimizer, "optimizer", e.optimizer)
        # ZeRO-3 empties the inner optimizer's groups after each step: its flat fp32 partitions are what it steps
        stepped = getattr(e.optimizer, "fp32_partitioned_groups_flat", None) or [p for g in inner.param_groups for p in g["params"]]
        master = nbytes([p.data for p in stepped if p.untyped_storage().data_ptr() not in ptrs])[0]
        moments = nbytes([st[k] for p in stepped for st in [inner.state.get(p, {})] for k in ("exp_avg", "exp_avg_sq") if k in st])[0]
        print(json.dumps({"mode": mode, "stage": stage, "rank": dist.rank, "numel": numel, "weights": weights,
                          "master": master, "moments": moments}), file=out, flush=True)
        del e, keep
"""


@pytest.mark.parametrize("world", [1, 2])
def test_states_match_deepspeed_engines(tmp_path, world):
    """Weights, fp32 master and Adam moments per rank, for ZeRO 0-3 with bf16 weights (DeepSpeed's bf16
    optimizer) and fp32 weights (also what --torch_autocast trains), within 15% of the plan's."""
    code = tmp_path / "count.py"
    code.write_text(COUNT)
    launch = [PY] if world == 1 else [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                      "--master_addr", "127.0.0.1", "--master_port", "29563"]
    p = subprocess.run([*launch, str(code), str(tmp_path)], cwd=ROOT, env=env() | {"PYTHONPATH": ROOT}, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for r in range(world) for line in open(tmp_path / f"rank{r}.jsonl")]
    assert len(rows) == 8 * world, rows
    shape = mp.read_shape(None)
    for r in rows:
        if r["numel"] is not None:
            assert shape.params == r["numel"]  # the count from config.json is exact
        m = mp.Model("actor", shape, True, True, world, "g", "actor")
        job = mp.Job((m,), zero_stage=r["stage"], bf16=r["mode"] == "bf16", autocast=False, adam_offload=False,
                     checkpointing=False, seq=16, train_rows=1, infer_rows=1, step_rows=world)
        want = mp.training_states(m, job)
        for k in ("weights", "master", "moments"):
            assert r[k] == pytest.approx(want[k], rel=0.15, abs=1024), (r, k, want[k])
    # with bf16 weights, ZeRO-1 on two ranks halves master and moments; ZeRO-3 also the weights
    if world == 2:
        by = {(r["mode"], r["stage"]): r for r in rows if r["rank"] == 0}
        assert by["bf16", 1]["moments"] * 2 == pytest.approx(by["bf16", 0]["moments"], rel=0.02)
        assert by["bf16", 3]["weights"] * 2 == pytest.approx(by["bf16", 2]["weights"], rel=0.02)


def test_dry_run_prints_the_memory_table_without_torch():
    code = ("import runpy, sys; sys.argv = ['train_grpo.py', '--dry_run', '--bf16', '--vllm_num_engines', '1', "
            "'--colocate_all_models']\ntry:\n    runpy.run_path('train_grpo.py', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\nprint('torch imported:', 'torch' in sys.modules)")
    t0 = time.perf_counter()
    p = subprocess.run([PY, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert time.perf_counter() - t0 < 15  # ~0.5 s on a quiet machine: no model, no torch
    out = p.stdout
    assert "memory plan" in out and "resource plan" in out, out
    assert re.search(r"actor\s+[\d.]+", out) and "vllm" in out and "x GPU" in out, out
    assert "torch imported: False" in out, out


def test_the_seed_ppo_command_off_line_says_how_to_plan_and_which_flag_fits_80_gb(tmp_path):
    """The seed's 8B PPO command with --dry_run on a machine with neither the models nor a GPU: the hub ids
    get the command that writes a config of their sizes (run here as printed, so its flag is spelt as the
    script takes it); with that config the plan (99.7 GiB per GPU at the weight sync) is checked against an
    80 GB GPU, OpenRLHF's documented size, and names --adam_offload as the flag that fits alone, with why
    OpenRLHF's command needs it here (actor and critic peak together). With it, 68.6 GiB: fits."""
    from tests.e2e.test_rl import REFERENCE_PPO

    def dry_run(model: str, rm: str) -> str:
        args = REFERENCE_PPO.format(model=model, rm=rm, out=str(tmp_path / "out")).split()
        p = subprocess.run([PY, "train_ppo.py", *args, "--dry_run"], cwd=ROOT, env=env() | {"HF_HUB_OFFLINE": "1"},
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        return " ".join(p.stdout.split())  # the warning's lines joined: one message

    out = dry_run("meta-llama/Meta-Llama-3-8B", "OpenRLHF/Llama-3-8b-rm-700k")
    assert "memory plan: none (meta-llama/Meta-Llama-3-8B is neither a local folder nor in the Hugging Face cache" in out
    assert "`hf download meta-llama/Meta-Llama-3-8B config.json`" in out, out
    cmd = re.search(r"`(python bench/make_model\.py --shape 8b --config-only --out DIR)`", out)
    assert cmd, out
    model = tmp_path / "llama3-8b"
    p = subprocess.run(cmd.group(1).replace("DIR", str(model)).replace("python", PY, 1).split(), cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and (model / "config.json").exists(), p.stderr[-3000:]

    out = dry_run(str(model), str(model / "config.json"))  # a folder, or its config.json alone
    assert "peak at sync, needs a GPU of 99.7 GiB" in out, out
    assert ("no GPU visible here; on an 80 GB GPU (A100/H100 80GB: 79.6 GiB, the size OpenRLHF's 8-GPU commands are "
            "documented on): the memory plan needs 99.7 GiB on each GPU of actor+critic+ref+reward+vllm "
            "(sync: actor 59.2 + critic 31.0 + vllm 9.5)") in out, out
    assert "Flags that lower it, most saving first: --adam_offload (-31.1 GiB, fits)," in out, out
    assert "The actor and the critic train at the same time here" in out and "until the new weights reach vLLM" in out
    # the flag it names, planned: fits with 11 GiB to spare
    a = dict(pretrain=str(model), reward_pretrain=str(model), bf16=True, zero_stage=3, adam_offload=True,
             gradient_checkpointing=True, packing_samples=True, n_samples_per_prompt=1, prompt_max_len=1024,
             generate_max_len=1024, micro_train_batch_size=8, micro_rollout_batch_size=16, rollout_batch_size=1024,
             deepspeed_enable_sleep=True, vllm_enable_sleep=True, vllm_gpu_memory_utilization=0.5)
    plan = plan_resources(actor=(1, 8), critic=(1, 8), ref=(1, 8), reward=(1, 8), vllm_num_engines=4, vllm_tp=2,
                          colocate_actor_ref=False, colocate_critic_reward=False, colocate_all_models=True, use_gpu=True)
    fits = mp.from_options(a, "ppo", plan, gpu_bytes=mp.REFERENCE_GPU)
    assert fits.worst() / GiB == pytest.approx(68.6, abs=0.05)
    mp.check_memory(fits)


@pytest.mark.parametrize("flags,expect", [
    (["--adam_offload_ratio", "0.5"], "only ZeRO-3 has: add --adam_offload --zero_stage 3"),
    (["--adam_offload_ratio", "0.5", "--adam_offload", "--zero_stage", "2"], "only ZeRO-3 has"),
    (["--adam_offload_ratio", "0", "--adam_offload", "--zero_stage", "3"], "drop --adam_offload instead"),
    (["--adam_offload_ratio", "1.5"], "--adam_offload_ratio': Input should be less than or equal to 1"),
])
def test_partial_offload_flag_is_refused_where_deepspeed_has_none(flags, expect, tmp_path):
    p = subprocess.run([PY, os.path.join(ROOT, "train_sft.py"), "--save_path", str(tmp_path / "o"), *flags],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and expect in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "o").exists()
