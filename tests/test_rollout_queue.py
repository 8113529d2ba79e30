"""The --async_train queue (common/rollout_queue.py) against a fake engine that records which weights
generated what: bounded staleness, the synchronous loop at depth 0, checkpoints as barriers that make
a resumed run regenerate its in-flight rollouts exactly."""
from __future__ import annotations

import pytest

from common.data import iterate_batches
from common.rollout import Samples
from common.rollout_queue import RolloutQueue, rollout_version, staleness


class FakeEngine:
    """Generates in call order, as a Ray actor runs its calls; `weights` is the version last synced."""

    def __init__(self, weights: int = 0):
        self.weights, self.calls = weights, []

    def submit(self, prompts, seed, logprobs):
        made_by = self.weights  # a call made before the next sync runs with these weights
        self.calls.append(("generate", seed, made_by))
        return lambda: Samples([[1]] * len(prompts), [[2]] * len(prompts), list(range(len(prompts))),
                               [False] * len(prompts), extra={"made_by": made_by, "seed": seed, "prompts": prompts})


def _run(depth: int, save_steps: int, start: int, total: int, n_prompts: int = 40, batch: int = 4):
    """The scripts' loop shape: take, train, settle, sync; per step (made_by, seed, prompts, staleness)."""
    engine = FakeEngine(weights=start)
    epoch, in_epoch = divmod(start, n_prompts // batch)
    q = RolloutQueue(engine.submit, iterate_batches(n_prompts, batch, 0, epoch, in_epoch), list(range(n_prompts)),
                     depth=depth, save_steps=save_steps, start=start, total=total, seed=lambda j: 1000 + j,
                     logprobs=lambda j: True)
    out = []
    for step in range(start, total):
        r = q.take(step)
        s = r.samples
        assert s.versions == [s.extra["made_by"]] * len(s) and r.version == s.extra["made_by"]
        out.append((s.extra["made_by"], s.extra["seed"], s.extra["prompts"], staleness(s.versions, step)))
        q.settle()
        engine.weights = step + 1  # the sync that ends the step
    return out


def test_version_rule():
    assert [rollout_version(j, 1, -1) for j in range(5)] == [0, 0, 1, 2, 3]
    assert [rollout_version(j, 0, -1) for j in range(4)] == [0, 1, 2, 3]
    assert [rollout_version(j, 2, -1) for j in range(5)] == [0, 0, 0, 1, 2]
    # a checkpoint after step 4: rollout 4 (what step 5 trains) comes from version 4
    assert [rollout_version(j, 2, 4) for j in range(7)] == [0, 0, 0, 1, 4, 4, 4]


def test_depth_zero_is_the_synchronous_loop():
    for made_by, seed, _, lag in _run(0, -1, 0, 6):
        assert lag == {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
    assert [m for m, *_ in _run(0, -1, 0, 6)] == list(range(6))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_no_sample_is_trained_more_than_depth_versions_late(depth):
    rows = _run(depth, -1, 0, 12)
    lags = [lag["rollout/staleness_max"] for *_, lag in rows]
    assert max(lags) == depth and lags[depth:] == [depth] * (12 - depth), lags  # the pipeline stays full
    # every prompt batch in order, each with its step's seed, whatever generated it
    assert [seed for _, seed, *_ in rows] == [1000 + j for j in range(12)]
    assert [p for *_, p, _ in rows] == [p for *_, p, _ in _run(0, -1, 0, 12)]


@pytest.mark.parametrize("depth,save_steps,at", [(1, 3, 3), (2, 4, 8), (1, 5, 5)])
def test_resume_from_a_checkpoint_regenerates_what_was_in_flight(depth, save_steps, at):
    full = _run(depth, save_steps, 0, 12)
    resumed = _run(depth, save_steps, at, 12)
    assert resumed == full[at:]  # same weights, seeds and prompts for every rollout after the checkpoint
    assert full[at][0] == at  # the first rollout after a checkpoint comes from the checkpoint's weights


def test_queue_never_runs_past_the_last_step():
    engine = FakeEngine()
    q = RolloutQueue(engine.submit, iterate_batches(40, 4, 0), list(range(40)), depth=3, save_steps=-1, start=0,
                     total=2, seed=lambda j: j, logprobs=lambda j: False)
    q.take(0)
    q.take(1)
    assert len(engine.calls) == 2 and not q.pending and q.settle() == {}
