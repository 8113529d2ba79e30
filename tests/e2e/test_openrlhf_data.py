"""OpenRLHF's data flags with OpenRLHF's meaning: mixtures (--dataset_probs / --prompt_data_probs),
splits, --input_template, --tokenizer_chat_template, --packing_samples for RM and DPO, --margin_loss,
--min_lr_ratio, --ref_offload and --use_liger_kernel.

Each number is checked against a naive reference: the mixture against `datasets.interleave_datasets`
itself (what OpenRLHF calls), the packed losses against the padded ones on the tiny model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from common.data.blend import PROMPT_FLAGS, blend_order, load_mixture, parse_probs, parse_sources
from common.errors import UserError
from tests.helpers import ROOT, env, metrics, script

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def user_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    return str(e.value)


@pytest.fixture(scope="module")
def tok():
    from common.training.models import load_tokenizer
    from common.training.tiny import tiny_model_path

    return load_tokenizer(tiny_model_path())


# ---- mixtures ------------------------------------------------------------------------------------

@pytest.mark.parametrize("lengths,probs,seed", [
    ([5, 3], [0.5, 0.5], 42), ([40, 7, 2], [0.2, 0.5, 0.3], 0), ([1200, 3], [0.99, 0.01], 7), ([9], [1.0], 42)])
def test_blend_order_is_datasets_interleave_row_for_row(lengths, probs, seed):
    """OpenRLHF mixes with interleave_datasets(probabilities, seed, "all_exhausted"): the same rows, same order."""
    from datasets import Dataset, interleave_datasets

    parts = [Dataset.from_list([{"src": s, "row": i} for i in range(n)]) for s, n in enumerate(lengths)]
    theirs = interleave_datasets(parts, probabilities=probs, seed=seed, stopping_strategy="all_exhausted").to_list()
    ours = blend_order(lengths, probs, seed)
    assert ours == [(r["src"], r["row"]) for r in theirs]
    # The stopping rule, from its definition: each source used up at least once, and the last row
    # is the one that used up the last source.
    counts = [sum(1 for s, _ in ours if s == k) for k in range(len(lengths))]
    assert all(c >= n for c, n in zip(counts, lengths))
    last = ours[-1][0]
    assert counts[last] == lengths[last]


def test_mixture_follows_the_probabilities():
    order = blend_order([3000, 3000], [0.8, 0.2], seed=1)
    share = sum(1 for s, _ in order if s == 0) / len(order)
    assert abs(share - 0.8) < 0.02
    assert len(order) >= 3000 / 0.2 * 0.9  # the rare source sets the size: about 3000 / 0.2 rows


def test_load_mixture_of_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(6)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "extra": i} for i in range(3)])
    rows, desc = load_mixture(f"{a},{b}")  # no probabilities: concatenated, as OpenRLHF
    assert [r["prompt"] for r in rows] == [f"a{i}" for i in range(6)] + [f"b{i}" for i in range(3)]
    assert "concatenated" in desc and "9 rows" in desc
    rows, desc = load_mixture(f"{a}, {b}", "0.3,0.7", seed=5)
    expect = [f"{'ab'[s]}{i}" for s, i in blend_order([6, 3], [0.3, 0.7], 5)]
    assert [r["prompt"] for r in rows] == expect and "seed 5" in desc
    # --max_samples: each source's first N rows, then the mixture's first N (OpenRLHF does both).
    rows, _ = load_mixture(f"{a},{b}", "0.5,0.5", max_samples=2, seed=5)
    expect = [f"{'ab'[s]}{i}" for s, i in blend_order([2, 2], [0.5, 0.5], 5)][:2]
    assert [r["prompt"] for r in rows] == expect


@pytest.mark.parametrize("probs,expect", [
    ("0.5", "1 probabilities for 2 source"), ("0.5,x", "comma-separated numbers"),
    ("0.5,0.4", "sums to 0.9"), ("1,0", "must be > 0"), ("-0.5,1.5", "must be > 0")])
def test_bad_probabilities_name_the_flag(probs, expect):
    msg = user_error(parse_probs, probs, 2, PROMPT_FLAGS)
    assert msg.startswith("--prompt_data_probs") and expect in msg


def test_sources_with_data_dir(tmp_path):
    assert parse_sources("org/name@sub, b.jsonl") == [("org/name", "sub"), ("b.jsonl", None)]
    odd = tmp_path / "a@b.jsonl"
    odd.write_text("{}\n")
    assert parse_sources(str(odd)) == [(str(odd), None)]  # an existing path keeps its '@'
    assert "empty name" in user_error(parse_sources, "a.jsonl,,b.jsonl")
    # name@data_dir on a local folder of data files: load_dataset(folder, data_dir=...)
    (tmp_path / "folder" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "folder" / "sub" / "part.jsonl", [{"prompt": "deep"}])
    write_jsonl(tmp_path / "folder" / "top.jsonl", [{"prompt": "top"}])
    rows, _ = load_mixture(f"{tmp_path / 'folder'}@sub")
    assert [r["prompt"] for r in rows] == ["deep"]


# ---- splits --------------------------------------------------------------------------------------

def test_splits_of_a_saved_datasets_folder(tmp_path):
    from datasets import Dataset, DatasetDict

    folder = str(tmp_path / "saved")
    DatasetDict({"train": Dataset.from_list([{"prompt": "t1"}, {"prompt": "t2"}]),
                 "validation": Dataset.from_list([{"prompt": "v1"}])}).save_to_disk(folder)
    assert [r["prompt"] for r in load_mixture(folder)[0]] == ["t1", "t2"]
    assert [r["prompt"] for r in load_mixture(folder, split="validation")[0]] == ["v1"]
    msg = user_error(load_mixture, folder, split="test", default_split="test")
    assert "no split 'test'" in msg and "validation" in msg


def test_split_of_a_single_file(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}])
    assert load_mixture(f, split="test", default_split="test")[0] == [{"prompt": "x"}]  # the default: the file
    msg = user_error(load_mixture, f, split="validation", flags=PROMPT_FLAGS)
    assert msg.startswith("--prompt_split validation") and "single file" in msg
    j = tmp_path / "d.json"
    j.write_text(json.dumps({"train": [{"prompt": "tr"}], "test": [{"prompt": "te"}]}))
    assert load_mixture(str(j), split="test")[0] == [{"prompt": "te"}]  # a .json object's split key


# ---- --input_template and --tokenizer_chat_template ------------------------------------------------

def test_input_template_renders_the_prompt(tok):
    from common.data.preferences import build_preference_pairs
    from common.data.prompts import build_prompts

    t = "Question: {}\nAnswer: "
    ex, _ = build_prompts([{"q": "why {x}?"}], "d", tok, input_key="q", label_key=None, input_template=t)
    assert ex[0].prompt_text == "Question: why {x}?\nAnswer: "  # str.format, as OpenRLHF: braces in the data stay
    assert tok.decode(ex[0].prompt_ids) == ex[0].prompt_text
    pairs, _ = build_preference_pairs([{"p": "two", "chosen": "yes", "rejected": "no"}], "d", tok,
                                      prompt_key="p", input_template=t)
    assert tok.decode(pairs[0].prompt_ids) == "Question: two\nAnswer: "


@pytest.mark.parametrize("opts,expect", [
    (dict(input_template="Q:"), "has no '{}'"),
    (dict(input_template="Q: {} {name}"), "write other braces as"),
    (dict(input_template="Q: {}", apply_chat_template=True), "drop one of the two"),
    (dict(input_template="Q: {}", prompt_key=None), "set --prompt_key"),
    (dict(input_template="Q: {}", dataset=None), "built-in task"),
    (dict(tokenizer_chat_template="{{ x }}"), "add --apply_chat_template"),
])
def test_template_flags_refuse_what_openrlhf_drops_or_ignores(opts, expect):
    from common.cli.checks import template_notes

    a = {"dataset": "d.jsonl", "apply_chat_template": False, "prompt_key": "prompt", **opts}
    assert expect in user_error(template_notes, a, "--prompt_key")


def test_template_with_a_backslash_n_is_kept_and_noted():
    from common.cli.checks import template_notes

    notes = template_notes({"prompt_data": "d.jsonl", "apply_chat_template": False, "input_template": "Q: {}\\nA:"})
    assert len(notes) == 1 and "not a newline" in notes[0]
    assert template_notes({"prompt_data": "d.jsonl", "apply_chat_template": False, "input_template": "Q: {}\nA:"}) == []


def test_tokenizer_chat_template_replaces_the_tokenizers(tok):
    from common.training.models import load_tokenizer
    from common.data.prompts import build_prompts, set_chat_template
    from common.training.tiny import tiny_model_path

    t = load_tokenizer(tiny_model_path())
    set_chat_template(t, TEMPLATE)
    ex, _ = build_prompts([{"q": "hi"}], "d", t, input_key="q", label_key=None, apply_chat_template=True)
    assert ex[0].prompt_text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "not a valid Jinja template" in user_error(set_chat_template, t, "{% for m in messages %}")


# ---- --packing_samples for RM and DPO: packed == padded ---------------------------------------------

def _pairs(tok):
    from common.data.preferences import build_preference_pairs, collate_pairs

    rows = [{"prompt": "the cat", "chosen": "sat on the mat today", "rejected": "no"},
            {"prompt": "a much longer prompt about the weather and more", "chosen": "sunny", "rejected": "rain all day long"},
            {"prompt": "hi", "chosen": "hello there", "rejected": "go away now please", "margin": 0.5}]
    pairs, _ = build_preference_pairs(rows, "d", tok, prompt_key="prompt", max_len=64)
    return collate_pairs(pairs, tok.pad_token_id)


def test_packed_reward_model_loss_equals_padded(tok):
    from common.algo.losses import bradley_terry_loss
    from common.training.models import load_reward_model
    from common.algo.packing import sequence_rewards
    from common.training.tiny import tiny_model_path

    torch.manual_seed(0)
    model = load_reward_model(tiny_model_path(), attn_impl="sdpa", pad_token_id=tok.pad_token_id)
    batch, b = _pairs(tok), 3
    losses, grads = [], []
    for packing in (False, True):
        model.zero_grad()
        r = sequence_rewards(model, batch["input_ids"], batch["attention_mask"], packing=packing)
        loss = bradley_terry_loss(r[:b], r[b:], batch["margin"])
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert abs(losses[0] - losses[1]) < 1e-5
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_packed_dpo_loss_equals_padded(tok):
    from transformers import AutoModelForCausalLM

    from common.algo.losses import dpo_loss, nll_loss, sequence_logprobs
    from common.algo.packing import next_token_logprobs
    from common.training.tiny import tiny_model_path

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path(), attn_implementation="sdpa")
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path(), attn_implementation="sdpa").eval()
    with torch.no_grad():  # a policy a little away from the reference, so the loss is not ln 2
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch, b = _pairs(tok), 3
    mask = batch["loss_mask"][:, 1:]
    losses = []
    for packing in (False, True):
        lp = lambda m: next_token_logprobs(m, batch["input_ids"], batch["attention_mask"], packing=packing)  # noqa: E731
        with torch.no_grad():
            ref = sequence_logprobs(lp(reference), mask)
        tok_lp = lp(policy)
        pol = sequence_logprobs(tok_lp, mask)
        loss = dpo_loss(pol[:b], pol[b:], ref[:b], ref[b:], 0.1)[0] + 0.5 * nll_loss(tok_lp[:b], mask[:b])
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-5
    assert abs(losses[0] - 0.6931) > 1e-3


# ---- --min_lr_ratio and the warm-up -----------------------------------------------------------------

SCHEDULE = r"""
import json, torch
from common.training import ds
dist = ds.setup_distributed()
model = torch.nn.Linear(4, 1)
s = ds.DSSettings(zero_stage=0, micro_train_batch_size=1, train_batch_size=1)
e = ds.initialize(model, s, dist, torch.float32, lr=1.0, total_steps=10, warmup_ratio=0.05, min_lr_ratio=0.25)
lrs = []
for _ in range(10):
    e.backward(model(torch.ones(1, 4)).sum()); e.step(); lrs.append(e.get_lr()[0])
