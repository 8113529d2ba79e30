"""Rule-based and remote rewards for online RL: a `--reward_func` Python file or a `--remote_rm_url` server.

Both sources score a whole batch at once and go through one check, `validate_scores`: exactly one
finite number per completion, else a `UserError` naming the prompt. With `skip_bad=True` a bad entry
becomes `None` and is counted instead, so the script can drop those samples and log how many.

Pure Python (no torch): option parsing may import this module to check the file early.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import math
import numbers
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import requests

from common.errors import UserError

RewardFn = Callable[[list[str], list[str], list["str | None"]], list[float]]

_module_ids = itertools.count()


def _last_line(e: BaseException) -> str:
    """`'ValueError: boom'`: the line Python prints last for `e`, with the line number of a SyntaxError."""
    line = traceback.format_exception_only(type(e), e)[-1].strip()
    if isinstance(e, SyntaxError) and e.lineno is not None:
        line += f" (line {e.lineno})"
    return line


def _show(prompt: str) -> str:
    return repr(prompt[:80])


def load_reward_func(path: str) -> RewardFn:
    """Import the Python file `path` and return its `reward_func(prompts, completions, labels)`.

    The module is registered in `sys.modules` only while it runs: dataclasses and pickle need it
    there during import, but once removed cloudpickle ships the function to Ray workers by value,
    where the unique module name would not be importable.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        where = "is a folder" if file.is_dir() else "does not exist"
        raise UserError(f"--reward_func {path}: the file {where}; pass a .py file that defines "
                        f"reward_func(prompts, completions, labels) -> list[float]")
    name = f"hybridrl_reward_func_{next(_module_ids)}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise UserError(f"--reward_func {path}: cannot import this file as Python (use a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # SystemExit: a stray sys.exit() or argparse in the file
        raise UserError(f"--reward_func {path}: importing the file failed: {_last_line(e)}") from e
    finally:
        sys.modules.pop(name, None)
    fn = getattr(module, "reward_func", None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == name)
        has = f"it defines {', '.join(found)}" if found else "it defines no functions"
        if fn is not None:
            has = f"reward_func is a {type(fn).__name__}, not a function; {has}"
        raise UserError(f"--reward_func {path}: no function named reward_func ({has}); define "
                        f"reward_func(prompts, completions, labels) -> list[float]")
    return fn


def _as_float(x) -> float | None:
    """`x` as a float, or None when it is not a real number (str, None, complex, a list...)."""
    if isinstance(x, (str, bytes)) or x is None:
        return None
    if isinstance(x, numbers.Real):
        return float(x)
    try:  # numpy scalars and 0-d arrays/tensors have __float__; a list or a 2-element array do not
        return float(x)
    except (TypeError, ValueError):
        return None


def validate_scores(scores, prompts: list[str], source: str, skip_bad: bool, *,
                    offset: int = 0) -> tuple[list[float | None], int]:
    """Check one reply of a reward source: one finite number per prompt.

    scores: what the source returned, should be [B] numbers (list, tuple, numpy array...);
    prompts: [B], used to name the culprit; `offset` is the index of prompts[0] in the whole batch.
    Returns ([B] floats, with None where bad and `skip_bad`, the number of those None).
    A wrong count or a non-sequence raises even with `skip_bad`: no score can be mapped to a sample.
    """
    first = f"the batch starting with prompt {offset} {_show(prompts[0])}" if prompts else "an empty batch"
    passed = None
    if isinstance(scores, Mapping) and "rewards" in scores:  # {"rewards": [...], "pass": [...]}: pass@k's verdicts
        passed = scores.get("pass")
        if passed is not None and len(passed) != len(prompts):
            raise UserError(f"{source} returned {len(passed)} 'pass' values for {len(prompts)} completions (for {first})")
        scores = scores["rewards"]
    try:
        if isinstance(scores, (str, bytes, Mapping)):
            raise TypeError
        values = list(scores)
    except TypeError:
        raise UserError(f"{source} returned {type(scores).__name__} instead of a list of "
                        f"{len(prompts)} numbers (for {first})") from None
    if len(values) != len(prompts):
        raise UserError(f"{source} returned {len(values)} scores for {len(prompts)} completions "
                        f"(for {first}); return exactly one float per completion, in order")
    out: list[float | None] = []
    bad: list[tuple[int, str]] = []
    for i, v in enumerate(values):
        f = _as_float(v)
        if f is None:
            bad.append((i, f"a non-number {v!r:.40}"))
        elif not math.isfinite(f):
            bad.append((i, f"{f}"))
            f = None
        out.append(f)
    if bad and not skip_bad:
        i, what = bad[0]
        more = f" ({len(bad)} bad scores in this batch)" if len(bad) > 1 else ""
        raise UserError(f"{source} returned {what} at index {offset + i}, for prompt {offset + i} "
                        f"{_show(prompts[i])}{more}; return a finite float for every completion, "
                        "or pass --skip_bad_rewards to drop such samples")
    return (Scores(out, [bool(p) for p in passed]) if passed is not None else out), len(bad)


class Scores(list):
    """A reward source's scores with its own pass/fail verdict per sample (`passed`, for pass@k)."""

    def __init__(self, values, passed: list[bool]):
        super().__init__(values)
        self.passed = passed


def _fn_source(fn) -> str:
    code = getattr(fn, "__code__", None)
    return f"--reward_func {code.co_filename}" if code is not None else f"--reward_func {fn!r}"


def score_with_function(fn: RewardFn, prompts: list[str], completions: list[str],
                        labels: list[str | None], *, timeout_s: float = 60.0,
                        skip_bad: bool = False) -> tuple[list[float | None], int]:
    """Score the whole batch with one call `fn(prompts, completions, labels)`.

    prompts, completions, labels: [B]. Returns ([B] scores, number skipped).
    The call runs in a daemon thread so a hung function times out after `timeout_s`. Python cannot
    kill a thread: a timed-out call is abandoned and keeps running (and holding what it holds) in the
    background; being a daemon, it does not block the process from exiting.
    With `skip_bad`, an exception or a timeout makes the whole batch None instead of raising.
    """
    source = _fn_source(fn)
    n = len(prompts)
    first = f"the batch starting with prompt 0 {_show(prompts[0])}" if prompts else "an empty batch"
    box: dict = {}

    def call():
        try:  # copies: the user's function may mutate its arguments
            box["scores"] = fn(list(prompts), list(completions), list(labels))
        except BaseException as e:  # noqa: BLE001 - reported to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=call, name="reward_func", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        if skip_bad:
            return [None] * n, n
        raise UserError(f"{source} did not return within {timeout_s:g} s (--reward_timeout) for {first} "
                        f"({n} completions); make it faster or raise --reward_timeout")
    if "error" in box:
        e = box["error"]
        if skip_bad:
            return [None] * n, n
        raise UserError(f"{source} raised {type(e).__name__}: {e} (for {first}, {n} completions)") from e
    return validate_scores(box["scores"], prompts, source, skip_bad)


class RemoteReward:
    """Client of an HTTP reward server: POST {"prompts", "completions", "labels"} -> {"rewards": [...]}.

    A bare JSON list is accepted as the reply too. Requests go in batches of `batch_size`; connection
    errors, timeouts and HTTP 5xx are retried `retries` more times with exponential backoff
    (backoff_s, 2*backoff_s, ...); HTTP 4xx and a non-JSON answer are not, as they would not change.
    `timeout_s` bounds each connect and each wait for bytes of one request (requests' semantics),
    not a whole slowly trickled reply.
    """

    def __init__(self, url: str, *, batch_size: int = 64, timeout_s: float = 30.0, retries: int = 3,
                 backoff_s: float = 0.5):
        if batch_size < 1 or retries < 0 or timeout_s <= 0:
            raise UserError(f"--remote_rm_url {url}: need batch_size >= 1, retries >= 0 and "
                            f"timeout > 0, got {batch_size}, {retries}, {timeout_s}")
        self.url, self.batch_size, self.timeout_s = url, batch_size, timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        self.source = f"--remote_rm_url {url}"
        self.session = requests.Session()

    def __call__(self, prompts: list[str], completions: list[str], labels: list[str | None], *,
                 skip_bad: bool = False) -> tuple[list[float | None], int]:
        """prompts, completions, labels: [B]. Returns ([B] scores, number skipped), order kept."""
        if not (len(prompts) == len(completions) == len(labels)):
            raise ValueError(f"got {len(prompts)} prompts, {len(completions)} completions, "
                             f"{len(labels)} labels")
        scores: list[float | None] = []
        skipped = 0
        for lo in range(0, len(prompts), self.batch_size):
            hi = lo + self.batch_size
            reply = self._post(prompts[lo:hi], completions[lo:hi], labels[lo:hi], lo)
            batch, n_bad = validate_scores(reply, prompts[lo:hi], self.source, skip_bad, offset=lo)
            scores += batch
            skipped += n_bad
        return scores, skipped

    def _post(self, prompts, completions, labels, offset: int):
        payload = {"prompts": list(prompts), "completions": list(completions), "labels": list(labels)}
        attempts = 1 + self.retries
        for attempt in range(1, attempts + 1):
            retry, cause = False, ""
            try:
                r = self.session.post(self.url, json=payload, timeout=(self.timeout_s, self.timeout_s))
            except requests.Timeout:  # first: ConnectTimeout is also a ConnectionError
                retry, cause = True, f"timeout: the server did not answer within {self.timeout_s:g} s"
            except requests.ConnectionError as e:
                retry = True
                cause = ("connection refused (is the server running and listening there?)"
                         if "refused" in str(e).lower() else f"connection failed: {_last_line(e)[:200]}")
            else:
                if r.status_code >= 500:
                    retry, cause = True, f"HTTP {r.status_code}: {r.text[:200]!r}"
                elif r.status_code >= 400:
                    cause = f"HTTP {r.status_code} (a client error, not retried): {r.text[:200]!r}"
                else:
                    try:
                        body = json.loads(r.text)
                    except ValueError:
                        cause = f"answer is not JSON: {r.text[:100]!r}"
                    else:
                        if isinstance(body, Mapping):
                            if "rewards" in body:
                                return body["rewards"]
                            cause = (f'answer has no "rewards" key (keys: {sorted(body)[:10]}); reply '
                                     f'{{"rewards": [...]}} or a bare list')
                        else:
                            return body
            if not retry or attempt == attempts:
                break
            time.sleep(self.backoff_s * 2 ** (attempt - 1))
        tries = f"{attempt} attempt{'s' if attempt > 1 else ''}"
        raise UserError(f"{self.source} failed after {tries}: {cause} (batch starting with prompt "
                        f"{offset} {_show(prompts[0]) if prompts else ''}; each attempt may take up to "
                        f"--reward_timeout {self.timeout_s:g} s, with backoff between attempts)")

    def close(self) -> None:
        self.session.close()


def score_rollout(prompts: list, samples, batch: dict, *, reward_group=None, score_text=None, tokenizer=None,
                  micro_batch: int = 64, passed: list | None = None):
    """Scores [N] of a rollout and the indices of the samples whose reward is usable.

    From a reward-model group (each rank scores its share of `batch`; every sample usable), or from
    `score_text(prompt_texts, completions, labels) -> (values, _)` on the decoded responses, where a
    value of None (a skipped bad reward) marks the sample unusable. `prompts[i]` is sample i's
    prompt (`samples.prompt_index`). `passed`, if given, is filled with the source's own pass verdicts
    (None each when it gives none).
    """
    import torch

    from common.rollout.samples import split_batch

    if reward_group is not None:
        parts = [(b, micro_batch) for b in split_batch(batch, len(reward_group))]
        if passed is not None:
            passed[:] = [None] * len(samples)
        return torch.cat(reward_group.call_per_rank("rewards", parts)), list(range(len(samples)))
    texts = tokenizer.batch_decode(samples.response_ids, skip_special_tokens=True)
    values, _ = score_text([prompts[i].prompt_text for i in samples.prompt_index], texts,
                           [prompts[i].label for i in samples.prompt_index])
    if passed is not None:
        passed[:] = getattr(values, "passed", [None] * len(values))
    ok = [i for i, v in enumerate(values) if v is not None]
    return torch.tensor([v if v is not None else 0.0 for v in values], dtype=torch.float32), ok

