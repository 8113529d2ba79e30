"""MetricsLogger: the files a run leaves behind, plain vs terminal console output, resume, PNG."""
from __future__ import annotations

import enum
import importlib.util
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from common.errors import UserError
from common.logger import MetricsLogger, versions

ANSI = re.compile(r"\x1b\[")


def plain_console() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, width=80)


def read_jsonl(path: Path) -> list[dict]:
    # json.loads accepts NaN by default; reject it so the test checks strict JSON.
    def no_const(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return [json.loads(line, parse_constant=no_const) for line in path.read_text().splitlines()]


def test_metrics_jsonl_and_config(tmp_path):
    class Mode(enum.Enum):
        FAST = "fast"

    cfg = {"lr": 1e-6, "model": Path("/models/tiny"), "mode": Mode.FAST, "seeds": {3, 1}, "obj": object()}
    log = MetricsLogger(str(tmp_path / "run"), 3, config=cfg, console=plain_console())
    log.log(1, {"train/loss": np.float32(0.5), "train/acc": 1})
    log.log(2, {"train/loss": float("nan"), "eval/acc": float("inf")})
    # Written and flushed before close: a killed run keeps what it logged.
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    log.log(3, {"train/loss": 0.25})
    log.close()

    recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["train/loss"] == 0.5 and recs[0]["train/acc"] == 1.0
    assert recs[1]["train/loss"] is None and recs[1]["eval/acc"] is None
    assert all(isinstance(r["time"], float) for r in recs)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["hybridrl"]
    assert saved["lr"] == 1e-6 and saved["model"] == "/models/tiny" and saved["mode"] == "fast"
    assert saved["seeds"] == [1, 3] and saved["obj"].startswith("<object")


def test_torch_scalars(tmp_path):
    torch = pytest.importorskip("torch")
    with MetricsLogger(str(tmp_path), 1, console=plain_console()) as log:
        log.log(1, {"train/loss": torch.tensor(0.75), "train/kl": torch.tensor([float("nan")])})
    (rec,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert rec["train/loss"] == 0.75 and rec["train/kl"] is None


def test_append_resume_drops_steps_from_start(tmp_path):
    with MetricsLogger(str(tmp_path), 5, console=plain_console()) as log:
        for s in range(1, 6):
            log.log(s, {"train/loss": s / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')  # the cut-off last line of a killed run
    # The checkpoint was at step 3: the resumed run redoes steps 3, 4, 5.
    log = MetricsLogger(str(tmp_path), 5, console=plain_console(), start_step=3, append=True,
                        plot_keys=("train/loss",))
    for s in range(3, 6):
        log.log(s, {"train/loss": s / 100})
    png = log.close()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["train/loss"]) for r in recs] == [(1, 0.1), (2, 0.2), (3, 0.03), (4, 0.04), (5, 0.05)]
    assert png is not None

    # Without append the file starts over.
    with MetricsLogger(str(tmp_path), 5, console=plain_console()) as log:
        log.log(1, {"train/loss": 9.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]


def test_plain_output_is_grep_friendly(tmp_path):
    con = plain_console()
    log = MetricsLogger(str(tmp_path), 100, console=con, title="t")
    log.banner("hybridrl ppo", {"options": {"lr": 1e-6, "long_option_name_" * 6: "x" * 90},
                                "versions": versions()})
    log.table("resource plan", [{"role": "actor", "gpus": 4}, {"role": "vllm", "gpus": 4, "tp": 2}])
    log.info("[bold]saved[/bold] checkpoint to [1, 2]")
    for s in (1, 12):
        log.log(s, {"train/loss": 0.6931, "train/acc": 0.5, "perf/tokens_per_s": 123456.0})
    log.close()
    out = con.file.getvalue()
    assert not ANSI.search(out) and "\r" not in out
    lines = out.splitlines()
    step_lines = [ln for ln in lines if ln.startswith("step ")]
    assert len(step_lines) == 2
    assert re.fullmatch(r"step 12/100 \| train/loss 0\.6931 \| train/acc 0\.5000 \| perf/tokens_per_s 123456\.0 "
                        r"\| \d+\.\d s", step_lines[1])
    # Long banner values stay on one line (no wrapping at the console width).
    assert any(ln.startswith("  " + "long_option_name_" * 6 + ": ") and ln.endswith("x" * 90) for ln in lines)
    assert "saved checkpoint to [1, 2]" in lines
    assert "  actor  4" in lines and "  vllm   4     2" in lines
    assert any(ln.strip().startswith("torch:") for ln in lines)


def test_terminal_mode_runs(tmp_path):
    con = Console(file=io.StringIO(), force_terminal=True, width=120)
    with MetricsLogger(str(tmp_path), 20, console=con, plot_keys=("train/loss",)) as log:
        assert not log.plain
        log.banner("run", {"options": {"lr": 0.1}})
        log.table("plan", [{"role": "actor", "gpus": 1}])
        for s in range(1, 21):
            log.log(s, {"train/loss": 1 / s, **({"eval/acc": s / 20} if s % 10 == 0 else {})})
        log.warn_once("k", "careful [with] brackets")
        log.info("[green]done[/green]")
    out = con.file.getvalue()
    assert ANSI.search(out)  # it really rendered as a terminal
    assert "loss 0.0500" in out and "20/20" in out and "done" in out and "careful" in out  # train/loss as "loss"
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 20


def _screen_lines(out: str) -> list[str]:
    """What a terminal shows of `out`: escape codes gone, and each redraw of the bar (after a \\r) a line."""
    return [s.rstrip() for s in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)) if s.strip()]


# One GRPO step's metrics as train_grpo.py logs them (a real run's keys, in its order)
GRPO_STEP = {"rollout/reward_mean": 0.4123, "rollout/reward_std": 0.2871, "rollout/response_len_mean": 11.53,
             "rollout/truncated_frac": 0.0313, "rollout/groups_all_equal": 0.125, "train/policy_loss": -0.01234,
             "train/kl": 0.000123, "train/clip_frac": 0.0042, "train/entropy": 1.2345, "train/grad_norm": 0.8731,
             "train/lr": 1e-6, "train/kl_coef": 0.01, "time/generate_s": 3.21, "time/logprobs_s": 0.87,
             "time/train_s": 4.56, "time/weight_sync_s": 0.12, "time/step_s": 9.31, "perf/tokens_per_s": 1523.4}


def test_terminal_lines_fit_80_columns(tmp_path):
    """On an 80-column terminal the bar keeps its counts and times and the history lines above it stay whole,
    with a GRPO run's real metrics: rich wrapped the history line mid-value and cut the bar to its first
    metrics and an ellipsis."""
    con = Console(file=io.StringIO(), force_terminal=True, width=80)
    keys = ("rollout/reward_mean", "train/kl", "train/policy_loss", "eval/reward_mean")
    with MetricsLogger(str(tmp_path), 1000, console=con, plot_keys=keys) as log:
        for s in range(1, 25):
            log.log(s, {**GRPO_STEP, **({"eval/reward_mean": 0.61, "eval/pass@1": 0.5} if s % 12 == 0 else {})})
    lines = _screen_lines(con.file.getvalue())
    assert max(map(len, lines)) <= 80 and not any("…" in ln for ln in lines), max(lines, key=len)
    bars = [ln for ln in lines if not ln.startswith("step ")]
    assert len(bars) >= 24
    for bar in bars:  # the bar's own columns: done/total, elapsed, remaining
        assert re.fullmatch(r"reward_mean 0\.4123  kl 1\.230e-04 \S+ +\d+/1000 \d+:\d\d:\d\d (\d+:\d\d:\d\d|-:--:--)",
                            bar), bar
    history = [ln for ln in lines if ln.startswith("step ")]
    assert [h.split(" | ")[0] for h in history] == [f"step {s}/1000" for s in (1, 11, 12, 21, 24)]
    for h in history:  # whole name-value pairs, then the time
        assert re.fullmatch(r"step \d+/1000( \| [\w/@]+ -?\d[\d.e+-]*)+ \| \d+\.\d s", h), h
    assert history[0].startswith("step 1/1000 | reward_mean 0.4123 | kl 1.230e-04 | policy_loss -0.0123 |"), history
    assert history[2].startswith("step 12/1000 | eval/reward_mean 0.6100 | reward_mean 0.4123"), history  # eval first


def test_end_says_where_the_files_went(tmp_path):
    con = plain_console()
    log = MetricsLogger(str(tmp_path / "run"), 2, console=con, plot_keys=("train/loss",))
    log.log(1, {"train/loss": 0.5})
    log.end({"policy": str(tmp_path / "run"), "critic": str(tmp_path / "run_critic")})
    assert con.file.getvalue().splitlines()[-4:] == [
        f"metrics: {tmp_path}/run/metrics.jsonl", f"curves: {tmp_path}/run/curves.png",
        f"policy: {tmp_path}/run", f"critic: {tmp_path}/run_critic"]
    # stopped early, nothing to plot
    con = plain_console()
    log = MetricsLogger(str(tmp_path / "cut"), 9, console=con, plot_keys=("eval/acc",))
    log.log(1, {"train/loss": 0.5})
    log.end({}, resume_from=str(tmp_path / "cut" / "checkpoints"))
    assert con.file.getvalue().splitlines()[-3:] == [
        f"metrics: {tmp_path}/cut/metrics.jsonl", "curves: none (no finite value of eval/acc)",
        f"model: not saved (stopped before the last step); --load_checkpoint resumes from {tmp_path}/cut/checkpoints"]


def test_png(tmp_path):
    import matplotlib.image
    from PIL import Image

    log = MetricsLogger(str(tmp_path), 30, console=plain_console(), title="ppo",
                        plot_keys=("train/loss", "eval/acc", "rollout/reward_mean", "never/logged"))
    for s in range(1, 31):
        m = {"train/loss": math.exp(-s / 10), "rollout/reward_mean": s / 30}
        if s % 10 == 0:
            m["eval/acc"] = s / 30
        log.log(s, m)
    path = log.close()
    assert path == str(tmp_path / "curves.png")
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert Image.open(path).text["Description"] == "train/loss,eval/acc,rollout/reward_mean"
    assert log.close() is None  # closing twice is harmless

    log = MetricsLogger(str(tmp_path / "none"), 3, console=plain_console(), plot_keys=("train/loss",))
    log.log(1, {"other": 1.0})
    assert log.close() is None and not (tmp_path / "none" / "curves.png").exists()


def test_disabled_logger_writes_nothing(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path / "run"), 10, enabled=False, config={"a": 1}, use_wandb=True,
                        tensorboard_dir=str(tmp_path / "tb"), plot_keys=("train/loss",))
    with log:
        log.banner("x", {"s": {"a": 1}})
        log.table("t", [{"a": 1}])
        log.info("hello")
        log.warn_once("k", "w")
        log.log(1, {"train/loss": 1.0})
    assert log.close() is None
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == ""