print(json.dumps(lrs))
"""


def test_cosine_with_min_lr_decays_to_min_lr_ratio_after_a_ceil_warmup():
    """OpenRLHF: ceil(0.05 x 10) = 1 warm-up step, then cosine from lr to lr x --min_lr_ratio."""
    import math

    # a world of one, as `python train_*.py` makes it (common.training.dist.setup_distributed)
    e = {k: v for k, v in env().items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, "-c", SCHEDULE], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lrs = json.loads(p.stdout.strip().splitlines()[-1])
    # lr after step k (k = 1..10), by transformers' formula with min_lr_rate 0.25 and 1 warm-up step
    expect = [0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi * (k - 1) / 9)) for k in range(1, 11)]
    assert lrs == pytest.approx(expect, abs=1e-6)
    assert lrs[-1] == pytest.approx(0.25)


# ---- --use_liger_kernel, --ref_offload ------------------------------------------------------------------

def test_liger_is_said_not_used_off_gpu_or_not_installed():
    from common.training.liger import apply_liger

    assert "not used on the CPU" in apply_liger(object(), torch.device("cpu"))
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        assert "not installed" in apply_liger(object(), torch.device("cuda"))


def test_ref_offload_zero3_config_offloads_parameters():
    from common.training import ds

    s = ds.DSSettings(zero_stage=3)
    assert ds.eval_config(s, torch.float32, True)["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "offload_param" not in ds.eval_config(s, torch.float32)["zero_optimization"]
    assert "offload_param" not in ds.eval_config(ds.DSSettings(zero_stage=2), torch.float32, True)["zero_optimization"]


# ---- the scripts, end to end -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    from common.data.tasks import preference_rows

    d = tmp_path_factory.mktemp("mix")
    rows = preference_rows(96, "train", seed=4)
    plain = [{"prompt": r["chosen"][0]["content"], "chosen": r["chosen"][-1]["content"],
              "rejected": r["rejected"][-1]["content"], "margin": 0.1} for r in rows]
    return write_jsonl(d / "a.jsonl", plain[:64]), write_jsonl(d / "b.jsonl", plain[64:])


def test_rm_mixture_packing_margin_and_template_run(tmp_path, two_sets):
    a, b = two_sets
    out = str(tmp_path / "rm")
    p = script("train_rm.py", "--dataset", f"{a},{b}", "--dataset_probs", "0.75,0.25", "--prompt_key", "prompt",
               "--input_template", "Q: {}\nA: ", "--packing_samples", "--margin_loss", "--compute_fp32_loss",
               "--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_steps", "2", "--zero_stage", "0",
               "--save_path", out, timeout=600)
    text = p.stdout + p.stderr
    assert "mixed 0.75/0.25, seed 42" in text and "block-diagonal mask" in text
    rows = metrics(out)
    assert len(rows) == 2 and all(r["train/loss"] == r["train/loss"] for r in rows)


def test_dpo_packing_template_and_min_lr_run(tmp_path, two_sets):
    a, _ = two_sets
    out = str(tmp_path / "dpo")
    script("train_dpo.py", "--dataset", a, "--prompt_key", "prompt", "--input_template", "Q: {}\nA: ",
           "--packing_samples", "--ref_offload", "--use_liger_kernel", "--min_lr_ratio", "0.5",
           "--lr_scheduler", "cosine_with_min_lr", "--lr_warmup_ratio", "0", "--learning_rate", "1e-3",
           "--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_steps", "2", "--zero_stage", "0",
           "--save_path", out, timeout=600)
    rows = metrics(out)
    assert rows[0]["train/loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference: ln 2, packed too
    assert rows[-1]["train/lr"] == pytest.approx(0.5e-3)  # decayed to --min_lr_ratio x --learning_rate


def test_rm_data_flags_refused_with_one_message(tmp_path, two_sets):
    a, b = two_sets
    for flags, expect in ((["--dataset", f"{a},{b}", "--dataset_probs", "0.5"], "--dataset_probs"),
                          (["--dataset", a, "--input_template", "Q: {}"], "--prompt_key"),
                          (["--dataset", a, "--margin_loss", "--loss", "logexp"], "--margin_loss")):
        p = script("train_rm.py", *flags, "--save_path", str(tmp_path / "x"), check=False, timeout=300)
        assert p.returncode == 2 and expect in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_grpo_mixes_prompt_sets_with_a_template(tmp_path, ray_head):
    from common.data.tasks import prompt_rows

    rows = [{"question": r["prompt"][0]["content"], "answer": r["label"]} for r in prompt_rows(24, "train", seed=9)]
    a, b = write_jsonl(tmp_path / "a.jsonl", rows[:16]), write_jsonl(tmp_path / "b.jsonl", rows[16:])
    out = str(tmp_path / "run")
    p = script("train_grpo.py", "--prompt_data", f"{a},{b}", "--prompt_data_probs", "0.5,0.5", "--prompt_split", "train",
               "--input_key", "question", "--label_key", "answer", "--input_template", "Copy: {}\n",
               "--reward_func", os.path.join(ROOT, "examples", "reward_func_copy.py"), "--max_steps", "1",
               "--eval_steps", "-1", "--rollout_batch_size", "8", "--save_path", out, timeout=600)
    assert "mixed 0.5/0.5, seed 42" in p.stdout + p.stderr
    assert len(metrics(out)) == 1
