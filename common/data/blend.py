"""Several datasets as one: OpenRLHF's comma-separated `--dataset a,b` / `--prompt_data a,b`, mixed
with `--dataset_probs` / `--prompt_data_probs` or concatenated without them.

OpenRLHF (`blending_datasets`) reads each source (`path` or `path@data_dir`), keeps the split named
by `--dataset_split` where the source has splits, keeps its first `--max_samples` rows, then
- without probabilities: concatenates the sources in order;
- with probabilities: `datasets.interleave_datasets(probabilities, seed=--seed,
  stopping_strategy="all_exhausted")`: each row of the mixture comes from a source drawn at random
  with those probabilities, which gives its next row (starting over once used up), until every
  source has been used up at least once; so the mixture has at least as many rows as the largest
  source divided by its probability, and the small sources repeat.
and finally keeps the first `--max_samples` rows of the result. `blend_order` reproduces the draws
row for row (numpy's `default_rng(seed)`, drawn in blocks of 1000 as `datasets` does), on plain
rows: the sources need not share their columns, where `datasets` would refuse to mix them.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from common.errors import UserError

_FILE_EXTS = (".jsonl", ".parquet", ".csv", ".arrow")


@dataclass(frozen=True)
class DataFlags:
    """The spellings of a script's data flags, for messages: e.g. ("--prompt_data", ...)."""
    data: str = "--dataset"
    probs: str = "--dataset_probs"
    split: str = "--dataset_split"


PREFERENCE_FLAGS = DataFlags()
PROMPT_FLAGS = DataFlags("--prompt_data", "--prompt_data_probs", "--prompt_split")
EVAL_FLAGS = DataFlags("--eval_dataset", "", "--eval_split")


def parse_sources(spec: str, flags: DataFlags = PREFERENCE_FLAGS) -> list[tuple[str, str | None]]:
    """'a.jsonl, org/name@subdir' -> [("a.jsonl", None), ("org/name", "subdir")] (OpenRLHF's `@data_dir`)."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise UserError(f"{flags.data} {spec!r}: an empty name between commas; give comma-separated "
                            "files, folders or hub ids")
        # A path that exists keeps its '@'; otherwise 'name@dir' is a hub id or folder with a data_dir.
        if "@" in part and not os.path.exists(part):
            name, data_dir = (s.strip() for s in part.split("@", 1))
            out.append((name, data_dir or None))
        else:
            out.append((part, None))
    return out


def parse_probs(spec: str | None, n: int, flags: DataFlags = PREFERENCE_FLAGS) -> list[float] | None:
    """'0.7,0.3' -> [0.7, 0.3], checked: one per source, each > 0, summing to 1 (as numpy requires)."""
    if spec is None:
        return None
    try:
        probs = [float(p) for p in spec.split(",")]
    except ValueError:
        raise UserError(f"{flags.probs} {spec!r}: expected comma-separated numbers like 0.7,0.3") from None
    if len(probs) != n:
        raise UserError(f"{flags.probs} {spec!r} gives {len(probs)} probabilities for {n} source(s) in "
                        f"{flags.data}; give one per source")
    if not all(math.isfinite(p) and p > 0 for p in probs):
        # datasets refuses a 0 under "all_exhausted": a source never drawn is never used up.
        raise UserError(f"{flags.probs} {spec!r}: every probability must be > 0 (drop a source from "
                        f"{flags.data} instead of giving it 0)")
    if abs(math.fsum(probs) - 1.0) > 1.5e-8:  # numpy's tolerance: sqrt of the float64 epsilon
        raise UserError(f"{flags.probs} {spec!r} sums to {math.fsum(probs):g}; the probabilities must sum to 1")
    return probs


def blend_order(lengths: list[int], probs: list[float], seed: int) -> list[tuple[int, int]]:
    """(source, row) of each row of the mixture, in the order `datasets.interleave_datasets` gives."""
    import numpy as np

    rng = np.random.default_rng(seed)
    used, order, left = [0] * len(lengths), [], sum(1 for n in lengths if n > 0)
    if left < len(lengths):
        raise ValueError(f"every source needs rows, got lengths {lengths}")
    while True:
        for s in rng.choice(len(lengths), size=1000, p=probs).tolist():
            order.append((s, used[s] % lengths[s]))
            used[s] += 1
            if used[s] == lengths[s]:
                left -= 1
                if left == 0:
                    return order


def load_mixture(spec: str, probs: str | None = None, *, split: str = "train", default_split: str = "train",
                 max_samples: int | None = None, seed: int = 42,
                 flags: DataFlags = PREFERENCE_FLAGS) -> tuple[list[dict], str]:
    """(rows, description for the banner) of the comma-separated sources in `spec`."""
    from common.data.rows import load_rows

    sources = parse_sources(spec, flags)
    p = parse_probs(probs, len(sources), flags)
    tables = []
    for path, data_dir in sources:
        if split != default_split and os.path.isfile(path) and path.lower().endswith(_FILE_EXTS):
            raise UserError(f"{flags.split} {split}: {path} is a single file, which has no splits; drop "
                            f"{flags.split}, or give a datasets folder or hub id that has a '{split}' split")
        tables.append(load_rows(path, split=split, max_samples=max_samples, data_dir=data_dir))
    if len(tables) == 1:
        return tables[0], spec
    parts = " + ".join(f"{path} ({len(t)})" for (path, _), t in zip(sources, tables))
    if p is None:
        rows, how = [r for t in tables for r in t], "concatenated"
    else:
        rows = [tables[s][i] for s, i in blend_order([len(t) for t in tables], p, seed)]
        how = f"mixed {'/'.join(f'{x:g}' for x in p)}, seed {seed}"
    if max_samples is not None:
        rows = rows[:max_samples]
    return rows, f"{parts}, {how}: {len(rows)} rows"
