"""User-facing errors: one clear message, exit code 2, no traceback wall.

Anything the user can fix (a missing file, a malformed row, a bad flag combination) raises
`UserError`; the script's entry point runs under `exit_on_user_error()`, which prints the message
and exits 2. Programming errors keep their traceback.
"""
from __future__ import annotations

import contextlib
import sys


class UserError(Exception):
    """A problem in the user's input; the message says what is wrong and what to change."""


@contextlib.contextmanager
def exit_on_user_error():
    try:
        yield
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def require(cond: bool, message: str) -> None:
    """Raise `UserError(message)` unless `cond` holds (flag checks at the top of a script)."""
    if not cond:
        raise UserError(message)
