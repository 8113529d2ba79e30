"""tests/unit/ starts no process: a test here that spawns one (a script, torchrun, Ray, vLLM, a multiprocessing
worker; a git query excepted) fails at the spawn, naming tests/e2e/ as its place, so `make test-unit` stays the quick loop."""
from __future__ import annotations

import multiprocessing.util
import os
import subprocess

import pytest


_POPEN_INIT = subprocess.Popen.__init__


def _refuse(*args, **kwargs):
    raise AssertionError("a unit test starts no process: this test belongs in tests/e2e/")


def _only_git(self, args, *rest, **kwargs):
    """A git query (the commit a run records: milliseconds) is allowed; anything else is refused."""
    if isinstance(args, (list, tuple)) and args and os.path.basename(str(args[0])) == "git":
        return _POPEN_INIT(self, args, *rest, **kwargs)
    _refuse()


@pytest.fixture(scope="module", autouse=True)
def no_processes():
    """Module-scoped and autouse, so it is in place before the module's own fixtures run."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(subprocess.Popen, "__init__", _only_git)
        m.setattr(multiprocessing.util, "spawnv_passfds", _refuse)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                m.setattr(os, name, _refuse)
        yield
