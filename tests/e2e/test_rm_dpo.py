"""Reward model and DPO end to end on CPU with the real DeepSpeed: learning, saving, resuming,
several processes, the user's reference commands, and bad input."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import PY, ROOT, last, metrics, run, script


@pytest.fixture(scope="session")
def tiny():
    from common.training.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def pref_file(tmp_path_factory):
    """A preference file in OpenRLHF's format (chosen/rejected message lists)."""
    from common.data.tasks import preference_rows

    path = tmp_path_factory.mktemp("data") / "prefs.jsonl"
    with open(path, "w") as f:
        for row in preference_rows(256, "train", seed=3):
            f.write(json.dumps(row) + "\n")
    return str(path)


def test_rm_learns_the_builtin_task_and_saves_a_loadable_model(tmp_path, tiny):
    out = str(tmp_path / "rm")
    # lr 3e-4 over 160 steps rather than the demo's 5e-4 over 120: at 5e-4 the short run is chaotic, and the
    # float differences between hosts decide it (seed 42 gave >= 0.9 on earlier hosts, 0.898 on one, 0.72 on
    # the 2026-12-03 host, seed 43 0.95 there). At 3e-4 x 160 seeds 42-44 gave 0.94, 0.93, 0.95 there.
    script("train_rm.py", "--save_path", out, "--max_steps", "160", "--eval_steps", "80", "--zero_stage", "2",
           "--learning_rate", "3e-4")
    rows = metrics(out)
    evals = [r["eval/acc"] for r in rows if "eval/acc" in r]
    # chance is 0.5; the bar leaves room for float differences between machines and library builds
    assert len(evals) == 2 and evals[-1] >= 0.85 and evals[-1] >= evals[0], evals
    assert rows[0]["train/loss"] == pytest.approx(0.6931, abs=0.02)  # a new head scores both the same
    assert last(rows, "train/loss") < 0.4
    assert os.path.exists(os.path.join(out, "curves.png")) and os.path.exists(os.path.join(out, "config.json"))

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.training.models import load_reward_model, reward_scores
    from common.data.tasks import preference_rows

    model = load_reward_model(out)
    assert isinstance(model, AutoModelForSequenceClassification._model_mapping[type(model.config)])
    tok = AutoTokenizer.from_pretrained(out)
    rows = preference_rows(64, "eval", seed=5)
    # scored at the end-of-turn token, as in training (the template's trailing newline is not part of it)
    texts = [tok.apply_chat_template(row[k], tokenize=False).rstrip() for row in rows for k in ("chosen", "rejected")]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        scores = reward_scores(model, enc["input_ids"], enc["attention_mask"]).view(-1, 2)
    assert (scores[:, 0] > scores[:, 1]).float().mean() >= 0.85  # the saved model keeps what it learned


def test_dpo_learns_the_builtin_task_first_loss_is_ln2(tmp_path, tiny):
    out = str(tmp_path / "dpo")
    p = script("train_dpo.py", "--save_path", out, "--max_steps", "30", "--eval_steps", "30")
    assert "built successfully" not in p.stdout  # DeepSpeed's line at every start, cached op or not (#22)
    assert p.stdout.startswith("== hybridrl train_dpo ==")  # the banner is the first thing a user reads
    assert p.stdout.splitlines()[-3:] == [f"metrics: {out}/metrics.jsonl", f"curves: {out}/curves.png",
                                          f"policy: {out}"], p.stdout[-2000:]  # and where it all went, the last
    rows = metrics(out)
    assert rows[0]["train/loss"] == pytest.approx(0.693147, abs=1e-4)  # policy == reference at step 1
    assert last(rows, "eval/reward_acc") >= 0.8
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time", "perf")) and k != "time"} for r in rows]


