"""OpenRLHF's reward models and critics (issue #17, part 3).

A folder saved the way OpenRLHF saves a reward model (built here with OpenRLHF's own
`get_llm_for_sequence_regression`) loads as our --reward_pretrain / --critic_pretrain and scores as
OpenRLHF's loader does, with and without --normalize_reward, left- or right-padded; a folder saved by
our train_rm.py records the head's name and the reward statistics, and OpenRLHF's loader reads it.

OpenRLHF comes from the test extra (`pip install --no-deps openrlhf==0.11.2 peft pylatexenc`), never
a runtime dependency. Two things stand in for what cannot run on a CPU:
- its packing / ring-attention helpers (`openrlhf.models.ring_attn_utils`) import flash_attn, which
  has no CPU build: that one module is a stub here; the padded forward passes compared below never
  call it;
- `DeepspeedStrategy.save_model` needs torchdata and a CUDA sync: its non-ZeRO-3 path (save_pretrained
  with the state dict, then the config and the tokenizer) is repeated as it is written.
"""
from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

from tests.helpers import PY, metrics, run, script

MEAN, STD = 0.3125, 1.75  # what OpenRLHF's RM evaluation records; exact in bf16 and fp32
PAD = 3                   # the tiny tokenizer's pad id
LENS = (9, 5, 7, 3)       # rows of different lengths: padding on either side


@pytest.fixture(scope="module")
def orl():
    """OpenRLHF's `get_llm_for_sequence_regression`, imported on the CPU."""
    pytest.importorskip("peft")
    if "openrlhf.models.ring_attn_utils" not in sys.modules:
        stub = types.ModuleType("openrlhf.models.ring_attn_utils")
        stub.gather_and_pad_tensor = stub.unpad_and_slice_tensor = None  # packing only (flash_attn)
        sys.modules["openrlhf.models.ring_attn_utils"] = stub
    model_mod = pytest.importorskip("openrlhf.models.model")
    return model_mod.get_llm_for_sequence_regression


@pytest.fixture(scope="module")
def tiny():
    from common.training.tiny import tiny_model_path

    return tiny_model_path()


def _load_orl(orl, path, kind, normalize):
    """OpenRLHF's loader as its reward / critic actors call it, in fp32 for a 1e-5 comparison.

    OpenRLHF 0.11.2 under transformers 5 (its pin 5.15.0 and our 5.19 alike) leaves the non-persistent
    `mean` / `std` buffers as uninitialised memory: its __init__ writes config.mean/std into them, but
    transformers 5 builds the model on the meta device and materialises such buffers empty. They are set
    here to what that __init__ writes, so its forward normalises as its code intends."""
    model = orl(path, kind, normalize_reward=normalize, param_dtype="bf16", attn_implementation="sdpa").float()
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    model.mean[0], model.std[0] = cfg.get("mean", 0.0), cfg.get("std", 1.0)
    return model.eval()


