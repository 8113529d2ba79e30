"""Reward sources: a `--reward_func` file (loading, validation, timeout) and a real HTTP reward server."""
from __future__ import annotations

import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from common.data import tasks
from common.errors import UserError
from common.rl.rewards import RemoteReward, load_reward_func, score_with_function, validate_scores

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reward_func_copy.py"

PROMPTS = [f"Repeat: {w} cat" for w in ("red", "blue", "green", "sun")]
LABELS = [p.removeprefix("Repeat: ") for p in PROMPTS]
COMPLETIONS = ["red cat", "blue dog", "cat green", "sun cat moon"]
EXPECTED = [1.0, 0.5, 0.0, 2 / 3]


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    # requests honours proxy variables; a proxy must not intercept the 127.0.0.1 test servers.
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(k, raising=False)


# ----- load_reward_func -----

def test_example_file_matches_the_builtin_copy_reward():
    fn = load_reward_func(str(EXAMPLE))
    assert fn(PROMPTS, COMPLETIONS, LABELS) == pytest.approx(EXPECTED)
    rows = tasks.prompt_rows(32, "eval")
    comps = ["", "red", "x y z w"] + [r["label"] for r in rows[3:]]
    got = fn([""] * len(rows), comps, [r["label"] for r in rows])
    assert got == [tasks.copy_reward(c, r["label"]) for c, r in zip(comps, rows)]
    assert fn(["p"], ["a"], [None]) == [0.0]


def test_load_missing_file(tmp_path):
    with pytest.raises(UserError, match=r"nope\.py.*does not exist"):
        load_reward_func(str(tmp_path / "nope.py"))


def test_load_syntax_error(tmp_path):
    f = tmp_path / "broken_rf.py"
    f.write_text("def reward_func(p, c, l):\n    return [\n\nx = = 1\n")
    with pytest.raises(UserError, match=r"broken_rf\.py.*SyntaxError.*line \d") as e:
        load_reward_func(str(f))
    assert "importing the file failed" in str(e.value)


def test_load_import_time_exception(tmp_path):
    f = tmp_path / "raises_rf.py"
    f.write_text("import json\nWORDS = json.loads('{bad')\n")
    with pytest.raises(UserError, match=r"raises_rf\.py.*JSONDecodeError"):
        load_reward_func(str(f))


def test_load_without_reward_func_lists_callables(tmp_path):
    f = tmp_path / "other_rf.py"
    f.write_text("import os\ndef score(p, c, l):\n    return []\nclass Judge:\n    pass\n_private = 1\n")
    with pytest.raises(UserError, match=r"other_rf\.py.*no function named reward_func") as e:
        load_reward_func(str(f))
    assert "Judge, score" in str(e.value) and "os" not in str(e.value).split("defines")[1]
    g = tmp_path / "notfn_rf.py"
    g.write_text("reward_func = 3\n")
    with pytest.raises(UserError, match="reward_func is a int"):
        load_reward_func(str(g))


def test_two_files_load_as_separate_modules(tmp_path):
    a, b = tmp_path / "a" / "rf.py", tmp_path / "b" / "rf.py"
    for f, v in ((a, 1.0), (b, 2.0)):
        f.parent.mkdir()
        f.write_text(f"def reward_func(p, c, l):\n    return [{v}] * len(c)\n")
    fa, fb = load_reward_func(str(a)), load_reward_func(str(b))
    assert fa(["x"], ["y"], [None]) == [1.0] and fb(["x"], ["y"], [None]) == [2.0]


# ----- score_with_function -----

def test_score_happy_path_is_one_batched_call():
    calls = []

    def fn(p, c, l):
        calls.append(len(c))
        return np.array([tasks.copy_reward(x, y) for x, y in zip(c, l)], dtype=np.float32)

    scores, skipped = score_with_function(fn, PROMPTS, COMPLETIONS, LABELS)
    assert calls == [4] and skipped == 0
    assert scores == pytest.approx(EXPECTED) and all(type(s) is float for s in scores)


