"""The built-in tiny model: what `--pretrain` defaults to, so every script runs with no downloads.

A 4-layer Qwen2 (hidden 128, 4 heads of dim 32, 2 KV heads, ~0.8 M parameters) with its own
512-token byte-level BPE, briefly pre-trained (loss on the answer tokens) on exact copies, then on
the copy-words corpus of `common.data.tasks` in which each answer word is right 40% of the time. The
result answers in the right format (k words then `<|im_end|>`) and copies each word with
probability ~0.4: a weak base that GRPO/PPO and DPO can visibly sharpen within a few CPU steps.

Head dim 32 because vLLM's CPU attention backend needs head_size >= 32. The tokenizer is filled up
to exactly 512 ids with `<|reserved_i|>` specials so that every id the model can sample decodes
(engines and detokenizers choke on ids past the tokenizer's end).

Measured on the 2-core dev CPU (shared with other jobs): the build (tokenizer, 200 training
steps, save; transformers import included) takes 17-22 s. Temperature-1 samples on 64 eval prompts
(`sample_copy_reward`, seed 0) have mean `copy_reward` 0.354 (0.37 on 256 eval prompts, 0.39 on 256
train prompts), and 100% end with `<|im_end|>`; greedy decoding copies perfectly (1.0), since the
right word is the single most likely one at ~0.4.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

from common.data import tasks

TINY_VERSION = "v1"
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SEED = 1234
PRETRAIN_ROWS = 8192
# (p_correct, steps): exact copies first, then the 40%-correct corpus. Measured: on the 40% corpus
# alone the copy skill never appears in 600 steps (its signal is too weak to find the circuit),
# while exact copies teach it in ~75; the second phase only recalibrates the model's trust in it.
# The loss covers the assistant turn only: with full-sequence loss the unpredictable prompt words
# (ln 24 nats each) swamp the gradient and even exact copies needed ~250 steps to reach 0.38.
PHASES = ((1.0, 120), (0.4, 80))
BATCH_SIZE = 64
LR = 3e-3


def _render(user: str, assistant: str) -> str:
    """The chat template applied to one exchange, in plain Python (before the tokenizer exists)."""
    return f"{_render_prompt(user)}{assistant}<|im_end|>\n"


def _render_prompt(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def tiny_model_dir(cache_dir: str | None = None) -> str:
    """Where the tiny model lives (built or not): `${HYBRIDRL_CACHE:-~/.cache/hybridrl}/tiny-v1`."""
    root = cache_dir or os.environ.get("HYBRIDRL_CACHE") or os.path.join("~", ".cache", "hybridrl")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), f"tiny-{TINY_VERSION}")


def tiny_model_path(cache_dir: str | None = None) -> str:
    """Path of a Hugging Face model + tokenizer folder with the tiny model, building it if absent.

    Safe under concurrency (torchrun ranks, pytest workers, Ray actors): the first caller builds
    into a temporary folder under an exclusive flock and publishes it with one atomic rename; the
    others wait on the lock and reuse it. A folder left by a killed builder is never the published one.
    """
    final = tiny_model_dir(cache_dir)
    if os.path.isdir(final):  # only the rename below creates it, so it is complete
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    fd = os.open(final + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel even if this process is killed
        if os.path.isdir(final):
            return final
        prefix = f".tiny-{TINY_VERSION}.tmp-"
        # Holding the lock, any temporary folder is debris from a killed build.
        for name in os.listdir(parent):
            if name.startswith(prefix):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
        try:
            _build(tmp)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final
    finally:
        os.close(fd)


def _build_tokenizer(texts: list[str]):
    """Byte-level BPE trained on `texts`, wrapped for transformers; exactly VOCAB_SIZE ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    # AutoTokenizer (and so vLLM) loads any model_type "qwen2" folder as Qwen2Tokenizer, which
    # rebuilds the pipeline from vocab + merges with Qwen's normalizer and split regex; training
    # with that same pipeline makes tokenizer.json and the rebuilt tokenizer encode identically.
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
    )
    # The special tokens are cut out of the training text so no merge ever spans one of them.
    pieces = [p for t in texts for p in _split_specials(t) if p]
    bpe.train_from_iterator(pieces, trainer)
    # The corpus runs out of merges before 512 ids; reserved specials fill the rest.
    n_reserved = VOCAB_SIZE - bpe.get_vocab_size()
    bpe.add_special_tokens([f"<|reserved_{i}|>" for i in range(n_reserved)])
    assert bpe.get_vocab_size() == VOCAB_SIZE, bpe.get_vocab_size()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|pad|>", additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE, model_max_length=512,
    )
    for w in tasks.WORDS:
        for form in (w, " " + w):
            n = len(tok.encode(form, add_special_tokens=False))
            assert n <= 2, f"tiny tokenizer splits {form!r} into {n} tokens"
    return tok


