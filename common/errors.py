"""User-facing errors: one clear message, exit code 2, no traceback wall.

Anything the user can fix (a missing file, a malformed row, a bad flag combination) raises
`UserError` (exit 2); a run that cannot continue (a dead or hung worker, a non-finite loss) raises
`TrainingError` (exit 1). The script's entry point runs under `exit_on_user_error()`, which prints
the one message. Programming errors keep their traceback.
"""
from __future__ import annotations

import contextlib
import sys


class UserError(Exception):
    """A problem in the user's input; the message says what is wrong and what to change."""


class TrainingError(RuntimeError):
    """The run cannot go on (a worker died or hung, a loss became NaN): one message, exit code 1."""


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


def check_output_folders(a: dict) -> None:
    """--save_path, --ckpt_path and --use_tensorboard must be folders this process can create or write."""
    import os

    for flag in ("save_path", "ckpt_path", "use_tensorboard"):
        path = a.get(flag)
        if not path or dry_run_only(a):
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            raise UserError(f"--{flag} {path}: a file is there, and this is where the run's folder goes; "
                            "give another path or move the file")
        parent = path
        while parent and not os.path.exists(parent):  # the nearest folder that exists gets the new ones
            parent = os.path.dirname(parent.rstrip("/")) or "."
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UserError(f"--{flag} {path}: {os.path.abspath(parent)} cannot be written by this user; give a "
                            "folder you can write")


def dry_run_only(a: dict) -> bool:
    return bool(a.get("dry_run"))  # a dry run writes nothing


def require(cond: bool, message: str) -> None:
    """Raise `UserError(message)` unless `cond` holds (flag checks at the top of a script)."""
    if not cond:
        raise UserError(message)
