"""The resource planner: totals of the reference layouts, every bad combination's message, CPU plans."""
from __future__ import annotations

import pytest

from common.errors import UserError
from common.cluster.resources import check_fits, check_fits_here, local_workers, plan_resources, plan_rows

NO_COLOCATE = dict(colocate_actor_ref=False, colocate_critic_reward=False, colocate_all_models=False)


def plan(actor=(1, 8), critic=None, ref=None, reward=None, engines=0, tp=1, use_gpu=True, **flags):
    return plan_resources(actor=actor, critic=critic, ref=ref, reward=reward, vllm_num_engines=engines,
                          vllm_tp=tp, use_gpu=use_gpu, **{**NO_COLOCATE, **flags})


def test_hybrid_engine_layout_is_one_group_of_eight_gpus():
    # The reference's 8-GPU hybrid: all four models and 4 engines x TP 2 on the same 8 GPUs.
    p = plan(critic=(1, 8), ref=(1, 8), reward=(1, 8), engines=4, tp=2, colocate_all_models=True)
    assert len(p.groups) == 1
    (g,) = p.groups
    assert g.bundles == [{"GPU": 1.0, "CPU": 1.0}] * 8
    assert p.total() == {"GPU": 8.0, "CPU": 8.0}
    assert p.vllm_group == g.name and (p.vllm_engines, p.vllm_tp) == (4, 2)
    assert [r.role for r in p.roles] == ["actor", "critic", "ref", "reward"]
    for r in p.roles:
        assert (r.workers, r.group, r.shares) == (8, g.name, 5)
        assert r.gpu_fraction == pytest.approx(0.2) and r.gpu_fraction * 5 <= 1.0
    assert p.vllm_gpu_fraction == pytest.approx(0.2)


def test_grpo_hybrid_without_critic_or_reward_model():
    p = plan(ref=(1, 8), engines=8, tp=1, colocate_all_models=True)
    assert [(r.role, r.shares) for r in p.roles] == [("actor", 3), ("ref", 3)]
    assert p.total() == {"GPU": 8.0, "CPU": 8.0}
    # 1/3 rounds down so three occupants always fit in one bundle.
    assert 3 * p.roles[0].gpu_fraction <= 1.0 < 3 * p.roles[0].gpu_fraction + 1e-3


def test_separate_layout_totals_sum_roles_and_engine_bundles():
    # The reference's 70B shape, every role on its own GPUs: 16 + 16 + 8 + 8 + 4 x 4.
    p = plan(actor=(2, 8), critic=(2, 8), ref=(1, 8), reward=(1, 8), engines=4, tp=4)
    assert {g.name: len(g.bundles) for g in p.groups} == {"actor": 16, "ref": 8, "critic": 16, "reward": 8, "vllm": 4}
    assert p.total() == {"GPU": 64.0, "CPU": 64.0}
    assert all(r.gpu_fraction == 1.0 and r.shares == 1 for r in p.roles)
    # One bundle per engine holds its 4 tensor-parallel GPUs, so Ray keeps each engine on one node.
    assert p.group("vllm").bundles == [{"GPU": 4.0, "CPU": 4.0}] * 4
    assert p.vllm_group == "vllm" and p.vllm_gpu_fraction == 4.0
    assert p.role("actor").workers == 16 and p.role("ref").workers == 8


def test_pairwise_colocation_halves_the_gpus():
    p = plan(actor=(2, 8), critic=(2, 8), ref=(2, 8), reward=(2, 8), engines=4, tp=4,
             colocate_actor_ref=True, colocate_critic_reward=True)
    assert {g.name: len(g.bundles) for g in p.groups} == {"actor+ref": 16, "critic+reward": 16, "vllm": 4}
    assert p.total()["GPU"] == 48.0
    assert p.role("ref").group == "actor+ref" and p.role("reward").group == "critic+reward"
    assert p.role("actor").gpu_fraction == 0.5 and p.role("critic").gpu_fraction == 0.5


