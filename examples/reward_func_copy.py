"""Example `--reward_func` file: scores the built-in copy task ("Repeat: red cat" -> "red cat").

Use it as `python train_grpo.py ... --reward_func examples/reward_func_copy.py`, or copy it and
change `reward_func` for your own task. The contract:

    def reward_func(prompts: list[str], completions: list[str], labels: list[str | None]) -> list[float]

- It is called once per batch (batched), not once per sample: the three lists have the same length
  B and entry i of each belongs to sample i.
- prompts are the prompt texts the completions answer; completions are the
  generated texts only (without the prompt); labels come from the dataset column named by
  `--label_key` (None where a row has no label).
- Return exactly one finite float per completion, in the same order. A wrong count, a NaN or a
  non-number stops training with a message naming the prompt (or drops that sample, where the
  script is told to skip bad rewards). A call that takes longer than the timeout is reported as hung.
- The file is imported once; put expensive setup (loading a word list, compiling regexes) at module
  level. It must not import from this repository, so it keeps working when copied elsewhere.
"""
from __future__ import annotations


def copy_score(completion: str, label: str | None) -> float:
    """Fraction of words in the right position: matches / the longer of the two lengths, in [0, 1].

    Dividing by the longer length means extra guessed words cost as much as missing ones.
    """
    got = completion.split()
    want = (label or "").split()
    if not got or not want:
        return 0.0
    hits = sum(a == b for a, b in zip(got, want))
    return hits / max(len(got), len(want))


def reward_func(prompts: list[str], completions: list[str], labels: list[str | None]) -> list[float]:
    # The prompt is not needed here: the label already holds the words to repeat.
    return [copy_score(c, y) for c, y in zip(completions, labels)]
