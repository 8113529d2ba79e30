"""Resource plan for the Ray drivers (PPO, GRPO): which role sits on which GPUs, decided up front.

`plan_resources` turns the cluster flags into placement groups before any actor starts, so a bad
layout fails in a second with the flag to change instead of after minutes of model loading. It is
pure Python (no ray, no torch): the `--dry_run` banner and the tests call it on any machine.

Layout rules, with OpenRLHF's flag names:
- every role (actor, critic, ref, reward) is `--{role}_num_nodes` x `--{role}_num_gpus_per_node`
  workers, one per GPU, forming one torch.distributed group; a role passed as None is absent;
- `--colocate_actor_ref` / `--colocate_critic_reward` put the second role on the first one's GPUs;
  `--colocate_all_models` puts every role and the vLLM engines on the actor's GPUs (hybrid engine);
- roles sharing a placement group share its bundles: bundle i hosts rank i of each of them, and
  each takes 1/k of the GPU (and of the bundle's CPU) when k occupants share it;
- on CPU (`use_gpu=False`) each "GPU per node" is one CPU worker (`--actor_num_gpus_per_node 0` and 1
  both mean one worker per node) and every bundle is {"CPU": 1}; a cluster too small for the plan
  gets the README's CPU counts as the fix (`check_fits`), and so does a plan with more worker
  processes than a Ray of the run's own on this machine can hold (`check_fits_here`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from common.errors import UserError

ROLES = ("actor", "critic", "ref", "reward")
# Worker processes a Ray of the run's own may start per CPU core. Each loads torch, DeepSpeed or vLLM and
# its model, single-threaded, and mostly waits on the others (the tests run 8 on 2 cores); OpenRLHF's 8-GPU
# hybrid command, 24 processes on 2 cores, spent minutes starting them and then ran out of memory.
LOCAL_WORKERS_PER_CORE = 4


@dataclass(frozen=True)
class RolePlan:
    role: str
    num_nodes: int
    gpus_per_node: int
    workers: int  # world size of the role's torch.distributed group
    group: str  # placement group it lives in (roles sharing GPUs share a group)
    gpu_fraction: float  # GPU per worker: 1.0 alone, 1/k when k occupants share a bundle, 0 on CPU
    shares: int = 1  # occupants of each of its bundles (roles, plus vLLM when colocated there)

    @property
    def cpu_fraction(self) -> float:
        """CPU per worker: each bundle holds one CPU, split between its occupants."""
        return _fraction(self.shares)


@dataclass(frozen=True)
class PlacementPlan:
    name: str
    bundles: list[dict[str, float]]


@dataclass(frozen=True)
class Plan:
    roles: list[RolePlan]
    groups: list[PlacementPlan]
    vllm_engines: int
    vllm_tp: int
    vllm_group: str | None  # group the engines are placed in (None: no engines)
    use_gpu: bool
    vllm_gpu_fraction: float = 0.0  # GPU per engine worker (1/k when colocated with k roles)
    inputs: dict = field(default_factory=dict, compare=False, repr=False)  # plan_resources' keywords

    def role(self, name: str) -> RolePlan | None:
        return next((r for r in self.roles if r.role == name), None)

    def group(self, name: str) -> PlacementPlan:
        return next(g for g in self.groups if g.name == name)

    def total(self) -> dict[str, float]:
        """Resources the whole plan reserves, e.g. {"GPU": 8.0, "CPU": 8.0}."""
        out: dict[str, float] = {}
        for g in self.groups:
            for b in g.bundles:
                for k, v in b.items():
                    out[k] = out.get(k, 0.0) + v
        return out


def _fraction(k: int) -> float:
    # Ray keeps resources to 1e-4; rounding down keeps k * (1/k) <= 1 so k actors fit one bundle.
    return math.floor(10_000 / k) / 10_000


def _shape_error(role: str, shape: tuple[int, int], actor_like: str, target: tuple[int, int], flag: str) -> UserError:
    return UserError(
        f"{flag} puts {role} on the {actor_like}'s GPUs, but {role} is {shape[0]} node(s) x {shape[1]} GPUs "
        f"and {actor_like} is {target[0]} x {target[1]}; set --{role}_num_nodes {target[0]} "
        f"--{role}_num_gpus_per_node {target[1]}, or drop {flag}"
    )


def plan_resources(
    *,
    actor: tuple[int, int],
    critic: tuple[int, int] | None,
    ref: tuple[int, int] | None,
    reward: tuple[int, int] | None,
    vllm_num_engines: int,
    vllm_tp: int,
    colocate_actor_ref: bool,
    colocate_critic_reward: bool,
    colocate_all_models: bool,
    use_gpu: bool,
) -> Plan:
    """Plan placement groups for the roles and vLLM engines; raise UserError on a bad combination.

    Each role is (num_nodes, gpus_per_node) or None when the algorithm does not use it (no critic in
    GRPO, no ref when the KL coefficient is 0, no reward model when a function scores answers).
    `--colocate_actor_ref` with no ref (or `--colocate_critic_reward` without both roles) changes
    nothing, since there is nothing to share.
    """
    inputs = dict(locals())  # kept in the plan: the CPU advice plans again with other counts
    shapes = {"actor": actor, "critic": critic, "ref": ref, "reward": reward}
    present = [r for r in ROLES if shapes[r] is not None]
    for r in present:
        nodes, gpus = shapes[r]
        if nodes < 1:
            raise UserError(f"--{r}_num_nodes {nodes}: a role needs at least 1 node")
        if gpus < 0:
            raise UserError(f"--{r}_num_gpus_per_node {gpus}: must be 0 or more")
        if use_gpu and gpus == 0:
            raise UserError(
                f"--{r}_num_gpus_per_node 0: on a GPU cluster every role needs at least 1 GPU per node"
            )
    if vllm_tp < 1:
        raise UserError(f"--vllm_tensor_parallel_size {vllm_tp}: must be 1 or more")
    if vllm_num_engines < 0:
        raise UserError(f"--vllm_num_engines {vllm_num_engines}: must be 0 or more (0: no vLLM engines)")

    def workers(r: str) -> int:
        nodes, gpus = shapes[r]
        return nodes * (gpus if use_gpu else max(gpus, 1))

    bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
    vllm_workers = vllm_num_engines * vllm_tp

    # Which roles share whose group: members[leader] lists the roles in the leader's group.
    members: dict[str, list[str]] = {}
    vllm_group: str | None = None
    if colocate_all_models:
        for r in present[1:]:
            if shapes[r] != actor:
                raise _shape_error(r, shapes[r], "actor", actor, "--colocate_all_models")
        if vllm_num_engines and vllm_workers != workers("actor"):
            raise UserError(
                f"--colocate_all_models puts the vLLM engines on the actor's GPUs: --vllm_num_engines x "
                f"--vllm_tensor_parallel_size ({vllm_num_engines} x {vllm_tp} = {vllm_workers}) must equal "
                f"actor nodes x GPUs per node ({actor[0]} x {actor[1]} = {workers('actor')}); e.g. "
                f"--vllm_num_engines {max(workers('actor') // vllm_tp, 1)} with --vllm_tensor_parallel_size "
                f"{vllm_tp if workers('actor') % vllm_tp == 0 else 1}"
            )
        members["actor"] = list(present)
    else:
        members["actor"] = ["actor"]
        if ref is not None:
            if colocate_actor_ref:
                if ref != actor:
                    raise _shape_error("ref", ref, "actor", actor, "--colocate_actor_ref")
                members["actor"].append("ref")
            else:
                members["ref"] = ["ref"]
        if critic is not None:
            members["critic"] = ["critic"]
        if reward is not None:
            if colocate_critic_reward and critic is not None:
                if reward != critic:
                    raise _shape_error("reward", reward, "critic", critic, "--colocate_critic_reward")
                members["critic"].append("reward")
            else:
                members["reward"] = ["reward"]

    roles: list[RolePlan] = []
    groups: list[PlacementPlan] = []
    vllm_fraction = 0.0
    for leader, names in members.items():
        engines_here = colocate_all_models and vllm_num_engines > 0
        name = "+".join(names + (["vllm"] if engines_here else []))
        shares = len(names) + (1 if engines_here else 0)
        groups.append(PlacementPlan(name, [dict(bundle) for _ in range(workers(leader))]))
        frac = _fraction(shares) if use_gpu else 0.0
        for r in names:
            roles.append(RolePlan(r, shapes[r][0], shapes[r][1], workers(r), name, frac, shares))
        if engines_here:
            vllm_group, vllm_fraction = name, frac
    if vllm_num_engines and vllm_group is None:
        # One bundle per engine holding all its tensor-parallel GPUs: a bundle lies on one node, as
        # the engine's workers must (they talk over NVLink / shared memory).
        vllm_group = "vllm"
        vllm_fraction = float(vllm_tp) if use_gpu else 0.0
        groups.append(PlacementPlan("vllm", [{k: v * vllm_tp for k, v in bundle.items()} for _ in range(vllm_num_engines)]))
    roles.sort(key=lambda p: ROLES.index(p.role))
    return Plan(roles, groups, vllm_num_engines, vllm_tp, vllm_group, use_gpu, vllm_fraction, inputs)


def _group_flags(plan: Plan, group: str) -> list[str]:
    if group == "vllm":
        return ["--vllm_num_engines"]
    unit = "num_gpus_per_node" if plan.use_gpu else "num_nodes"
    return [f"--{r.role}_{unit}" for r in plan.roles if r.group == group]


def check_fits(plan: Plan, available: dict[str, float] | None, drop: list[tuple[str, str]] = ()) -> None:
    """Compare the plan's totals with `available` (e.g. `ray.cluster_resources()`; None: a cluster made to
    fit); UserError if short. `drop`: (flag, why) pairs a CPU run refuses (the sleep flags), named in the
    same message, so that one attempt gets every change the command needs."""
    dropped_list = [f"drop {flag} ({why})" for flag, why in drop]
    dropped = "; ".join(dropped_list)
    need = plan.total()
    for key, label in (("GPU", "GPUs"), ("CPU", "CPUs")):
        want, have = need.get(key, 0.0), (need if available is None else available).get(key, 0.0)
        if want <= have + 1e-6:
            continue
        parts = [(g.name, sum(b.get(key, 0.0) for b in g.bundles)) for g in plan.groups]
        parts = [(n, v) for n, v in parts if v]
        short = f"the plan needs {want:g} {label} ({', '.join(f'{n} {v:g}' for n, v in parts)}) but the Ray cluster has {have:g}"
        changes = None if plan.use_gpu else _cpu_counts(plan, lambda p: p.total().get("CPU", 0.0) <= have + 1e-6)
        if changes is not None:
            raise UserError(
                f"{short}. {_COUNTS}{', '.join(changes + dropped_list)}. Or start the cluster with more logical CPUs "
                f"(`ray start --num-cpus {math.ceil(want)}`; CPU workers mostly wait on each other)")
        biggest = max(reversed(parts), key=lambda p: p[1])[0]  # ties: not the actor's
        fixes = f"lower {' or '.join(_group_flags(plan, biggest))} or add nodes"
        if len(plan.groups) > 1:
            fixes += ", or use --colocate_all_models"
        if not plan.use_gpu:
            # Logical CPUs may exceed the physical ones: workers of a CPU run mostly wait on each other.
            fixes += " (or start the cluster with more logical CPUs: `ray start --num-cpus N`)"
        raise UserError(f"{short}; {fixes}{'; and ' + dropped if dropped else ''}")
    if drop:
        raise UserError(f"on CPU: {dropped}")


def local_workers(plan: Plan) -> dict[str, int]:
    """Worker processes of the plan by role ("vllm": the engines' workers), e.g. {"actor": 8, "critic": 8,
    "vllm": 8}: a frozen role loaded into a trained role's processes (common.rl.guests) starts none."""
    hosted = hosts(plan)
    out = {r.role: r.workers for r in plan.roles if r.role not in hosted}
    if plan.vllm_engines:
        out["vllm"] = plan.vllm_engines * plan.vllm_tp
    return out