@pytest.mark.parametrize("name", ["train_rm.py", "train_dpo.py"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, tiny, name):
    full = str(tmp_path / "full")
    flags = ["--max_steps", "6", "--save_steps", "3", "--eval_steps", "3", "--train_batch_size", "16",
             "--micro_train_batch_size", "8", "--max_samples", "200"]
    script(name, "--save_path", full, *flags, "--save_hf_ckpt")
    assert os.path.isdir(os.path.join(full, "checkpoints", "step00000003"))
    role = "policy" if name == "train_dpo.py" else "model"  # --save_hf_ckpt: a Hugging Face copy in each checkpoint
    assert os.path.exists(os.path.join(full, "checkpoints", "step00000003", role, "hf", "config.json"))
    resumed = str(tmp_path / "resumed")
    script(name, "--save_path", resumed, "--ckpt_path", os.path.join(full, "checkpoints"), "--load_checkpoint", *flags)
    a, b = _comparable(metrics(full)), _comparable(metrics(resumed))
    assert [r["step"] for r in b] == [4, 5, 6]
    assert a[3:] == b  # bit-identical on CPU: same weights, optimizer, schedule, data position and RNG


# The two-process ZeRO-3 reward model runs as a Slurm job of two ranks (tests/e2e/test_slurm.py, rm_8b).


REFERENCE_RM = """--save_steps -1 --logging_steps 1 --eval_steps -1 --train_batch_size 256
  --micro_train_batch_size 1 --pretrain {model} --bf16 --max_epochs 1 --max_len 8192
  --zero_stage 3 --learning_rate 9e-6 --dataset {data} --apply_chat_template --chosen_key chosen
  --rejected_key rejected --flash_attn --gradient_checkpointing"""
REFERENCE_DPO = """--save_steps -1 --logging_steps 1 --eval_steps -1 --train_batch_size 256
  --micro_train_batch_size 2 --pretrain {model} --bf16 --max_epochs 1 --max_len 8192
  --zero_stage 3 --learning_rate 5e-7 --beta 0.1 --dataset {data} --apply_chat_template --chosen_key chosen
  --rejected_key rejected --flash_attn --gradient_checkpointing"""


@pytest.mark.parametrize("name,flags,ranks", [("train_rm.py", REFERENCE_RM, 1), ("train_dpo.py", REFERENCE_DPO, 2)])
def test_reference_commands_run_under_the_deepspeed_launcher(tmp_path, tiny, pref_file, name, flags, ranks):
    """The user's reference commands, model and dataset replaced by local ones, as spelled there; DPO's on two
    processes (ZeRO-3 across two ranks under DeepSpeed's launcher; the RM's two ranks run under Slurm).
    (Merged: DPO's two-process ZeRO-3 run under the launcher, whose first loss is ln 2.)"""
    out = str(tmp_path / "out")
    args = flags.format(model=tiny, data=pref_file).split() + ["--save_path", out]
    p = run([os.path.join(os.path.dirname(PY), "deepspeed"), "--num_gpus", str(ranks), "--master_addr", "127.0.0.1",
             "--master_port", str(29535 + ranks), os.path.join(ROOT, name), *args], timeout=600)
    text = p.stdout + p.stderr
    assert "no native bf16" in text or "bfloat16" in text  # --bf16 either used or its fallback said once
    assert "flash-attention is not available" in text
    # the reference's --max_len against the tiny model's 512 positions: said, and run as asked
    assert "--max_len 8192 exceeds the model's 512 positions (max_position_embeddings in its config.json)" in text
    rows = metrics(out)
    assert len(rows) == 1  # 256 pairs / batch 256 = one step
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    if ranks == 2:
        assert "world size: 2" in text, text[-3000:]
        assert rows[0]["train/loss"] == pytest.approx(0.693147, abs=1e-4)  # the policy starts as its reference


# The file's and the rows' checks end the script the same way; each of their messages (a missing file,
# no rows, a wrong type...) is read in tests/test_data.py, so one of each kind runs end to end here.
@pytest.mark.parametrize("content,expect", [
    ('{"chosen": "a", "rejected": "b"}\n{"chosen": "a", "rejected": \n', "line 2"),
    ('{"chosen": "a", "rej": "b"}\n', "--rejected_key"),
])
def test_bad_dataset_stops_with_one_clear_message(tmp_path, tiny, content, expect):
    data = tmp_path / "data.jsonl"
    if content is not None:
        data.write_text(content)
    out = tmp_path / "out"
    p = script("train_rm.py", "--dataset", str(data), "--save_path", str(out), check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "data.jsonl" in p.stderr and expect in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
