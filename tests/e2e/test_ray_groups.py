"""Ray role groups on a real local Ray: gloo all-reduce inside a group, colocated roles, failures."""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import time

import pytest

ray = pytest.importorskip("ray")

from common.errors import UserError  # noqa: E402
from common.cluster.ray_groups import BaseWorker, RoleGroup, create_placement_groups, init_ray, local_device_index  # noqa: E402
from common.cluster.resources import plan_resources  # noqa: E402
from tests.helpers import RAY_HEAD_CPUS, run, wait_for  # noqa: E402

# Ray workers cannot import this test module by name (tests/ is not on their path): ship its
# classes by value instead.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SumWorker(BaseWorker):
    def __init__(self, role, rank, world_size, master_addr, master_port, scale=1.0):
        super().__init__(role, rank, world_size, master_addr, master_port)
        self.scale = scale

    def init_dist(self) -> int:
        from common.training.ds import setup_distributed

        return setup_distributed(timeout_s=60).world_size

    def all_reduce(self, x: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([x * self.scale])
        dist.all_reduce(t)
        return float(t.item())

    def env(self) -> dict:
        import os

        return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}

    def fail(self, rank: int, msg: str) -> int:
        if self.rank == rank:
            raise ValueError(msg)
        return self.rank

    def sleep(self, s: float) -> int:
        time.sleep(s)
        return self.rank


class BadInitWorker(BaseWorker):
    def __init__(self, role, rank, world_size, master_addr, master_port):
        super().__init__(role, rank, world_size, master_addr, master_port)
        if rank == 1:
            raise FileNotFoundError("no model at /nowhere")

    def ping(self) -> int:
        return self.rank


class SlowInitWorker(BaseWorker):
    def __init__(self, role, rank, world_size, master_addr, master_port):
        super().__init__(role, rank, world_size, master_addr, master_port)
        if rank == 1:
            time.sleep(30)


def cpu_plan(actor, ref=None, **flags):
    flags = {"colocate_actor_ref": False, "colocate_critic_reward": False, "colocate_all_models": False, **flags}
    return plan_resources(actor=actor, critic=None, ref=ref, reward=None, vllm_num_engines=0, vllm_tp=1,
                          use_gpu=False, **flags)


def remove(pgs):
    from ray.util.placement_group import remove_placement_group

    for pg in pgs.values():
        remove_placement_group(pg)


@pytest.fixture(scope="module")
def colocated(ray_cluster):
    """actor and ref, 2 ranks each, sharing one placement group of 2 CPU bundles."""
    plan = cpu_plan((1, 2), ref=(1, 2), colocate_actor_ref=True)
    pgs = create_placement_groups(plan, timeout_s=30)
    assert list(pgs) == ["actor+ref"]
    pg = pgs["actor+ref"]
    actor = RoleGroup("actor", SumWorker, plan.role("actor"), pg, timeout_s=60)
    ref = RoleGroup("ref", SumWorker, plan.role("ref"), pg, init_args=(10.0,), timeout_s=60)
    yield actor, ref
    actor.shutdown()
    ref.shutdown()
    remove(pgs)


def test_init_ray_reuses_the_running_cluster(ray_cluster):
    assert init_ray(num_cpus=2)["CPU"] == RAY_HEAD_CPUS  # the session head's, not 2


# A driver that connects with init_ray and asks a task for the worker's environment and job runtime_env.
_WORKER_ENV_PROBE = """
import os, ray
from common.cluster.ray_groups import init_ray
init_ray(num_cpus=1)
print(ray.get(ray.remote(lambda: f"cache={os.environ.get('HYBRIDRL_CACHE')} "
                                f"runtime_env={ray.get_runtime_context().get_runtime_env_string()}").remote()))
"""