def check_fits_here(plan: Plan, drop: list[tuple[str, str]] = (), cores: int | None = None) -> None:
    """`check_fits` for a Ray of the run's own on this machine, before it starts: that Ray is made to fit
    the plan's bundles, so on a GPU only `drop` can refuse; on a CPU the plan's worker processes must also
    fit LOCAL_WORKERS_PER_CORE x this machine's `cores` (default: the ones this process may run on), else
    UserError with the README's CPU counts and `drop`, as a cluster too small for the plan gets."""
    if not plan.use_gpu:
        if cores is None:  # a Slurm or container allocation limits the affinity, not os.cpu_count()
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        limit = LOCAL_WORKERS_PER_CORE * cores
        workers = local_workers(plan)
        if sum(workers.values()) > limit:
            short = (f"the plan starts {sum(workers.values())} worker processes "
                     f"({', '.join(f'{k} {v}' for k, v in workers.items())}) but a Ray of its own on this machine "
                     f"runs at most {limit} ({LOCAL_WORKERS_PER_CORE} per CPU core, {cores} core{'s' * (cores > 1)}; "
                     f"each loads torch and its model)")
            elsewhere = "join a Ray cluster with room for them (RAY_ADDRESS=<head>:<port>)"
            dropped = [f"drop {flag} ({why})" for flag, why in drop]
            changes = _cpu_counts(plan, lambda p: sum(local_workers(p).values()) <= limit)
            if changes is not None:
                raise UserError(f"{short}. {_COUNTS}{', '.join(changes + dropped)}. Or {elsewhere}")
            biggest = max(reversed(workers.items()), key=lambda kv: kv[1])[0]  # ties: not the actor's
            fixes = [f"lower {'--vllm_num_engines' if biggest == 'vllm' else f'--{biggest}_num_nodes'}"]
            if len(workers) > 1 and not plan.inputs.get("colocate_all_models"):
                fixes.append("use --colocate_all_models")
            raise UserError(f"{short}; {', '.join(fixes)}, or {elsewhere}"
                            f"{'; and ' + '; '.join(dropped) if dropped else ''}")
    check_fits(plan, None, drop)


