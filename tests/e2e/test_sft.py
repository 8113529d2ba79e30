"""SFT: the loss against a naive masked cross-entropy, the row layouts, and train_sft.py end to end on
CPU with the real DeepSpeed (the built-in run learns the copy task, resume is exact, two ranks, bad input)."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests.helpers import PY, ROOT, metrics, run, script

USER, ASSISTANT = "user", "assistant"


def _msg(role, content):
    return {"role": role, "content": content}


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    from common.training.models import load_tokenizer
    from common.training.tiny import tiny_model_path

    path = tiny_model_path()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # move it off its trained point so the loss is not near 0 everywhere
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return load_tokenizer(path), model.eval()


def _examples(tok, rows, **keys):
    from common.data.sft import SFTKeys, build_sft_examples

    return build_sft_examples(rows, "data.jsonl", tok, SFTKeys(**keys))[0]


def _naive_loss(model, examples) -> tuple[float, int]:
    """Mean over every (example, position) whose token is in the loss of -log p(token | the tokens before)."""
    nll, count = 0.0, 0
    for e in examples:
        ids = torch.tensor([e.ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        for j in range(1, len(e.ids)):
            if e.loss_mask[j]:
                nll -= logp[j - 1, e.ids[j]].item()
                count += 1
    return nll / count, count


def _trained_text(tok, e) -> list[str]:
    """The decoded runs of loss tokens."""
    runs, cur = [], []
    for t, m in zip(e.ids, e.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return [tok.decode(r) for r in runs + ([cur] if cur else [])]


MIXED = [  # responses of different lengths, so padding and the token mean matter
    {"messages": [_msg(USER, "Repeat: red cat"), _msg(ASSISTANT, "red cat")]},
    {"messages": [_msg(USER, "Repeat: sun moon tree"), _msg(ASSISTANT, "sun moon tree")]},
    {"messages": [_msg(USER, "Repeat: dog"), _msg(ASSISTANT, "dog dog dog dog fish")]},
]


def test_sft_loss_is_the_masked_cross_entropy_padded_and_packed(tiny):
    from common.data.sft import collate_sft
    from train_sft import sft_loss

    tok, model = tiny
    ex = _examples(tok, MIXED, input_key="messages", apply_chat_template=True)
    want, count = _naive_loss(model, ex)
    assert count == sum(sum(e.loss_mask[1:]) for e in ex)
    batch = collate_sft(ex, tok.pad_token_id)
    assert batch["attention_mask"].sum() < batch["attention_mask"].numel()  # there is padding
    with torch.no_grad():
        padded, nll = sft_loss(model, batch, count)
        packed, _ = sft_loss(model, batch, count, packing=True)
        # a step of two micro-batches: their shares add up to the step's token mean
        halves = sum(sft_loss(model, collate_sft(part, tok.pad_token_id), count)[0] for part in (ex[:1], ex[1:]))
    assert padded.item() == pytest.approx(want, abs=1e-5) and nll.item() / count == pytest.approx(want, abs=1e-5)
    assert packed.item() == pytest.approx(padded.item(), abs=1e-5)
    assert halves.item() == pytest.approx(want, abs=1e-5)
    # only the response and its eos: the prompt and the chat markup before it are not trained on
    assert [_trained_text(tok, e) for e in ex] == [["red cat<|im_end|>"], ["sun moon tree<|im_end|>"],
                                                    ["dog dog dog dog fish<|im_end|>"]]


def test_multiturn_trains_every_assistant_turn_and_nothing_else(tiny):
    tok, model = tiny
    conv = [_msg("system", "Be brief."), _msg(USER, "Repeat: red"), _msg(ASSISTANT, "red"),
            _msg(USER, "Repeat: cat dog"), _msg(ASSISTANT, "cat dog")]
    multi = _examples(tok, [{"messages": conv}], input_key="messages", apply_chat_template=True, multiturn=True)[0]
    last = _examples(tok, [{"messages": conv}], input_key="messages", apply_chat_template=True)[0]
    assert multi.ids == last.ids
    assert _trained_text(tok, multi) == ["red<|im_end|>", "cat dog<|im_end|>"]
    assert _trained_text(tok, last) == ["cat dog<|im_end|>"]
    # every other token (system, user turns, role headers, newlines) is out of the loss
    text = tok.decode([t for t, m in zip(multi.ids, multi.loss_mask) if not m])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nRepeat: red<|im_end|>\n"
                    "<|im_start|>assistant\n\n<|im_start|>user\nRepeat: cat dog<|im_end|>\n<|im_start|>assistant\n")
    from common.data.sft import collate_sft
    from train_sft import sft_loss

    want, count = _naive_loss(model, [multi])
    with torch.no_grad():
        got = sft_loss(model, collate_sft([multi], tok.pad_token_id), count)[0].item()
    assert got == pytest.approx(want, abs=1e-5)


def test_pretrain_mode_counts_every_token(tiny):
    from common.data.sft import collate_sft
    from train_sft import sft_loss

    tok, model = tiny
    rows = [{"input": "red cat sun moon"}, {"input": "tree fish"}]
    ex = _examples(tok, rows, pretrain_mode=True)
    assert all(all(e.loss_mask) for e in ex) and tok.decode(ex[0].ids) == "red cat sun moon"
    want, count = _naive_loss(model, ex)
    assert count == sum(len(e.ids) - 1 for e in ex)
    with torch.no_grad():
        assert sft_loss(model, collate_sft(ex, tok.pad_token_id), count)[0].item() == pytest.approx(want, abs=1e-5)


def test_row_layouts_give_the_same_sequence(tiny):
    tok, _ = tiny
    user, answer = "Repeat: red cat", "red cat"
    chat = dict(apply_chat_template=True)
    ref = _examples(tok, [{"messages": [_msg(USER, user), _msg(ASSISTANT, answer)]}], **chat)[0]  # TRL, detected
    same = [
        _examples(tok, [{"input": user, "output": answer}], output_key="output", **chat)[0],       # OpenRLHF, strings
        _examples(tok, [{"q": [_msg(USER, user)], "a": [_msg(ASSISTANT, answer)]}], input_key="q", output_key="a", **chat)[0],
        _examples(tok, [{"input": [_msg(USER, user), _msg(ASSISTANT, answer)]}], **chat)[0],        # a conversation
        _examples(tok, [{"prompt": user, "completion": answer}], **chat)[0],                       # TRL prompt-completion
    ]
    assert all((e.ids, e.loss_mask) == (ref.ids, ref.loss_mask) for e in same)
    plain = _examples(tok, [{"input": user, "output": answer}], output_key="output")[0]  # OpenRLHF's template
    assert tok.decode(plain.ids[:plain.prompt_len]) == f"User: {user}\nAssistant: "
    assert _trained_text(tok, plain) == [f"{answer}<|im_end|>"]
    bare = _examples(tok, [{"input": user, "output": answer}], output_key="output", input_template=None)[0]
    assert tok.decode(bare.ids[:bare.prompt_len]) == user


def test_long_rows_are_cut_with_eos_last_or_dropped(tiny):
    from common.errors import UserError
    from common.data.sft import SFTKeys, build_sft_examples

    tok, _ = tiny
    rows = [{"input": "red", "output": " ".join(["cat"] * 40)}, {"input": " ".join(["sun"] * 60), "output": "moon"},
            {"input": "dog", "output": "fish"}]
    ex, stats = build_sft_examples(rows, "d.jsonl", tok, SFTKeys(output_key="output", max_len=24))
    assert len(ex) == 2 and stats.dropped == 1 and stats.truncated == 1 and "d.jsonl, row 2" in stats.first_dropped
    assert len(ex[0].ids) == 24 and ex[0].ids[-1] == tok.eos_token_id and ex[0].loss_mask[-1] == 1
    with pytest.raises(UserError, match=r"d.jsonl: every prompt .* --max_len 24 \(the first: d.jsonl, row 1"):
        build_sft_examples(rows[1:2], "d.jsonl", tok, SFTKeys(output_key="output", max_len=24))


# ---- train_sft.py end to end

def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time", "perf")) and k != "time"} for r in rows]


def test_builtin_default_learns_the_copy_task(tmp_path):
    out = str(tmp_path / "sft")
    t0 = time.perf_counter()
    p = script("train_sft.py", "--save_path", out, timeout=600)
    took = time.perf_counter() - t0
    assert p.stdout.splitlines()[-3:] == [f"metrics: {out}/metrics.jsonl", f"curves: {out}/curves.png",
                                          f"model: {out}"], p.stdout[-2000:]  # the run's last lines
    rows = metrics(out)
    em = [(r["step"], r["eval/exact_match"]) for r in rows if "eval/exact_match" in r]
    assert em[0] == (0, 0.0), em  # an untrained model copies nothing
    # measured alone on 2 cores: 0.97-1.0 after 800 steps in ~60 s (seeds 1, 3, 42)
    assert em[-1][1] - em[0][1] >= 0.3 and em[-1][0] == 800, em
    assert rows[-1]["eval/loss"] < rows[0]["eval/loss"] / 4
    print(f"the built-in default ran in {took:.0f} s, startup included")  # a figure, not a bar: the box may be busy
    for name in ("metrics.jsonl", "config.json", "curves.png", "model.safetensors", "tokenizer.json"):
        assert os.path.exists(os.path.join(out, name)), name


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = str(tmp_path / "full")
    # two micro-batches a step: the shares' scaling through DeepSpeed's accumulation is part of what resumes
    flags = ["--max_steps", "6", "--save_steps", "3", "--eval_steps", "3", "--train_batch_size", "16",
             "--micro_train_batch_size", "8", "--max_samples", "200", "--max_len", "600"]
    p = script("train_sft.py", "--save_path", full, *flags, "--save_hf_ckpt")
    # --max_len above the tiny model's 512 positions is said (the built-in rows are far shorter: no other effect)
    assert "warning: --max_len 600 exceeds the model's 512 positions" in p.stdout, p.stdout[-3000:]
    assert os.path.isdir(os.path.join(full, "checkpoints", "step00000003"))
    # --save_hf_ckpt: a Hugging Face copy in each checkpoint
    assert os.path.exists(os.path.join(full, "checkpoints", "step00000003", "model", "hf", "config.json"))
    resumed = str(tmp_path / "resumed")
    script("train_sft.py", "--save_path", resumed, "--ckpt_path", os.path.join(full, "checkpoints"),
           "--load_checkpoint", *flags)
    a, b = _comparable(metrics(full)), _comparable(metrics(resumed))
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4, 5, 6] and [r["step"] for r in b] == [4, 5, 6]
    assert a[4:] == b  # bit-identical on CPU: same weights, optimizer, schedule, data position and RNG


def test_two_ranks_torchrun_zero3_packed(tmp_path):
    out = str(tmp_path / "sft2")
    run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", "29541", os.path.join(ROOT, "train_sft.py"), "--save_path", out, "--zero_stage", "3",
         "--packing_samples", "--max_steps", "12", "--eval_steps", "12", "--train_batch_size", "16",
         "--micro_train_batch_size", "4"], timeout=600)
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(13))
    assert rows[-1]["train/loss"] < rows[1]["train/loss"] - 1.0 and rows[-1]["eval/loss"] < rows[0]["eval/loss"]
    assert "eval/exact_match" in rows[-1]  # greedy generation ran on both ZeRO-3 shards
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # gathered from the two shards


@pytest.mark.parametrize("rows,flags,expect", [
    ([{"question": "Repeat: red", "answer": "red"}], ["--input_key", "question", "--output_key", "response"],
     ["data.jsonl, row 1", "'response' is missing", "--output_key"]),
    ([{"input": "Repeat: red", "output": "red"}, {"input": "Repeat: cat", "output": "  "}], ["--output_key", "output"],
     ["data.jsonl, row 2", "'output' is empty"]),
    ([{"input": "Repeat: " + " ".join(["red"] * 80), "output": "red"}], ["--output_key", "output", "--max_len", "32"],
     ["data.jsonl", "row 1", "--max_len 32"]),
    ([{"messages": [_msg(USER, "Repeat: red"), _msg(ASSISTANT, "")]}], ["--apply_chat_template"],
     ["data.jsonl, row 1", "response in 'messages' is empty"]),
])
def test_bad_sft_input_stops_with_one_clear_message(tmp_path, rows, flags, expect):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = script("train_sft.py", "--dataset", str(data), "--save_path", str(tmp_path / "out"), *flags, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.startswith("error: ") and all(e in p.stderr for e in expect), p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def _fifths(rows, key):
    vals = [r[key] for r in rows if key in r]
    k = max(1, len(vals) // 5)
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


def test_make_pipeline_runs_sft_then_rm_then_ppo(tmp_path):
    """OpenRLHF's workflow end to end: each stage reads the folder the one before wrote, and PPO against the
    reward model is healthy: the reward model's score rises on answers that are right by the task's own
    rule (rollout/exact_match), not on longer ones, and the KL to the SFT model stays bounded. Measured
    alone on 2 cores (make pipeline SEED=42, 7, 3, 2026-12-06): 2.8 min; exact match's fifths 0.27 -> 0.56,
    0.22 -> 0.56, 0.18 -> 0.65; held-out greedy answers (eval/exact_match) 0.82 -> 0.93, 0.81, 0.96; KL
    at most 0.45, 0.94, 0.22. Before the Makefile's fix: the reward 0.30 -> 0.80 with every answer at
    --generate_max_len and KL 4.9."""
    from common.rl.eval import KL_WARN, TRUNCATED_WARN

    out = tmp_path / "pipeline"
    # -o: the suite runs inside the installed venv; a test never reinstalls it
    p = run(["make", "-o", ".venv/.installed", "pipeline", f"PIPELINE_DIR={out}"], timeout=600)
    for stage in ("sft", "rm", "ppo"):
        assert metrics(str(out / stage)) and os.path.exists(out / stage / "model.safetensors"), stage
    options = {s: json.load(open(out / s / "config.json"))["hybridrl"] for s in ("rm", "ppo")}
    assert options["rm"]["pretrain"] == str(out / "sft")
    assert (options["ppo"]["pretrain"], options["ppo"]["reward_pretrain"]) == (str(out / "sft"), str(out / "rm"))
    rows = metrics(str(out / "ppo"))
    reward, exact = _fifths(rows, "rollout/reward_mean"), _fifths(rows, "rollout/exact_match")
    assert reward[1] > reward[0] and exact[1] - exact[0] >= 0.1, (reward, exact)
    truncated = [r["rollout/truncated_frac"] for r in rows if "rollout/truncated_frac" in r]
    kl = [r["train/kl"] for r in rows if "train/kl" in r]
    # at no step: the answers stay 2-3 words, and the KL under the bound (0.22-0.94 at most, seeds above)
    assert max(truncated) < TRUNCATED_WARN / 2 and max(kl) < KL_WARN, (truncated, kl)
    # the run's own verdict over its last fifth, in its last line and its summary: nothing ran away
    health = rows[-1]
    assert health["health/truncation_warning"] == health["health/kl_warning"] == 0.0, health
    assert health["health/kl"] < KL_WARN and health["health/truncated_frac"] < TRUNCATED_WARN
    assert "summary (the first and last 4 steps): rollout/reward_mean" in p.stdout and "run summary:" not in p.stdout
    # evaluated from step 0 on: the held-out answers stay right as the policy moves
    evals = [(r["step"], r["eval/exact_match"]) for r in rows if "eval/exact_match" in r]
    assert [s for s, _ in evals] == [0, 8, 16, 24] and evals[-1][1] >= evals[0][1] - 0.1, evals