def test_workers_see_the_drivers_settings_on_a_local_and_on_a_running_cluster(ray_cluster, tmp_path):
    """The settings the workers need (HYBRIDRL_CACHE here; the DeepSpeed build cache, offline hub, vLLM's CPU
    settings) reach them either way: a local cluster's workers inherit the driver's environment, with no job
    runtime_env (one would cost each actor a second Python start); a running cluster's come through the job's
    runtime_env, since its workers have the environment of whoever started it."""
    cache = str(tmp_path / "cache")
    ray_tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths stay under 108 bytes
    # no RAY_ADDRESS and a temp dir of its own: a local Ray, not the session's head
    local = run([sys.executable, "-c", _WORKER_ENV_PROBE], timeout=300,
                extra_env={"HYBRIDRL_CACHE": cache, "RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp}).stdout
    # The run's watcher removes its cluster's folder once the driver has gone: wait for it rather than race it.
    wait_for(lambda: not os.listdir(ray_tmp), 60, f"the run's watcher to empty {ray_tmp}", show=lambda: os.listdir(ray_tmp))
    os.rmdir(ray_tmp)
    running = run([sys.executable, "-c", _WORKER_ENV_PROBE], timeout=300, extra_env={"HYBRIDRL_CACHE": cache}).stdout
    assert f"cache={cache} runtime_env={{}}" in local, local
    assert f"cache={cache} runtime_env=" in running and '"env_vars"' in running and cache in running.split("runtime_env=")[1], running


def test_two_colocated_groups_each_all_reduce(colocated):
    actor, ref = colocated
    assert actor.call("ping") == [0, 1] and ref.call("ping") == [0, 1]
    envs = actor.call("env")
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["LOCAL_RANK"] for e in envs} == {"0"}
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == actor.master[0]
    assert envs[1]["MASTER_PORT"] == str(actor.master[1]) != str(ref.master[1])
    # Rank 0 holds its rendezvous port from the moment it picked it, so no other socket on the host can
    # take it before the group forms (a picked-then-released port was taken in CI: EADDRINUSE).
    for _, port in (actor.master, ref.master):
        with socket.socket() as s, pytest.raises(OSError, match="in use"):
            s.bind(("", port))
    # Join both worlds at once: the two roles' process groups are independent.
    refs = actor.async_call("init_dist") + ref.async_call("init_dist")
    assert ray.get(refs, timeout=120) == [2, 2, 2, 2]
    assert actor.call_per_rank("all_reduce", [(1.0,), (2.0,)]) == [3.0, 3.0]
    assert ref.call("all_reduce", 1.5) == [30.0, 30.0]  # 1.5 x scale 10 on each of 2 ranks


def test_call_per_rank_checks_the_count(colocated):
    with pytest.raises(ValueError, match="1 argument tuples for 2 ranks"):
        colocated[0].call_per_rank("ping", [()])


def test_worker_exception_names_role_rank_and_error(colocated):
    actor, _ = colocated
    with pytest.raises(RuntimeError) as e:
        actor.call("fail", 1, "bad reward row 7")
    msg = str(e.value)
    assert msg.startswith("actor.fail (rank 1): ValueError: bad reward row 7")
    assert "test_ray_groups.py" in msg and len(msg.splitlines()) < 6
    assert actor.call("ping") == [0, 1]  # the group survives a raised exception


def test_slow_worker_times_out(colocated):
    _, ref = colocated
    ref.timeout_s = 1
    try:
        t0 = time.time()
        with pytest.raises(RuntimeError, match=r"ref.sleep: no answer within 1 s"):
            ref.call("sleep", 3)
        assert time.time() - t0 < 5
    finally:
        ref.timeout_s = 60
    assert ref.call("ping") == [0, 1]  # queued behind the sleep, then answers


def test_killed_worker_is_reported_within_the_timeout(ray_cluster):
    plan = cpu_plan((2, 1))
    pgs = create_placement_groups(plan, timeout_s=30)
    # starting workers on a busy two-core box can take longer than the call timeout under test
    group = RoleGroup("actor", SumWorker, plan.role("actor"), pgs["actor"], timeout_s=120)
    group.timeout_s = 20
    try:
        ray.kill(group.actors[1])
        t0 = time.time()
        with pytest.raises(RuntimeError, match=r"actor.ping \(rank 1\): .*(died|kill)"):
            while time.time() - t0 < 20:  # ray.kill is asynchronous: on a busy machine a call may still be answered
                group.call("ping")
                time.sleep(0.2)
        assert time.time() - t0 < 20
    finally:
        group.shutdown()
        remove(pgs)


def test_worker_that_fails_to_start_is_reported_and_the_group_cleaned_up(ray_cluster):
    # The start's wait bounds a hang only (the failure comes as soon as rank 1 imports): under the full
    # suite's load two worker starts took more than 30 s together, so it is generous.
    plan = cpu_plan((2, 1))
    pgs = create_placement_groups(plan, timeout_s=30)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)critic start \(rank 1\): .*FileNotFoundError: no model at /nowhere"):
            RoleGroup("critic", BadInitWorker, plan.role("actor"), pgs["actor"], timeout_s=180)
    finally:
        remove(pgs)
    # A start that hangs is named with the wait the caller set, whichever rank it was waiting on by then.
    pgs = create_placement_groups(plan, timeout_s=30)
    try:
        t0 = time.time()
        with pytest.raises(RuntimeError, match=r"critic (rank 0 )?start: no answer within 4 s"):
            RoleGroup("critic", SlowInitWorker, plan.role("actor"), pgs["actor"], timeout_s=4)
        assert time.time() - t0 < 15
    finally:
        remove(pgs)


def test_plan_that_cannot_fit_fails_and_leaves_no_placement_group(ray_cluster):
    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group, remove_placement_group

    with pytest.raises(UserError, match=rf"needs 100 CPUs \(actor 100\) but the Ray cluster has {RAY_HEAD_CPUS}\b"):
        create_placement_groups(cpu_plan((100, 1)), timeout_s=5)
    # Fits the cluster's CPUs, but one is held: waits, gives up, removes what it asked for.
    blocker = placement_group([{"CPU": 1.0}])
    ray.get(blocker.ready(), timeout=30)
    before = set(placement_group_table())
    try:
        t0 = time.time()
        with pytest.raises(UserError, match=rf"within 2 s: it needs {RAY_HEAD_CPUS} CPU .* is free"):
            create_placement_groups(cpu_plan((RAY_HEAD_CPUS, 1)), timeout_s=2)
        assert time.time() - t0 < 10
        new = {k: v for k, v in placement_group_table().items() if k not in before}
        assert new and all(v["state"] == "REMOVED" for v in new.values())
    finally:
        remove_placement_group(blocker)


def test_local_device_index():
    assert local_device_index([], None) == 0
    assert local_device_index([3], "3") == 0  # Ray narrowed CUDA_VISIBLE_DEVICES to this GPU
    assert local_device_index(["5"], "4,5,6") == 1  # NOSET: all GPUs visible, find ours
    assert local_device_index([2], None) == 2