def _split_specials(text: str) -> list[str]:
    for s in SPECIAL_TOKENS:
        text = text.replace(s, "\0")
    return text.split("\0")


def _tensors(tok, pairs: list[tuple[str, str]]):
    """Right-padded `input_ids, attention_mask, labels: [N, T]`; labels cover the assistant turn."""
    import torch

    rows = []
    for user, answer in pairs:
        full = tok.encode(_render(user, answer), add_special_tokens=False)
        prompt = tok.encode(_render_prompt(user), add_special_tokens=False)
        assert full[: len(prompt)] == prompt  # specials and "\n" end pre-tokens: a clean cut
        rows.append((full, len(prompt)))
    T = max(len(full) for full, _ in rows)
    input_ids = torch.full((len(rows), T), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    for i, (full, n_prompt) in enumerate(rows):
        input_ids[i, : len(full)] = torch.tensor(full)
        labels[i, n_prompt: len(full)] = torch.tensor(full[n_prompt:])
    return input_ids, input_ids != tok.pad_token_id, labels


def _build(out_dir: str) -> None:
    """Train the tokenizer and the model, save both into `out_dir` (prints nothing)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    phases = [tasks.pretrain_texts(PRETRAIN_ROWS, seed=SEED + i, p_correct=p)
              for i, (p, _) in enumerate(PHASES)]
    tok = _build_tokenizer([_render(u, a) for pairs in phases for u, a in pairs])
    data = [_tensors(tok, pairs) for pairs in phases]

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    total = sum(n for _, n in PHASES)
    # fork_rng: the caller's global torch RNG (a training run's seed) is left as it was.
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = Qwen2ForCausalLM(config)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.98))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / total))
        g = torch.Generator().manual_seed(SEED)
        for (input_ids, attention_mask, labels), (_, steps) in zip(data, PHASES):
            for _ in range(steps):
                idx = torch.randint(len(input_ids), (BATCH_SIZE,), generator=g)
                out = model(input_ids=input_ids[idx], attention_mask=attention_mask[idx],
                            labels=labels[idx])
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the caller prints; a library build stays quiet
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
        tok.save_pretrained(out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def sample_copy_reward(model, tokenizer, rows: list[dict], seed: int = 0,
                       temperature: float = 1.0) -> tuple[float, float]:
    """Mean `copy_reward` and fraction ending in `<|im_end|>` of one sample per row (HF generate).

    A small evaluation used to document and test the base model: rows from `tasks.prompt_rows`.
    """
    import torch

    prompts = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues from the last column
    try:
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(**batch, do_sample=temperature > 0, temperature=temperature or None,
                             max_new_tokens=12)
    new = out[:, batch["input_ids"].shape[1]:]
    rewards, ended = [], 0
    for r, seq in zip(rows, new.tolist()):
        ended += tokenizer.eos_token_id in seq
        text = tokenizer.decode(seq, skip_special_tokens=True)
        rewards.append(tasks.copy_reward(text, r["label"]))
    return sum(rewards) / len(rewards), ended / len(rows)


if __name__ == "__main__":  # measure: python -m common.training.tiny [cache_dir]
    import sys
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    path = tiny_model_path(sys.argv[1] if len(sys.argv) > 1 else None)
    print(f"path {path}  build_s {time.perf_counter() - t0:.1f}")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    for greedy in (False, True):
        mean, fmt = sample_copy_reward(model, tok, tasks.prompt_rows(64, "eval"),
                                       temperature=0.0 if greedy else 1.0)
        print(f"{'greedy' if greedy else 'T=1'}: copy_reward {mean:.3f}  ends_with_eos {fmt:.2f}")