def test_score_function_raises():
    def fn(p, c, l):
        raise KeyError("missing answer")

    with pytest.raises(UserError, match=r"raised KeyError: 'missing answer'") as e:
        score_with_function(fn, PROMPTS, COMPLETIONS, LABELS)
    assert repr(PROMPTS[0]) in str(e.value) and __file__ in str(e.value)
    assert score_with_function(fn, PROMPTS, COMPLETIONS, LABELS, skip_bad=True) == ([None] * 4, 4)


def test_score_wrong_count_raises_even_with_skip_bad():
    fn = lambda p, c, l: [1.0, 0.0, 1.0]  # noqa: E731
    for skip in (False, True):
        with pytest.raises(UserError, match="returned 3 scores for 4 completions") as e:
            score_with_function(fn, PROMPTS, COMPLETIONS, LABELS, skip_bad=skip)
        assert repr(PROMPTS[0]) in str(e.value) and __file__ in str(e.value)
    with pytest.raises(UserError, match="returned float instead of a list"):
        score_with_function(lambda p, c, l: 1.0, PROMPTS, COMPLETIONS, LABELS)


def test_score_nan_names_the_prompt():
    fn = lambda p, c, l: [1.0, 0.5, float("nan"), 0.0]  # noqa: E731
    with pytest.raises(UserError, match=r"nan at index 2, for prompt 2 'Repeat: green cat'"):
        score_with_function(fn, PROMPTS, COMPLETIONS, LABELS)
    scores, skipped = score_with_function(fn, PROMPTS, COMPLETIONS, LABELS, skip_bad=True)
    assert scores == [1.0, 0.5, None, 0.0] and skipped == 1


def test_score_non_numbers_and_inf():
    fn = lambda p, c, l: ["0.5", None, math.inf, True]  # noqa: E731
    with pytest.raises(UserError, match=r"non-number '0.5' at index 0.*\(3 bad scores"):
        score_with_function(fn, PROMPTS, COMPLETIONS, LABELS)
    assert score_with_function(fn, PROMPTS, COMPLETIONS, LABELS, skip_bad=True) == (
        [None, None, None, 1.0], 3)


def test_score_hanging_function_times_out():
    def fn(p, c, l):
        time.sleep(10)  # abandoned in its daemon thread after the timeout
        return [0.0] * len(c)

    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"did not return within 0.5 s.*'Repeat: red cat'"):
        score_with_function(fn, PROMPTS, COMPLETIONS, LABELS, timeout_s=0.5)
    assert score_with_function(fn, PROMPTS, COMPLETIONS, LABELS, timeout_s=0.2, skip_bad=True) == (
        [None] * 4, 4)
    assert time.monotonic() - t0 < 1.5


def test_validate_scores_offset_and_long_prompt():
    long = "x" * 200
    with pytest.raises(UserError, match=r"at index 7, for prompt 7 'x{80}'"):
        validate_scores([float("inf")], [long], "src", False, offset=7)


# ----- RemoteReward against a real HTTP server -----

class _Server:
    """A ThreadingHTTPServer on 127.0.0.1:0 whose POST behaviour is `self.behave(handler, body)`."""

    def __init__(self):
        self.requests: list[dict] = []
        self.behave = None
        self.release = threading.Event()  # lets hung handlers finish at teardown
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                outer.behave(self, body)

            def log_message(self, *args):  # keep pytest output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True  # a hung handler must not block interpreter exit
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()


def _reply(handler, status: int, data: bytes, ctype: str = "application/json"):
    handler.send_response(status)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _copy_scores(body) -> list[float]:
    return [tasks.copy_reward(c, y) for c, y in zip(body["completions"], body["labels"])]


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.release.set()
    s.httpd.shutdown()
    s.httpd.server_close()
    s.thread.join(timeout=5)


def test_remote_batches_keep_order(server):
    flip = iter(range(100))
    # alternate the two accepted reply shapes
    server.behave = lambda h, b: _reply(h, 200, json.dumps(
        {"rewards": _copy_scores(b)} if next(flip) % 2 else _copy_scores(b)).encode())
    prompts, comps, labels = PROMPTS + ["Repeat: moon"], COMPLETIONS + ["moon"], LABELS + ["moon"]
    rm = RemoteReward(server.url, batch_size=2)
    scores, skipped = rm(prompts, comps, labels)
    assert scores == pytest.approx(EXPECTED + [1.0]) and skipped == 0
    assert [len(r["prompts"]) for r in server.requests] == [2, 2, 1]
    assert [p for r in server.requests for p in r["prompts"]] == prompts
    assert server.requests[2] == {"prompts": ["Repeat: moon"], "completions": ["moon"], "labels": ["moon"]}
    rm.close()