def test_warn_once_and_capsys(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), 10)  # default console: pytest's captured stdout is not a terminal
    assert log.plain
    for _ in range(3):
        log.warn_once("pad", "pad token missing, using eos")
    log.warn_once("other", "second warning")
    log.log(1, {"train/loss": 0.5})
    log.close()
    out = capsys.readouterr().out
    assert out.count("warning: pad token missing, using eos") == 1
    assert "warning: second warning" in out
    assert "step 1/10 | train/loss 0.5000" in out


def test_tensorboard(tmp_path):
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(UserError, match="pip install tensorboard"):
            MetricsLogger(str(tmp_path / "run"), 1, tensorboard_dir=str(tmp_path / "tb"), console=plain_console())
        assert not (tmp_path / "run").exists()  # failed before writing anything
        return
    with MetricsLogger(str(tmp_path / "run"), 1, tensorboard_dir=str(tmp_path / "tb"), console=plain_console()) as log:
        log.log(1, {"train/loss": 0.5})
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_wandb_missing(tmp_path):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb installed")
    with pytest.raises(UserError, match="pip install wandb"):
        MetricsLogger(str(tmp_path), 1, use_wandb=True, console=plain_console())


def test_banner_says_what_the_run_does_to_its_folder(tmp_path):
    def banner(**kw) -> str:
        log = MetricsLogger(str(tmp_path), 5, console=plain_console(), **kw)
        log.banner("t", {})
        log.log(kw.get("start_step", 1), {"train/loss": 1.0})
        log.close()
        return log.console.file.getvalue()

    assert f"output: {tmp_path}: a new run (a folder holding another run is refused" in banner()
    assert f"output: {tmp_path}: continues the run there from step 3 (--load_checkpoint)" in banner(start_step=3, append=True)
