"""LoRA end to end on CPU with the real engines: SFT, the reward model and DPO train an adapter on the built-in
task, save it in peft's format, resume exactly and merge; ZeRO-3 on two processes gathers the adapter's bytes
alone; GRPO and PPO train with the reference as the actor's base (tests/e2e/test_vllm_lora.py: the engines)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import PY, ROOT, last, metrics, run, script

LORA = ["--lora_rank", "8", "--lora_alpha", "16"]


def _comparable(rows):
    drop = ("time", "perf/", "mem/")  # wall clock
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


def test_sft_lora_learns_saves_an_adapter_resumes_exactly_and_merges(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from common.training.tiny import tiny_model_path

    full = str(tmp_path / "full")
    flags = [*LORA, "--target_modules", "q_proj", "k_proj", "v_proj", "o_proj", "--learning_rate", "2e-3",
             "--max_steps", "8", "--save_steps", "4", "--eval_steps", "4", "--train_batch_size", "16",
             "--micro_train_batch_size", "8", "--max_samples", "200"]
    p = script("train_sft.py", "--save_path", full, *flags)
    assert "LoRA: LoRA rank 8, alpha 16, dropout 0, on q_proj k_proj v_proj o_proj" in p.stdout, p.stdout[-3000:]
    rows = metrics(full)
    assert rows[-1]["train/loss"] < rows[1]["train/loss"] and rows[-1]["eval/loss"] < rows[0]["eval/loss"], rows
    saved = set(os.listdir(full))
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer_config.json"} <= saved
    assert "model.safetensors" not in saved  # the adapter alone: the base is where it was
    # resume from the step-4 checkpoint: the same steps 5-8, bit for bit
    resumed = str(tmp_path / "resumed")
    script("train_sft.py", "--save_path", resumed, "--ckpt_path", os.path.join(full, "checkpoints"), "--load_checkpoint",
           *flags)
    a, b = _comparable(metrics(full)), _comparable(metrics(resumed))
    assert [r["step"] for r in b] == [5, 6, 7, 8] and a[5:] == b
    # OpenRLHF's LoRA combiner, its flags: the merged model computes what base + adapter computes
    merged = str(tmp_path / "merged")
    run([PY, "-m", "common.training.lora", "--lora_path", full, "--output_path", merged])
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
    with torch.no_grad():
        want = PeftModel.from_pretrained(base, full)(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)(ids).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    from common.training.models import load_causal_lm  # an adapter folder as --pretrain: its base, adapter merged in

    with torch.no_grad():
        assert torch.allclose(load_causal_lm(full)(ids).logits, want, atol=1e-4)
    assert (got - plain).abs().max() > 1e-3  # the adapter trained
    # a bad module name: one line naming the layers that exist, nothing saved
    p = script("train_sft.py", "--save_path", str(tmp_path / "bad"), *LORA, "--target_modules", "qkv", check=False)
    assert p.returncode == 2 and p.stderr.startswith("error: --target_modules qkv: no such layer"), p.stderr[-2000:]
    assert "q_proj" in p.stderr and "Traceback" not in p.stderr


def test_rm_lora_learns_and_its_head_survives_save_load_and_merge(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.data.tasks import preference_rows
    from common.training.lora import merge
    from common.training.models import load_reward_model, reward_scores

    out = str(tmp_path / "rm")
    # a LoRA wants a larger learning rate than full weights (3e-4 there): 0.94 eval accuracy at step 80
    script("train_rm.py", "--save_path", out, *LORA, "--max_steps", "80", "--eval_steps", "80", "--learning_rate", "3e-3")
    rows = metrics(out)
    evals = [r["eval/acc"] for r in rows if "eval/acc" in r]
    assert rows[0]["train/loss"] == pytest.approx(0.6931, abs=0.02)
    assert evals[-1] >= 0.75 and last(rows, "train/loss") < 0.6, (evals, last(rows, "train/loss"))
    tok = AutoTokenizer.from_pretrained(out)
    pairs = preference_rows(32, "eval", seed=5)
    texts = [tok.apply_chat_template(r[k], tokenize=False).rstrip() for r in pairs for k in ("chosen", "rejected")]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    merged = merge(out, str(tmp_path / "merged"), is_rm=True)
    with torch.no_grad():
        ours = reward_scores(load_reward_model(out), enc["input_ids"], enc["attention_mask"])
        plain = AutoModelForSequenceClassification.from_pretrained(merged, num_labels=1, dtype=torch.float32)
        theirs = reward_scores(plain, enc["input_ids"], enc["attention_mask"])
    assert torch.allclose(ours, theirs, atol=1e-4)  # the trained head is in the adapter and in the merge
    assert (ours.view(-1, 2)[:, 0] > ours.view(-1, 2)[:, 1]).float().mean() >= 0.7


def test_dpo_lora_reference_is_the_base_and_it_learns(tmp_path):
    out = str(tmp_path / "dpo")
    p = script("train_dpo.py", "--save_path", out, *LORA, "--learning_rate", "2e-3", "--max_steps", "30",
               "--eval_steps", "30")
    assert "the reference is the base, adapter off" in p.stdout
    assert "reference" not in p.stdout.split("memory plan")[1].split("\n\n")[0].split("peak")[0], p.stdout[-3000:]
    rows = metrics(out)
    assert rows[0]["train/loss"] == pytest.approx(0.693147, abs=1e-4)  # a fresh adapter is the identity: policy == base
    assert last(rows, "train/loss") < 0.6 and last(rows, "eval/reward_acc") >= 0.8, rows[-1]
    p = script("train_dpo.py", "--save_path", str(tmp_path / "x"), *LORA, "--ref_offload", check=False)
    assert p.returncode == 2 and "no reference model to load or offload" in p.stderr


ZERO3_PROBE = """
import json, sys
import deepspeed, torch
from transformers import AutoModelForCausalLM
from common.training import ds, lora
from common.training.tiny import tiny_model_path