def test_remote_retries_a_500(server):
    n = iter(range(100))
    server.behave = lambda h, b: (_reply(h, 500, b"overloaded") if next(n) == 0
                                  else _reply(h, 200, json.dumps(_copy_scores(b)).encode()))
    scores, _ = RemoteReward(server.url, retries=2, backoff_s=0.01)(PROMPTS, COMPLETIONS, LABELS)
    assert scores == pytest.approx(EXPECTED) and len(server.requests) == 2


def test_remote_500_every_time_and_4xx_not_retried(server):
    server.behave = lambda h, b: _reply(h, 503, b"x" * 500, "text/plain")
    with pytest.raises(UserError, match=r"failed after 3 attempts: HTTP 503: 'x{200}'.*Repeat: red") as e:
        RemoteReward(server.url, retries=2, backoff_s=0.01)(PROMPTS, COMPLETIONS, LABELS)
    assert server.url in str(e.value) and len(server.requests) == 3
    server.requests.clear()
    server.behave = lambda h, b: _reply(h, 422, b'{"detail": "labels missing"}')
    with pytest.raises(UserError, match=r"after 1 attempt: HTTP 422.*labels missing"):
        RemoteReward(server.url, retries=2, backoff_s=0.01)(PROMPTS, COMPLETIONS, LABELS)
    assert len(server.requests) == 1


def test_remote_server_never_answers(server):
    server.behave = lambda h, b: server.release.wait(10)
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"after 2 attempts: timeout: the server did not answer within 0.5 s") as e:
        RemoteReward(server.url, timeout_s=0.5, retries=1, backoff_s=0.01)(PROMPTS, COMPLETIONS, LABELS)
    assert time.monotonic() - t0 < 2.5 and server.url in str(e.value)


def test_remote_not_json_and_bad_shapes(server):
    server.behave = lambda h, b: _reply(h, 200, b"<html>Internal proxy page</html>", "text/html")
    with pytest.raises(UserError, match=r"answer is not JSON: '<html>Internal proxy page"):
        RemoteReward(server.url, backoff_s=0.01)(PROMPTS, COMPLETIONS, LABELS)
    server.behave = lambda h, b: _reply(h, 200, b'{"scores": [1, 2, 3, 4]}')
    with pytest.raises(UserError, match=r'no "rewards" key'):
        RemoteReward(server.url)(PROMPTS, COMPLETIONS, LABELS)
    server.behave = lambda h, b: _reply(h, 200, b"[1, 2, 3]")
    with pytest.raises(UserError, match=r"returned 3 scores for 4 completions"):
        RemoteReward(server.url)(PROMPTS, COMPLETIONS, LABELS, skip_bad=True)


def test_remote_nan_uses_global_index(server):
    # NaN is not valid JSON but Python's json (and many servers) emit it; it must not pass through.
    server.behave = lambda h, b: _reply(h, 200, b"[1.0, NaN]" if "green" in b["prompts"][0] else b"[0, 0]")
    with pytest.raises(UserError, match=r"remote_rm_url .*nan at index 3, for prompt 3 'Repeat: sun cat'"):
        RemoteReward(server.url, batch_size=2)(PROMPTS, COMPLETIONS, LABELS)
    scores, skipped = RemoteReward(server.url, batch_size=2)(PROMPTS, COMPLETIONS, LABELS, skip_bad=True)
    assert scores == [0.0, 0.0, 1.0, None] and skipped == 1


def test_remote_connection_refused():
    with socket.socket() as s:  # a port that was just free: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(UserError, match=r"after 2 attempts: connection refused") as e:
        RemoteReward(url, retries=1, backoff_s=0.01)(PROMPTS, COMPLETIONS, LABELS)
    assert url in str(e.value) and "Repeat: red cat" in str(e.value)