def test_colocation_flags_without_a_partner_change_nothing():
    # GRPO has no critic: --colocate_critic_reward leaves the reward model on its own GPUs.
    p = plan(reward=(1, 4), colocate_critic_reward=True, colocate_actor_ref=True)
    assert {g.name: len(g.bundles) for g in p.groups} == {"actor": 8, "reward": 4}


def test_cpu_plan_counts_one_worker_per_node_for_zero_or_one_gpu():
    p = plan(actor=(2, 0), ref=(1, 1), engines=1, tp=1, use_gpu=False)
    assert (p.role("actor").workers, p.role("ref").workers) == (2, 1)
    assert all(r.gpu_fraction == 0.0 for r in p.roles)
    assert all(b == {"CPU": 1.0} for g in p.groups for b in g.bundles)
    assert p.total() == {"CPU": 4.0}
    # Colocated on CPU: the bundle's one CPU is split, no GPU asked for.
    q = plan(actor=(1, 2), ref=(1, 2), use_gpu=False, colocate_actor_ref=True)
    assert q.total() == {"CPU": 2.0}
    assert [(r.cpu_fraction, r.gpu_fraction) for r in q.roles] == [(0.5, 0.0), (0.5, 0.0)]


@pytest.mark.parametrize("kwargs, words", [
    (dict(critic=(2, 8), colocate_all_models=True), ["critic", "--critic_num_nodes 1", "--colocate_all_models"]),
    (dict(ref=(1, 4), colocate_all_models=True), ["--ref_num_gpus_per_node 8", "drop --colocate_all_models"]),
    (dict(engines=4, tp=4, colocate_all_models=True),
     ["4 x 4 = 16", "must equal actor nodes x GPUs per node", "1 x 8 = 8", "--vllm_num_engines 2"]),
    (dict(ref=(1, 4), colocate_actor_ref=True), ["--colocate_actor_ref", "--ref_num_gpus_per_node 8"]),
    (dict(critic=(1, 8), reward=(2, 8), colocate_critic_reward=True),
     ["--colocate_critic_reward", "--reward_num_nodes 1"]),
    (dict(engines=1, tp=0), ["--vllm_tensor_parallel_size 0"]),
    (dict(engines=-1), ["--vllm_num_engines -1"]),
    (dict(actor=(0, 8)), ["--actor_num_nodes 0"]),
    (dict(critic=(1, -1)), ["--critic_num_gpus_per_node -1"]),
    (dict(reward=(1, 0)), ["--reward_num_gpus_per_node 0", "at least 1 GPU"]),
])
def test_bad_combinations_name_the_fix(kwargs, words):
    with pytest.raises(UserError) as e:
        plan(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_check_fits_names_the_shortfall_and_the_fix():
    p = plan(critic=(1, 8))
    check_fits(p, {"GPU": 16.0, "CPU": 64.0})
    with pytest.raises(UserError) as e:
        check_fits(p, {"GPU": 8.0, "CPU": 64.0})
    assert str(e.value) == ("the plan needs 16 GPUs (actor 8, critic 8) but the Ray cluster has 8; lower "
                            "--critic_num_gpus_per_node or add nodes, or use --colocate_all_models")
    with pytest.raises(UserError, match=r"needs 3 CPUs \(actor 3\) but the Ray cluster has 2; lower --actor_num_nodes"):
        check_fits(plan(actor=(3, 0), use_gpu=False), {"CPU": 2.0})
    with pytest.raises(UserError, match="needs 8 GPUs .* has 0"):
        check_fits(plan(), {"CPU": 2.0})


def test_a_local_ray_refuses_more_worker_processes_than_the_machine_holds(monkeypatch):
    """A Ray of the run's own is made to fit the plan's bundles; the machine is not: the 8-GPU hybrid command on a
    CPU is 24 processes (the reference and the reward model load into the actor's: common.rl.guests), against 4 per
    core, and gets the README's counts, which fit, with the sleep flags in the same message."""
    monkeypatch.delenv("HYBRIDRL_SHARE_PROCESS", raising=False)
    ref = dict(critic=(1, 8), ref=(1, 8), reward=(1, 8), engines=4, tp=2, colocate_all_models=True, use_gpu=False)
    assert local_workers(plan(**ref)) == {"actor": 8, "critic": 8, "vllm": 8}
    sleep = [("--vllm_enable_sleep", "vLLM cannot sleep on CPU")]
    with pytest.raises(UserError) as e:
        check_fits_here(plan(**ref), sleep, cores=2)
    assert str(e.value) == (
        "the plan starts 24 worker processes (actor 8, critic 8, vllm 8) but a Ray of its own on this machine runs "
        "at most 8 (4 per CPU core, 2 cores; each loads torch and its model). On a CPU each GPU of "
        "--*_num_gpus_per_node is a worker process on a logical CPU, so a CPU run takes the README's counts; this "
        "command needs all of: --actor_num_gpus_per_node 1, --critic_num_gpus_per_node 1, --ref_num_gpus_per_node 1, "
        "--reward_num_gpus_per_node 1, --vllm_num_engines 1, --vllm_tensor_parallel_size 1, drop --vllm_enable_sleep "
        "(vLLM cannot sleep on CPU). Or join a Ray cluster with room for them (RAY_ADDRESS=<head>:<port>)")
    counts = dict(ref, actor=(1, 1), critic=(1, 1), ref=(1, 1), reward=(1, 1), engines=1, tp=1)
    check_fits_here(plan(**counts), cores=2)  # what the message asks for: 3 processes
    with pytest.raises(UserError, match=r"^on CPU: drop --vllm_enable_sleep"):  # fits: the sleep flag alone
        check_fits_here(plan(**counts), sleep, cores=2)
    # a process per role: 5 for the README's counts on their own CPUs, over 1 core's 4: colocating is the change
    with pytest.raises(UserError, match=r"starts 5 worker processes .* at most 4 \(4 per CPU core, 1 core;.* all of: "
                                        r"--colocate_all_models\. Or join"):
        check_fits_here(plan(**dict(counts, colocate_all_models=False)), cores=1)
    with pytest.raises(UserError, match=r"starts 9 worker processes \(actor 9\) .*; lower --actor_num_nodes, or join"):
        check_fits_here(plan(actor=(9, 1), use_gpu=False), cores=2)
    monkeypatch.setenv("HYBRIDRL_SHARE_PROCESS", "0")  # the frozen models in processes of their own
    assert sum(local_workers(plan(**counts)).values()) == 5
    check_fits_here(plan(critic=(1, 8), ref=(1, 8), reward=(1, 8), engines=4, tp=2, colocate_all_models=True),
                    cores=1)  # on GPUs Ray counts the GPUs themselves (check_fits after it starts)


def test_plan_rows_show_who_shares_what():
    p = plan(critic=(1, 8), ref=(1, 8), engines=4, tp=2, colocate_all_models=True)
    rows = {r["role"]: r for r in plan_rows(p)}
    assert list(rows) == ["actor", "critic", "ref", "vllm"]
    assert set(rows["actor"]) == {"role", "nodes", "GPUs/node", "workers", "colocated with", "placement"}
    assert rows["actor"]["colocated with"] == "critic, ref, vllm"
    assert rows["actor"]["workers"] == "8" and "0.25 GPU each" in rows["actor"]["placement"]
    assert rows["vllm"]["GPUs/node"] == "4 engines x TP 2" and rows["vllm"]["colocated with"] == "actor, critic, ref"
    alone = plan_rows(plan(actor=(1, 0), use_gpu=False))
    assert alone[0]["colocated with"] == "-" and alone[0]["workers"] == "1"
