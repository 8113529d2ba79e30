"""User-facing errors: one clear message, exit code 2, no traceback wall.

Anything the user can fix (a missing file, a malformed row, a bad flag combination) raises
`UserError` (exit 2); a run that cannot continue (a dead or hung worker, a non-finite loss) raises
`TrainingError` (exit 1); a run stopped early by SIGTERM or Ctrl-C, after its checkpoint, raises
`Stopped` (exit 143 or 130). The script's entry point runs under `exit_on_user_error()`, which prints
the one message. Programming errors keep their traceback.
"""
from __future__ import annotations

import contextlib
import os
import sys


class UserError(Exception):
    """A problem in the user's input; the message says what is wrong and what to change."""


class TrainingError(RuntimeError):
    """The run cannot go on (a worker died or hung, a loss became NaN): one message, exit code 1."""


class Stopped(Exception):
    """The run stopped before its last step for a signal, with a checkpoint (common.training.checkpoint.Preemption).
    The driver exits 128 + the signal's number, what a shell reports for a command the signal ended (143
    for SIGTERM, 130 for Ctrl-C), so `train_sft.py ... && train_rm.py ...` does not go on with an unfinished
    model; slurm/ray_cluster.sh requeues a Ray job whose driver stopped so at the time-limit warning."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.code = 128 + signum


@contextlib.contextmanager
def exit_on_user_error():
    try:
        yield
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Stopped as e:  # the run has said why and where it saved
        # Only the driver (rank 0; a Ray driver has no RANK) tells: srun --kill-on-bad-exit, torchrun and the
        # deepspeed launcher end every rank once one exits non-zero, which could cut rank 0's last lines short.
        sys.exit(e.code if os.environ.get("RANK", "0") == "0" else 0)


def require(cond: bool, message: str) -> None:
    """Raise `UserError(message)` unless `cond` holds (flag checks at the top of a script)."""
    if not cond:
        raise UserError(message)


def one_line(e: BaseException) -> str:
    """An exception as one line of at most ~300 characters, its type first, for a message to the user."""
    text = " ".join(str(e).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


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
