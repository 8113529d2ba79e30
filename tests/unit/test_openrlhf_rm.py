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


def test_the_folder_is_openrlhfs_format(orl_folder):
    from safetensors import safe_open

    path, prefix = orl_folder
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["value_head_prefix"] == prefix and cfg["mean"] == MEAN and cfg["std"] == STD
    assert cfg["architectures"] == ["RewardModel"]
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert f"{prefix}.weight" in keys and "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys


@pytest.mark.parametrize("normalize", [False, True])
def test_reward_scores_equal_openrlhfs_loader(orl, orl_folder, normalize):
    from common.training.models import load_reward_model, reward_scores

    path, _ = orl_folder
    theirs = _load_orl(orl, path, "reward", normalize)
    ours = load_reward_model(path, normalize_reward=normalize).eval()
    with torch.no_grad():
        right, left = _rows(left=False), _rows(left=True)
        expected = theirs(*right)
        torch.testing.assert_close(theirs(*left), expected, rtol=0, atol=1e-5)  # OpenRLHF: either padding
        for ids, mask in (right, left):
            torch.testing.assert_close(reward_scores(ours, ids, mask), expected, rtol=0, atol=1e-5)
    assert expected.std() > 0.05  # the scores differ from row to row: the comparison means something
    if normalize:
        raw = reward_scores(load_reward_model(path).eval(), *right).detach()
        torch.testing.assert_close(expected, (raw - MEAN) / STD, rtol=0, atol=1e-5)


@pytest.mark.parametrize("normalize", [False, True])
def test_critic_values_equal_openrlhfs_loader(orl, orl_folder, normalize):
    """OpenRLHF's critic normalises its values in training as at inference; so does ours."""
    from common.training.models import load_reward_model, token_values

    path, _ = orl_folder
    theirs = _load_orl(orl, path, "critic", normalize)
    ours = load_reward_model(path, normalize_reward=normalize)
    for train in (False, True):
        theirs.train(train), ours.train(train)
        for ids, mask in (_rows(left=False), _rows(left=True)):
            # the value at position t is the state after tokens 0..t; both of t and t+1 are real tokens
            real = (mask[:, :-1] * mask[:, 1:]).bool()
            with torch.no_grad():
                expected = theirs(ids, action_mask=mask[:, 1:].float(), attention_mask=mask)
                got = token_values(ours, input_ids=ids, attention_mask=mask)[:, :-1]
            torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)


def test_a_wrong_head_name_is_one_clear_message(orl_folder, tmp_path):
    """The folder's config names the head; without that record the flag must name it, or the load stops
    (a reward model with a new random head would train on noise)."""
    from common.errors import UserError
    from common.training.models import load_reward_model

    path, prefix = orl_folder
    assert load_reward_model(path, value_head_prefix="elsewhere").config.value_head_prefix == prefix  # config wins
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(path):
        if name != "config.json":
            os.symlink(os.path.join(path, name), bare / name)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    del cfg["value_head_prefix"]
    (bare / "config.json").write_text(json.dumps(cfg))
    wrong = "value_head" if prefix == "score" else "score"
    with pytest.raises(UserError, match=f"no value head named '{wrong}'.*{prefix}.*--value_head_prefix"):
        load_reward_model(str(bare), value_head_prefix=wrong)
    assert load_reward_model(str(bare), value_head_prefix=prefix).config.value_head_prefix == prefix