dist = ds.setup_distributed()
s = ds.DSSettings(zero_stage=3, micro_train_batch_size=1, train_batch_size=2)
keep = ds.zero3_loading(ds.train_config(s, dist.world_size, torch.float32))
model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
lora.apply_lora(model, lora.LoraSettings(rank=8))
engine = ds.initialize(model, s, dist, torch.float32, lr=1e-3, total_steps=1)
gathered = []
real = deepspeed.zero.GatheredParameters

class Counting(real):
    def __init__(self, params, *a, **k):
        gathered.extend(params if isinstance(params, (list, tuple)) else [params])
        super().__init__(params, *a, **k)

deepspeed.zero.GatheredParameters = Counting
state = lora.adapter_state(engine)
params = dict(engine.module.named_parameters())
if dist.rank == 0:
    print("PROBE", json.dumps({
        "gathered": sum(p.ds_numel for p in gathered),
        "adapter": sum(p.ds_numel for n, p in params.items() if "lora_" in n),
        "model": sum(p.ds_numel for p in params.values()),
        "partitioned": all(hasattr(p, "ds_id") for p in params.values()),
        "sent": sum(t.numel() for t in state.values()),
        "shapes_whole": all(t.shape == params[n.replace("base_model.model.", "").replace(".weight", ".default.weight")].ds_shape
                            for n, t in state.items()),
    }))
"""


def test_zero3_gathers_only_the_adapter(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(ZERO3_PROBE)
    p = run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
             "--master_port", "29547", str(probe)], extra_env={"PYTHONPATH": ROOT}, timeout=600)
    got = json.loads(p.stdout.split("PROBE", 1)[1].splitlines()[0])
    assert got["partitioned"] and got["shapes_whole"], got
    assert got["gathered"] == got["adapter"] == got["sent"], got  # the adapter's bytes, not one base weight
    assert got["adapter"] < got["model"] / 5, got


def test_ppo_lora_actor_and_critic_learn_with_the_base_as_reference(tmp_path):
    """train_ppo.py --lora_rank 8 without engines: the actor and the critic each train an adapter (the critic's
    value head in full), the reference is the actor's base (no model of its own), and the reward rises."""
    out = str(tmp_path / "ppo")
    p = script("train_ppo.py", "--save_path", out, *LORA, "--vllm_num_engines", "0", "--max_steps", "16",
               "--actor_learning_rate", "3e-3", "--eval_steps", "-1")
    assert "trained roles: actor, critic" in p.stdout and "reference: the actor's base" in p.stdout, p.stdout[-3000:]
    plan = p.stdout.split("resource plan:")[1].split("total:")[0]
    assert "actor" in plan and "critic" in plan and "ref " not in plan, plan
    rows = metrics(out)
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last_ = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3  # fifths of 16 steps
    assert last_ - first >= 0.2, rewards
    assert rows[-1]["train/kl"] > 0 and all("train/value_loss" in r for r in rows)
    assert os.path.isfile(os.path.join(out, "adapter_config.json"))