_COUNTS = ("On a CPU each GPU of --*_num_gpus_per_node is a worker process on a logical CPU, so a CPU run takes "
           "the README's counts; this command needs all of: ")


def _cpu_counts(plan: Plan, fits) -> list[str] | None:
    """The flags that give this command the README's CPU counts (1 worker per role and node, engines of
    TP 1, all on the actor's bundles when it still does not fit), if then `fits(plan)`."""
    inp = plan.inputs
    ones = {r: (inp[r][0], min(inp[r][1], 1)) if inp.get(r) else None for r in ROLES}
    engines = inp.get("vllm_num_engines", 0)
    for colocate in dict.fromkeys([inp.get("colocate_all_models", False), True]):
        n = (ones["actor"][0] if colocate else 1) if engines else 0  # colocated: engines x TP = actor workers
        try:
            p = plan_resources(**{**inp, **ones, "vllm_num_engines": n, "vllm_tp": 1, "colocate_all_models": colocate})
        except UserError:
            continue
        if fits(p):
            out = [f"--{r}_num_gpus_per_node 1" for r in ROLES if inp.get(r) and inp[r][1] > 1]
            out += [f"--vllm_num_engines {n}"] if engines and n != engines else []
            out += ["--vllm_tensor_parallel_size 1"] if engines and inp["vllm_tp"] != 1 else []
            return out + (["--colocate_all_models"] if colocate and not inp["colocate_all_models"] else [])
    return None