@pytest.fixture(scope="module", params=["score", "value_head"])
def orl_folder(request, orl, tiny, tmp_path_factory):
    """A reward model saved as OpenRLHF's train_rm.py saves one, its head named `request.param`."""
    from transformers import AutoTokenizer

    prefix = request.param
    torch.manual_seed(0)
    model = orl(tiny, "reward", param_dtype="bf16", attn_implementation="sdpa", init_value_head=True,
                value_head_prefix=prefix)
    with torch.no_grad():  # OpenRLHF's init (std 1/(hidden+1)) gives rewards of ~1e-2: widen it to compare
        getattr(model, prefix).weight.normal_(0.0, 0.3)
    model.config.mean, model.config.std = MEAN, STD  # RewardModelTrainer.evaluate
    model.config.value_head_prefix = prefix          # cli/train_rm.py, before saving
    out = str(tmp_path_factory.mktemp(f"orl_{prefix}"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(out, state_dict=state)
    model.config.to_json_file(os.path.join(out, "config.json"))
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out, prefix


def _rows(left: bool):
    """The same token rows, padded on the right or the left: ids, attention mask [4, 9]."""
    g = torch.Generator().manual_seed(1)
    T = max(LENS)
    ids = torch.full((len(LENS), T), PAD)
    mask = torch.zeros(len(LENS), T, dtype=torch.long)
    for i, n in enumerate(LENS):
        cols = slice(T - n, T) if left else slice(0, n)
        ids[i, cols] = torch.randint(10, 500, (n,), generator=g)
        mask[i, cols] = 1
    return ids, mask


WORKER = r"""
import sys, torch
from common.training.ds import DSSettings
from common.rl.workers import ModelSpec, ModelWorker
from tests.e2e.test_openrlhf_rm import _rows

path, out = sys.argv[1], sys.argv[2]
ids, mask = _rows(left=False)
batch = {"input_ids": ids, "attention_mask": mask, "action_mask": (mask[:, :-1] * mask[:, 1:]).float()}
result = {}
for role, trainable in (("reward", False), ("critic", True)):
    w = object.__new__(ModelWorker)
    w.role = role
    settings = DSSettings(zero_stage=0, micro_train_batch_size=2, train_batch_size=4)
    info = w.setup(ModelSpec(path, "value", trainable, settings, normalize_reward=True, value_head_prefix="score",
                             offload=not trainable,  # --ref_reward_offload: on a CPU only a note
                             optim=dict(lr=0.0, total_steps=1, warmup_ratio=0.0, scheduler="constant_with_warmup")))
    result[role] = w.rewards(batch, 2) if role == "reward" else w.values(batch, 2)
    result[role + "_notes"] = info["notes"]
torch.save(result, out)
"""


def test_the_ray_workers_load_it_as_reward_and_critic(orl, orl_folder, tmp_path):
    """ModelSpec carries --value_head_prefix and --normalize_reward to the workers of train_ppo.py /
    train_grpo.py (here without Ray: the worker class in one process, ZeRO-0)."""
    path, _ = orl_folder
    out = str(tmp_path / "worker.pt")
    run([PY, "-c", WORKER, path, out], timeout=300)
    got = torch.load(out)
    ids, mask = _rows(left=False)
    with torch.no_grad():
        reward = _load_orl(orl, path, "reward", True)(ids, mask)
        values = _load_orl(orl, path, "critic", True)(ids, action_mask=(mask[:, :-1] * mask[:, 1:]).float(),
                                                      attention_mask=mask)
    torch.testing.assert_close(got["reward"], reward, rtol=0, atol=1e-5)
    torch.testing.assert_close(got["critic"], values, rtol=0, atol=1e-5)
    assert any("--ref_reward_offload" in n for n in got["reward_notes"])
    assert not any("--ref_reward_offload" in n for n in got["critic_notes"])


def test_our_reward_model_records_mean_std_and_head_and_loads_in_openrlhf(orl, tmp_path):
    """train_rm.py records what OpenRLHF's does: the head's name and the last evaluation's reward mean
    and (unbiased) std over its chosen and rejected responses; OpenRLHF's loader then scores it as ours."""
    from safetensors import safe_open

    from common.training.models import load_reward_model, load_tokenizer, reward_scores
    from common.data.preferences import collate_pairs, load_preference_data

    out = str(tmp_path / "rm")
    script("train_rm.py", "--save_path", out, "--max_steps", "2", "--eval_steps", "2", "--value_head_prefix",
           "value_head", "--zero_stage", "0")
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["value_head_prefix"] == "value_head" and cfg["normalize_reward"] is False
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "value_head.weight" in keys and "score.weight" not in keys  # saved under OpenRLHF's name
    logged = [r for r in metrics(out) if "eval/reward_mean" in r][-1]
    assert (cfg["mean"], cfg["std"]) == (logged["eval/reward_mean"], logged["eval/reward_std"])

    # the statistics, recomputed from the saved model over the held-out pairs
    tok = load_tokenizer(out)
    _, _, pairs, _ = load_preference_data(None, None, tok, max_samples=None, chosen_key="chosen",
                                          rejected_key="rejected", prompt_key=None, apply_chat_template=False,
                                          max_len=512, margin_key="margin")
    ours = load_reward_model(out).eval()
    with torch.no_grad():
        scores = []
        for i in range(0, len(pairs), 16):
            batch = collate_pairs(pairs[i: i + 16], tok.pad_token_id)
            scores.append(reward_scores(ours, batch["input_ids"], batch["attention_mask"]))
    scores = torch.cat(scores).double()
    assert cfg["mean"] == pytest.approx(scores.mean().item(), abs=1e-5)
    assert cfg["std"] == pytest.approx(scores.std().item(), rel=1e-4)

    # OpenRLHF's loader reads our folder (bf16, as it loads; ours in bf16 too for the same weights)
    ids, mask = _rows(left=False)
    for normalize in (False, True):
        theirs = _load_orl(orl, out, "reward", normalize)
        mine = load_reward_model(out, dtype=torch.bfloat16, normalize_reward=normalize).float().eval()
        with torch.no_grad():
            torch.testing.assert_close(reward_scores(mine, ids, mask), theirs(ids, mask), rtol=0, atol=1e-5)
