"""Ray actor groups: one group of worker actors per role, each group one torch.distributed world.

The driver (train_ppo.py / train_grpo.py) plans resources with `common.cluster.resources`, reserves them
with `create_placement_groups`, then builds a `RoleGroup` per role from a plain worker class that
subclasses `BaseWorker`. Rank 0 of a role picks the rendezvous address; the other ranks are created
with it, and each worker's own init method calls `common.training.ds.setup_distributed()`.

Everything that waits on a worker goes through `get`, which turns a hang into a timeout error and a
dead worker or a worker exception into one short `RuntimeError` naming the role and the rank.
torch is imported only inside the workers; ray is imported lazily so `--help` stays light.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time

from common import cpu_threads
from common.errors import TrainingError, UserError
from common.cluster.resources import Plan, RolePlan, check_fits, check_fits_here

# Passed on to every worker: with it set, Ray leaves CUDA_VISIBLE_DEVICES alone (all GPUs of the
# node visible), which lets colocated vLLM engines and trainers address devices by index.
# Passed on to every worker, so a job submitted to a running cluster behaves as the driver would:
# device visibility, the DeepSpeed op build cache, offline hub, caches, vLLM CPU settings.
_WORKER_ENV = ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "TORCH_EXTENSIONS_DIR", "HF_HUB_OFFLINE", "HF_HOME",
               "HYBRIDRL_CACHE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CACHE_ROOT",
               "PYTHONPATH", "VLLM_USE_V2_MODEL_RUNNER", "TORCHINDUCTOR_COMPILE_THREADS", "HYBRIDRL_VLLM_WARMUP",
               "TRITON_CACHE_DIR", "HYBRIDRL_EXPANDABLE_SEGMENTS", "HYBRIDRL_SPLIT_CORES")


def init_ray(num_cpus: int | None = None, log_to_driver: bool = False, plan: Plan | None = None,
             drop: list[tuple[str, str]] = ()) -> dict:
    """Connect to Ray, or start a local one; return `ray.cluster_resources()`. Idempotent.

    An existing cluster is used when RAY_ADDRESS is set (`ray job submit` sets it) or a `ray start`
    cluster runs on this machine (`_existing_cluster`). Otherwise a local cluster starts with `num_cpus`
    logical CPUs (a CPU run needs one per worker; more than the physical cores is fine). With a `plan`,
    it is checked together with `drop` against the cluster (`check_fits`), or, before a local one
    starts, against this machine (`check_fits_here`).
    """
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()
    existing = _existing_cluster()
    kwargs = dict(log_to_driver=log_to_driver)
    try:
        if existing:
            # Workers of a running cluster have its environment, not ours: pass ours on. (A local
            # cluster's workers inherit this process's environment; there a job-level runtime_env
            # only costs each actor a second Python start, ~1 CPU-second, and idles the spare workers.)
            env = {k: os.environ[k] for k in _WORKER_ENV if k in os.environ}
            if env:
                kwargs["runtime_env"] = {"env_vars": env}
            # No explicit address: Ray resolves the same one, and only then picks up the token of
            # a `ray start` cluster on this machine (Ray 2.60 turns token auth on by default).
            ray.init(**kwargs)
        else:
            # A cluster of our own on this machine: no other client will join it, so Ray's token
            # auth (on by default since 2.60) only adds a warning line.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            if plan is not None:  # before any process starts: Ray would take any plan, this machine may not
                check_fits_here(plan, drop)
            from common.cluster.ray_local import start_watcher

            temp = start_watcher()  # so that the cluster goes with this process, even after a SIGKILL
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                     _temp_dir=temp, **kwargs)
    except (ray.exceptions.AuthenticationError, ConnectionError, RuntimeError) as e:
        if not existing:
            raise
        # Ray reports a refused token as a ConnectionError after ~20 s of retries; the cause is inside.
        chain, err = [], e
        while err is not None and len(chain) < 5:
            chain.append(str(err))
            err = err.__cause__ or err.__context__
        if any("AuthToken" in c or "Authentication" in c for c in chain):
            raise UserError(
                f"the Ray cluster at {existing} wants an auth token; run with RAY_AUTH_MODE=token (the "
                f"token is in ~/.ray/auth_token on the head node), or start the cluster with "
                f"RAY_AUTH_MODE=disabled ray start ..."
            ) from None
        raise UserError(
            f"could not connect to the Ray cluster at {existing} ({str(e).splitlines()[0]}); check RAY_ADDRESS "
            f"and that `ray status` shows the cluster, or unset RAY_ADDRESS to start a local one"
        ) from None
    if plan is not None:
        check_fits(plan, ray.cluster_resources(), drop)
    return ray.cluster_resources()


def _existing_cluster() -> str | None:
    """The address of the cluster to join, probed; None: start a local Ray.

    RAY_ADDRESS when set; else (and with RAY_ADDRESS=auto) the cluster `ray start` recorded in Ray's
    cluster file on this machine, which stays behind when that head dies without `ray stop`. A run not
    given an address then starts a local Ray, saying so in one line; RAY_ADDRESS=auto, which asks for that
    cluster, is refused naming the file.
    """
    given = os.environ.get("RAY_ADDRESS") or None
    try:
        from ray._private.services import canonicalize_bootstrap_address
        from ray._private.utils import get_ray_address_file, read_ray_address
    except ImportError:  # a Ray without these helpers: only RAY_ADDRESS counts
        address, recorded = given, None
    else:
        # The file is read here rather than by Ray's own lookup, which also logs every other Ray
        # running on this machine and "Connecting to latest cluster at" a cluster we may not join.
        recorded = get_ray_address_file(None)  # `ray start` writes it in RAY_TMPDIR (or TMPDIR, or /tmp) /ray
        address = (read_ray_address() if given in (None, "auto") else None) or given
        try:  # localhost becomes this node's IP; a Ray Client address (ray://) is Ray's to parse
            address = canonicalize_bootstrap_address(address) if address and "://" not in address else address
        except ConnectionError:  # RAY_ADDRESS=auto, and no cluster recorded or running here
            raise UserError(f"RAY_ADDRESS=auto: no Ray cluster runs on this machine (none recorded in {recorded}); "
                            "start one with `ray start --head`, or unset RAY_ADDRESS to start a local Ray") from None
    if not address or address.startswith("ray://"):
        return address
    # Ray retries an address nobody listens on for minutes; a plain TCP probe answers at once.
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        return address
    except (OSError, ValueError) as e:
        err = e
    if given not in (None, "auto") or not (recorded and os.path.exists(recorded)):
        raise UserError(
            f"nothing answers at the Ray address {address} ({err}); check RAY_ADDRESS and that `ray status` "
            f"shows the cluster, or unset RAY_ADDRESS to start a local Ray")
    stale = f"{address}, the cluster recorded in {recorded} (a `ray start` head that stopped without `ray stop`)"
    if given == "auto":
        raise UserError(f"RAY_ADDRESS=auto: nothing answers at {stale} ({err}); start that cluster again, or "
                        "unset RAY_ADDRESS to start a local Ray")
    print(f"warning: nothing answers at {stale}: starting a local Ray for this run", file=sys.stderr, flush=True)
    return None


def create_placement_groups(plan: Plan, timeout_s: float = 60) -> dict:
    """Reserve one placement group per `plan.groups` entry: {name: PlacementGroup}.

    Bundles are packed (a node is filled before the next one is used). When Ray cannot place them
    within `timeout_s` (the cluster is short, or busy with another job) they are removed again.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    check_fits(plan, ray.cluster_resources())
    pgs = {g.name: placement_group(g.bundles, strategy="PACK") for g in plan.groups}
    _, pending = ray.wait([pg.ready() for pg in pgs.values()], num_returns=len(pgs), timeout=timeout_s)
    if pending:
        for pg in pgs.values():
            remove_placement_group(pg)
        need = ", ".join(f"{v:g} {k}" for k, v in sorted(plan.total().items()))
        free = ", ".join(f"{v:g} {k}" for k, v in sorted(ray.available_resources().items()) if k in ("CPU", "GPU"))
        raise UserError(
            f"Ray could not reserve the plan's resources within {timeout_s:.0f} s: it needs {need} "
            f"(groups: {', '.join(f'{g.name} {len(g.bundles)} bundles' for g in plan.groups)}) but only "
            f"{free or 'nothing'} is free (another job may hold the rest, or no single node has room); "
            f"lower the --*_num_gpus_per_node / --vllm_num_engines flags, use --colocate_all_models, or add nodes"
        )
    return pgs


