"""Datasets for the training scripts: rows from files or the hub, and a resumable batch order.

Every problem the user can fix raises `UserError` naming the file and the 1-based line (JSON lines)
or row (everything else, and the `build_*` functions, where row N is the N-th row that loaded).
Prompts for online RL (`build_prompts`) live in `common/data/prompts.py` (re-exported here), preference
pairs for the reward model and DPO in `common/data/preferences.py`.

`datasets`, `pyarrow` and `torch` are imported inside the functions that need them, so importing
this module stays cheap.
"""
from __future__ import annotations

import csv
import json
import os
import random
from typing import Any, Iterator

from common.errors import UserError
from common.data.prompts import PromptExample, build_prompts, keys_of, type_name
from common.errors import one_line

__all__ = ["load_rows", "PromptExample", "build_prompts", "epoch_order", "iterate_batches"]

_JSON_CONTAINER_KEYS = ("data", "train")


def load_rows(source: str, *, split: str = "train", max_samples: int | None = None,
              data_dir: str | None = None) -> list[dict]:
    """Rows of a .jsonl/.json/.parquet/.csv file, a `save_to_disk` folder, or a hub dataset id.

    `max_samples` keeps the first N rows (files are read only that far where the format allows);
    `data_dir` is `datasets.load_dataset`'s, for a hub id or a folder of data files (OpenRLHF's
    `name@data_dir`). Several sources mixed into one: `common.data.blend`.
    """
    if os.path.isfile(source):
        ext = os.path.splitext(source)[1].lower()
        readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet,
                   ".csv": _read_csv}
        if ext not in readers:
            raise UserError(f"{source}: unknown file type '{ext}'; use .jsonl, .json, .parquet or "
                            ".csv, a folder written by datasets' save_to_disk, or a hub dataset id")
        try:
            rows = readers[ext](source, split, max_samples)
        except UnicodeDecodeError as e:
            raise UserError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    elif os.path.isdir(source):
        rows = _read_folder(source, split, max_samples, data_dir)
    elif os.path.splitext(source)[1].lower() in (".jsonl", ".json", ".parquet", ".csv"):
        raise UserError(f"{source}: file not found")
    elif source.startswith(("/", ".", "~")) or source.count("/") > 1:  # hub ids are "org/name"
        raise UserError(f"{source}: no such file or folder (and not a hub id like 'org/name')")
    else:
        rows = _read_hub(source, split, max_samples, data_dir=data_dir)
    if max_samples is not None:
        rows = rows[:max_samples]
    if not rows:
        raise UserError(f"{source}: no rows")
    return rows


def _read_jsonl(path: str, split: str, max_samples: int | None) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            if max_samples is not None and len(rows) >= max_samples:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}, line {lineno}: not valid JSON "
                                f"({e.msg}, column {e.colno})") from None
            _check_object(row, f"{path}, line {lineno}")
            rows.append(row)
    return rows


def _read_json(path: str, split: str, max_samples: int | None) -> list[dict]:
    with open(path, encoding="utf-8-sig") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines saved under a .json name: a common mix-up
            return _read_jsonl(path, split, max_samples)
        raise UserError(f"{path}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno})") \
            from None
    if isinstance(data, dict):
        for key in (split, *_JSON_CONTAINER_KEYS):  # the asked-for split first: {"train": .., "test": ..}
            if isinstance(data.get(key), list):
                data = data[key]
                break
        else:
            raise UserError(f"{path}: expected a list of objects, or an object with the list "
                            f"under 'data', 'train' or '{split}'; found keys {keys_of(data)}")
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of objects, got {type_name(data)}")
    for i, row in enumerate(data, start=1):
        _check_object(row, f"{path}, row {i}")
    return data


def _read_parquet(path: str, split: str, max_samples: int | None) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise UserError(f"{path}: cannot read as Parquet ({one_line(e)})") from None
    if max_samples is not None:
        table = table.slice(0, max_samples)
    return table.to_pylist()


def _read_csv(path: str, split: str, max_samples: int | None) -> list[dict]:
    # Python's csv keeps every cell a string, so a column of digits stays text; numeric fields
    # (margin) accept numeric strings for this reason.
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        rows = []
        for i, row in enumerate(reader, start=1):
            if max_samples is not None and len(rows) >= max_samples:
                break
            if None in row:
                raise UserError(f"{path}, row {i}: more cells than header columns "
                                f"{reader.fieldnames}")
            rows.append(row)
    return rows


def _read_folder(path: str, split: str, max_samples: int | None, data_dir: str | None = None) -> list[dict]:
    import datasets

    saved = any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))
    if not saved:  # a folder of data files: let `datasets` pick the builder
        return _read_hub(path, split, max_samples, local=True, data_dir=data_dir)
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # a half-copied folder fails in many ways inside `datasets`
        raise UserError(f"{path}: cannot load this save_to_disk folder ({one_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"{path}: no split '{split}'; the saved splits are {sorted(ds)}")
        ds = ds[split]
    return _to_rows(ds, max_samples)


def _read_hub(source: str, split: str, max_samples: int | None, local: bool = False,
              data_dir: str | None = None) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split, data_dir=data_dir)
    except Exception as e:  # offline, unknown id, unknown split, bad files: all end the same way
        where = ("exists but `datasets` cannot load it" if local else
                 "does not exist locally and could not be fetched from the hub")
        raise UserError(f"{source}: {where} ({one_line(e)})") from None
    return _to_rows(ds, max_samples)


def _to_rows(ds, max_samples: int | None) -> list[dict]:
    if max_samples is not None and max_samples < len(ds):
        ds = ds.select(range(max_samples))
    return ds.to_list()


def _check_object(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object ({{\"key\": value, ...}}), "
                        f"got {type_name(row)}")


# ---- resumable data order ----------------------------------------------------------------------

def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """A permutation of range(n) fixed by (seed, epoch): a resumed run can rebuild its order."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def iterate_batches(n: int, batch_size: int, seed: int, start_epoch: int = 0, start_step: int = 0,
                    drop_last: bool = True) -> Iterator[tuple[int, int, list[int]]]:
    """Yield (epoch, step_in_epoch, indices) forever, starting at (start_epoch, start_step).

    With drop_last the last partial batch of each epoch is skipped; otherwise it is yielded short.
    """
    steps = (n // batch_size if drop_last else -(-n // batch_size)) if batch_size > 0 else 0
    if steps == 0:
        raise UserError(f"{n} samples do not fill one batch of {batch_size}; use more data or a "
                        "smaller batch size")
    if not 0 <= start_step < steps:
        raise ValueError(f"start_step {start_step} is outside an epoch of {steps} steps")
    epoch, step = start_epoch, start_step
    while True:
        order = epoch_order(n, seed, epoch)
        for s in range(step, steps):
            yield epoch, s, order[s * batch_size:(s + 1) * batch_size]
        epoch, step = epoch + 1, 0
