"""The --async_train queue (common/rollout/queue.py) against a fake engine that records which weights
generated what: bounded staleness, the synchronous loop at depth 0, checkpoints as barriers that make
a resumed run regenerate its in-flight rollouts exactly."""
from __future__ import annotations




def test_partial_rollout_threads_never_hold_a_stopping_run():
    """A run that stops on another error (a sync timeout) while a chunk is still out ends at once with
    its one message: the driver threads are daemons and print nothing."""
    import subprocess
    import sys
    import textwrap

    from tests.helpers import ROOT

    code = textwrap.dedent("""
        import threading
        from common.errors import UserError, exit_on_user_error
        from common.rollout.partial import submit_chunked

        hung = lambda engine, timeout_s: lambda *args: threading.Event().wait()  # a chunk that never returns
        submit_chunked([object()], [[1]], dict(n=1, max_new_tokens=4), seed=0, chunk=2, call=hung)
        with exit_on_user_error():
            raise UserError("weight sync: vLLM engine 0 did not finish within 1 s")
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stderr == "error: weight sync: vLLM engine 0 did not finish within 1 s\n", p.stderr