def plan_rows(plan: Plan) -> list[dict[str, str]]:
    """Rows for the startup banner's table: role, nodes, GPUs/node, workers, colocated with, placement."""
    rows = []
    for r in plan.roles:
        mates = [o.role for o in plan.roles if o.group == r.group and o.role != r.role]
        if plan.vllm_group == r.group:
            mates.append("vllm")
        share = f", {r.gpu_fraction:g} GPU each" if plan.use_gpu else ""
        rows.append({
            "role": r.role,
            "nodes": str(r.num_nodes),
            "GPUs/node": str(r.gpus_per_node) if plan.use_gpu else f"{r.gpus_per_node} (CPU: {r.workers // r.num_nodes} worker/node)",
            "workers": str(r.workers),
            "colocated with": ", ".join(mates) or "-",
            "placement": f"group {r.group}: bundles 0-{r.workers - 1}{share}",
        })
    if plan.vllm_engines:
        n = plan.vllm_engines * plan.vllm_tp
        mates = [o.role for o in plan.roles if o.group == plan.vllm_group]
        own = plan.vllm_group == "vllm"
        bundles = plan.vllm_engines if own else n
        share = f", {plan.vllm_gpu_fraction:g} GPU{'s' if plan.vllm_gpu_fraction > 1 else ''} each" if plan.use_gpu else ""
        rows.append({
            "role": "vllm",
            "nodes": "-",
            "GPUs/node": f"{plan.vllm_engines} engines x TP {plan.vllm_tp}",
            "workers": str(n),
            "colocated with": ", ".join(mates) or "-",
            "placement": f"group {plan.vllm_group}: bundle{'s 0-' if bundles > 1 else ' '}{bundles - 1}{share}",
        })
    return rows


def plan_summary(plan: Plan) -> str:
    """One line under the plan table, e.g. 'total: 8 GPUs in 1 placement group(s)'."""
    total = plan.total()
    unit = f"{total.get('GPU', 0):g} GPUs" if plan.use_gpu else f"{total.get('CPU', 0):g} CPU bundles"
    return f"total: {unit} in {len(plan.groups)} placement group(s)"


# Frozen roles loaded into a trained role's processes (common.rl.guests): a placement decision.
FROZEN = ("ref", "reward")
TRAINED = ("actor", "critic")


def hosts(plan) -> dict[str, str]:
    """{frozen role: the trained role whose processes load it} under `plan` (common.cluster.resources.Plan)."""
    if os.environ.get("HYBRIDRL_SHARE_PROCESS", "1") == "0":
        return {}
    roles = {r.role: r for r in plan.roles}
    out = {}
    for f in FROZEN:
        for t in TRAINED:
            if f in roles and t in roles and (roles[t].group, roles[t].num_nodes, roles[t].workers) == \
                    (roles[f].group, roles[f].num_nodes, roles[f].workers):
                out[f] = t
                break
    return out


def hosted_note(hosted: dict[str, str]) -> str | None:
    """The banner's line for `hosts`' answer."""
    if not hosted:
        return None
    said = ", ".join(f"the {'reference' if f == 'ref' else 'reward model'} in the {t}'s" for f, t in hosted.items())
    return f"{said} processes (same GPUs: one CUDA context and allocator per GPU; HYBRIDRL_SHARE_PROCESS=0 declines)"
