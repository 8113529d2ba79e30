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


def require(cond: bool, message: str) -> None:
    """Raise `UserError(message)` unless `cond` holds (flag checks at the top of a script)."""
    if not cond:
        raise UserError(message)
