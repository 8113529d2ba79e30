"""The built-in synthetic task, "copy words": what every script trains on when given no data flags.

A prompt asks the model to repeat k (2 or 3) short words; the answer is the same words joined by
single spaces. The reward is the fraction of positions copied right, so it is dense enough for RL on
a tiny model to show progress within a few steps, and a "rejected" answer with one wrong word gives
preference pairs whose correct side is unambiguous.

Train and eval prompts are split by a hash of the word tuple (about 10% of tuples are eval), so an
eval prompt never appears in train, in any row kind and for any seed.

Pure Python on purpose: option parsing and data loading import this module without torch.
"""
from __future__ import annotations

import hashlib
import random

WORDS: tuple[str, ...] = (
    "red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "star", "rain",
    "milk", "road", "ship", "king", "lamp", "door", "rock", "leaf", "bell", "coin", "fire", "snow",
)
MIN_WORDS, MAX_WORDS = 2, 3
EVAL_FRACTION = 0.1
_SPLITS = ("train", "eval")


def copy_reward(completion: str, label: str) -> float:
    """Fraction of word positions where `completion` matches `label`, in [0, 1].

    Dividing by the longer of the two lengths penalises both missing words and extra words, so
    padding an answer with guesses never helps.
    """
    got, want = completion.strip().split(), label.strip().split()
    if not got or not want:
        return 0.0
    hits = sum(a == b for a, b in zip(got, want))
    return hits / max(len(got), len(want))


def reward_func(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """Batched `copy_reward`; the same signature a user's `--reward_func` file must define.

    prompts: [B] rendered prompts (unused here), completions: [B] generated texts, labels: [B].
    """
    if not (len(prompts) == len(completions) == len(labels)):
        raise ValueError(
            f"reward_func got {len(prompts)} prompts, {len(completions)} completions and "
            f"{len(labels)} labels; they must have one entry per sample"
        )
    return [copy_reward(c, y) for c, y in zip(completions, labels)]


def _split_of(words: tuple[str, ...]) -> str:
    # hashlib, not hash(): Python's str hash is salted per process, and every process (ranks, Ray
    # actors, a later eval run) must agree on the split.
    digest = hashlib.sha256(" ".join(words).encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < EVAL_FRACTION else "train"


def _sample_words(rng: random.Random, split: str) -> tuple[str, ...]:
    """Words of one prompt from `split`, by rejection (about 10 draws per eval tuple)."""
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    while True:
        k = rng.randint(MIN_WORDS, MAX_WORDS)
        words = tuple(rng.choice(WORDS) for _ in range(k))
        if _split_of(words) == split:
            return words


def _rng(kind: str, split: str, seed: int) -> random.Random:
    # A string seed is hashed deterministically (sha512) by random.Random, so each (kind, split,
    # seed) gets its own stream and the train and eval rows of one seed are unrelated.
    return random.Random(f"copy-words/{kind}/{split}/{seed}")


def user_text(words: tuple[str, ...] | list[str]) -> str:
    return f"Repeat: {' '.join(words)}"


def prompt_rows(n: int, split: str = "train", seed: int = 0) -> list[dict]:
    """`n` prompt rows `{"prompt": [user message], "label": "w1 w2 ..."}` for RL and evaluation."""
    rng = _rng("prompt", split, seed)
    rows = []
    for _ in range(n):
        words = _sample_words(rng, split)
        rows.append({
            "prompt": [{"role": "user", "content": user_text(words)}],
            "label": " ".join(words),
        })
    return rows


def preference_rows(n: int, split: str = "train", seed: int = 0) -> list[dict]:
    """`n` rows `{"chosen": [user, assistant], "rejected": [user, assistant]}` (OpenRLHF format).

    chosen is the exact copy; rejected has exactly one word swapped for a different word of WORDS.
    """
    rng = _rng("preference", split, seed)
    rows = []
    for _ in range(n):
        words = _sample_words(rng, split)
        wrong = list(words)
        i = rng.randrange(len(words))
        wrong[i] = rng.choice([w for w in WORDS if w != words[i]])
        user = {"role": "user", "content": user_text(words)}
        rows.append({
            "chosen": [user, {"role": "assistant", "content": " ".join(words)}],
            "rejected": [dict(user), {"role": "assistant", "content": " ".join(wrong)}],
        })
    return rows


def sft_rows(n: int, split: str = "train", seed: int = 0) -> list[dict]:
    """`n` rows `{"messages": [user, assistant]}` (TRL's conversational SFT format), the assistant
    turn the exact copy, for train_sft.py; `split` "eval" rows are held-out tuples only."""
    rng = _rng("sft", split, seed)
    rows = []
    for _ in range(n):
        words = _sample_words(rng, split)
        rows.append({"messages": [{"role": "user", "content": user_text(words)},
                                  {"role": "assistant", "content": " ".join(words)}]})
    return rows


def pretrain_texts(n: int, seed: int, p_correct: float = 0.4) -> list[tuple[str, str]]:
    """`n` (user text, assistant text) pairs for the tiny base model, from train tuples only.

    Each answer word is right with probability `p_correct`, else a uniform draw from WORDS (which is
    right 1/24 of the time), so the base model learns the format and a weak copy skill that RL and
    preference training can sharpen.
    """
    rng = _rng("pretrain", "train", seed)
    pairs = []
    for _ in range(n):
        words = _sample_words(rng, "train")
        answer = [w if rng.random() < p_correct else rng.choice(WORDS) for w in words]
        pairs.append((user_text(words), " ".join(answer)))
    return pairs