def local_device_index(gpu_ids: list, visible: str | None) -> int:
    """Index torch uses for the GPU Ray assigned (`gpu_ids[0]`), given CUDA_VISIBLE_DEVICES.

    Ray normally sets CUDA_VISIBLE_DEVICES to the actor's own GPU, so the index is 0; with
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES all of the node's GPUs stay visible and the index is
    the GPU's position in that list (or its id when the variable is unset). 0 on CPU.
    """
    if not gpu_ids:
        return 0
    gpu = str(gpu_ids[0])
    if visible:
        ids = [v.strip() for v in visible.split(",")]
        if gpu in ids:
            return ids.index(gpu)
    return int(gpu)


class BaseWorker:
    """Mixin for worker actor classes: sets the env that joins the role's torch.distributed group.

    Subclasses take (role, rank, world_size, master_addr, master_port, *init_args) and call
    `super().__init__(role, rank, world_size, master_addr, master_port)`. They join the group with
    `common.training.ds.setup_distributed()` in a later method (e.g. `init_model`), never in `__init__`: rank
    0 answers `node_address` before the other ranks exist, so joining in `__init__` would deadlock.
    Rank 0 is created with master_addr=None: it serves the group's store on its node (`host_store`).
    """

    def __init__(self, role: str, rank: int, world_size: int, master_addr: str | None, master_port: int | None):
        import ray

        if master_addr is None:
            from common.training.dist import host_store

            master_addr = ray.util.get_node_ip_address()
            master_port = host_store(master_addr)[1]
        self.role, self.rank, self.world_size = role, rank, world_size
        self._master = (master_addr, int(master_port))
        gpu_ids = ray.get_gpu_ids()
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(local_device_index(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        if not gpu_ids:
            import torch

            # Several CPU workers share a few cores: one thread each avoids oversubscription stalls.
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
            cpu_threads.pin("trainer")

    def node_address(self) -> tuple[str, int]:
        """(IP, port) of the rendezvous; rank 0's answer is handed to the other ranks."""
        return self._master

    def ping(self) -> int:
        return self.rank

    def cores(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    def placement(self) -> tuple[str, list[str]]:
        """(Ray node id, ids of the GPUs Ray gave this worker): where a colocated vLLM engine's
        tensor-parallel workers must run to share this rank's GPU."""
        import ray

        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


_NOISE = re.compile(r"^\s*[\^~]+\s*$|^\s*(actor_id|namespace|pid|ip): ")  # caret marks, Ray's ids
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _short(text: str, head: int = 3, tail: int = 8) -> str:
    lines = [ln for ln in _ANSI.sub("", str(text)).strip().splitlines() if ln.strip() and not _NOISE.match(ln)]
    if len(lines) <= head + tail:
        return "\n".join(lines)
    return "\n".join(lines[:head] + ["  ..."] + lines[-tail:])


def describe_failure(err: BaseException) -> str:
    import ray

    if isinstance(err, ray.exceptions.RayTaskError):
        # The worker's traceback ends with its frame and message; the driver-side wrapper adds nothing.
        # (the instance raised is a dual RayTaskError(cause) whose str() is the worker's traceback)
        tb = _short(str(err), 0, 1000).splitlines()
        where = next((ln.strip() for ln in reversed(tb) if ln.strip().startswith("File ")), "")
        cause = err.__dict__.get("cause")
        msg = f"{type(cause).__name__}: {cause}" if cause is not None else (tb[-1] if tb else str(err))
        return _short(msg) + (f"\n  (in the worker: {where})" if where else "")
    return _short(str(err))


def get(refs, timeout_s: float, what: str, *, budget_s: float | None = None):
    """`ray.get` that fails in `timeout_s` and reports a worker's failure as a short RuntimeError.

    `refs` is one ObjectRef or a list (then the failing or silent ranks are named). `budget_s`, where this
    wait is the rest of a longer one, is the whole wait the message names (the one the caller set).
    """
    import ray

    many = isinstance(refs, list)
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        late = ""
        if many:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = f" (rank {', '.join(str(refs.index(r)) for r in pending)} still busy)" if pending else ""
        raise TrainingError(f"{what}: no answer within {budget_s or timeout_s:.0f} s{late}") from None
    except ray.exceptions.RayError as e:
        err, rank = e, None
        if many:  # name the first rank that failed, not whichever ray.get met first
            for i, r in enumerate(refs):
                if ray.wait([r], timeout=0)[0]:
                    try:
                        ray.get(r, timeout=0)
                    except ray.exceptions.RayError as e2:
                        err, rank = e2, i
                        break
        who = what if rank is None else f"{what} (rank {rank})"
        raise TrainingError(f"{who}: {describe_failure(err)}") from None


class RoleGroup:
    """`role_plan.workers` actors of `worker_cls`, rank i on bundle `bundle_offset + i` of `pg`."""

    def __init__(self, role: str, worker_cls, role_plan: RolePlan, pg, *, bundle_offset: int = 0,
                 env: dict | None = None, init_args: tuple = (), timeout_s: float = 600):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role, self.timeout_s = role, timeout_s
        remote_cls = ray.remote(worker_cls)
        world = role_plan.workers
        runtime_env = {"env_vars": {k: str(v) for k, v in env.items()}} if env else None

        def spawn(rank: int, addr, port):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_offset + rank
            )
            opts = dict(num_cpus=role_plan.cpu_fraction, num_gpus=role_plan.gpu_fraction, scheduling_strategy=strategy)
            if runtime_env:
                opts["runtime_env"] = runtime_env
            return remote_cls.options(**opts).remote(role, rank, world, addr, port, *init_args)

        t0 = time.time()
        self.actors = [spawn(0, None, None)]
        try:
            addr, port = get(self.actors[0].node_address.remote(), timeout_s, f"{role} rank 0 start")
            self.actors += [spawn(i, addr, port) for i in range(1, world)]
            self.placements = get([a.placement.remote() for a in self.actors], max(timeout_s - (time.time() - t0), 1),
                                  f"{role} start", budget_s=timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.master = (addr, port)

    def __len__(self) -> int:
        return len(self.actors)

    def async_call(self, method: str, *args, **kwargs) -> list:
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call(self, method: str, *args, **kwargs) -> list:
        """Call `method` with the same arguments on every rank; results in rank order."""
        return get(self.async_call(method, *args, **kwargs), self.timeout_s, f"{self.role}.{method}")

    def async_call_per_rank(self, method: str, args_per_rank: list[tuple], **kwargs) -> list:
        """Rank i gets `*args_per_rank[i]` (and the same kwargs); returns the ObjectRefs in rank order."""
        if len(args_per_rank) != len(self.actors):
            raise ValueError(f"{self.role}.{method}: {len(args_per_rank)} argument tuples for {len(self.actors)} ranks")
        return [getattr(a, method).remote(*args, **kwargs) for a, args in zip(self.actors, args_per_rank)]

    def call_per_rank(self, method: str, args_per_rank: list[tuple], **kwargs) -> list:
        """Rank i gets `*args_per_rank[i]` (and the same kwargs); results in rank order."""
        return get(self.async_call_per_rank(method, args_per_rank, **kwargs), self.timeout_s, f"{self.role}.{method}")

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
