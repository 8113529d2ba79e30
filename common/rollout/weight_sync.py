"""Pushing the trainer's weights into the vLLM engines: one path, the transport as a parameter.

The actor's rank 0 walks its model in buckets of about `bucket_mb` (under ZeRO-3 each bucket's
parameters are gathered together: one collective over the actor's ranks per bucket, not one per
parameter), packs each bucket into one flat tensor in the engines' dtype, and hands it over by:
- "cuda_ipc": the engines share the actor's GPUs (colocated): every actor rank packs a copy on its
  GPU and the engine worker on that GPU maps it, no copy;
- "nccl": engines on other GPUs: one broadcast per bucket over a group of actor rank 0 + every
  engine worker (each tensor-parallel worker takes the full tensors and keeps its shard);
- "gloo": the same broadcast between CPU processes (the CPU path, on one node or several);
- "ray": the object store (any placement; a copy through host memory on each side).
An engine keeps the buckets until all have arrived and loads them with one `reload_weights`, which
post-processes weights per layer once they are complete (a partial set would be repacked early).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from common.errors import TrainingError, UserError

TRANSPORTS = ("auto", "cuda_ipc", "nccl", "gloo", "ray")
COLLECTIVE = ("nccl", "gloo")


def choose_transport(requested: str, *, use_gpu: bool, colocated: bool) -> str:
    """`--vllm_sync_backend` resolved for this placement; a transport that cannot work here is refused."""
    flag = f"--vllm_sync_backend {requested}"
    if requested not in TRANSPORTS:
        raise UserError(f"{flag}: choose one of {', '.join(TRANSPORTS)}")
    if requested == "auto":
        return ("cuda_ipc" if colocated else "nccl") if use_gpu else "gloo"
    if requested in ("cuda_ipc", "nccl") and not use_gpu:
        raise UserError(f"{flag} needs GPUs; on CPU use gloo, ray or auto")
    if requested == "cuda_ipc" and not colocated:
        raise UserError(f"{flag} needs the engines on the actor's GPUs (--colocate_all_models); use nccl or auto")
    if requested == "nccl" and colocated:
        # NCCL refuses two ranks of one communicator on the same GPU.
        raise UserError(f"{flag}: the engines share the actor's GPUs (--colocate_all_models), where NCCL cannot "
                        "connect them; use cuda_ipc or auto")
    return requested


@dataclass(frozen=True)
class Bucket:
    """Parameters packed back to back in one flat tensor of `numel` elements of `dtype` ("bfloat16")."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    dtype: str


def plan_buckets(named_shapes: list[tuple[str, tuple[int, ...]]], bucket_mb: float, dtype) -> list[Bucket]:
    """Split (name, shape) in model order into buckets of about `bucket_mb` MB of `dtype` (a torch
    dtype); a tensor larger than that is a bucket of its own."""
    limit = max(1, int(bucket_mb * 2**20 / dtype.itemsize))
    name_of = str(dtype).removeprefix("torch.")
    buckets, names, shapes, numel = [], [], [], 0
    for name, shape in named_shapes:
        n = 1
        for d in shape:
            n *= d
        if names and numel + n > limit:
            buckets.append(Bucket(tuple(names), tuple(shapes), numel, name_of))
            names, shapes, numel = [], [], 0
        names.append(name)
        shapes.append(tuple(shape))
        numel += n
    if names:
        buckets.append(Bucket(tuple(names), tuple(shapes), numel, name_of))
    return buckets


def pack(tensors: list, dtype, device):
    """One flat [numel] tensor of `dtype` on `device`, the tensors' elements in order."""
    import torch

    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors])


def unpack(flat, bucket: Bucket) -> list:
    """[(name, view of flat)] in the bucket's order; the views share flat's memory."""
    out, at = [], 0
    for name, shape in zip(bucket.names, bucket.shapes):
        n = 1
        for d in shape:
            n *= d
        out.append((name, flat[at: at + n].view(shape)))
        at += n
    return out


# ---------------------------------------------------------------- collectives (nccl, gloo)
def join_group(backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float, served=None):
    """A process group of its own (actor rank 0 = rank 0, engine i = rank i + 1), beside the
    default group that DeepSpeed or vLLM already made in the same process. `served`: the store at
    addr:port when this process serves it (rank 0), else every rank connects as a client."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = served or dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    store = dist.PrefixStore("hybridrl-weight-sync", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout  # a broadcast to an engine that never joins fails instead of hanging
    return dist.ProcessGroupNCCL(store, rank, world, opts)


def broadcast(group, flat) -> None:
    """Rank 0 sends `flat`, every other rank receives into it."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([flat], opts).wait()


# ---------------------------------------------------------------- CUDA IPC (same GPU)
def share(flat):
    """A handle another process on the same GPU can open (the caller keeps `flat` alive until then)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(flat)


def open_shared(handle):
    import torch

    rebuild, args = handle
    args = list(args)
    args[6] = torch.cuda.current_device()  # the device index as this process numbers it
    return rebuild(*args)


# ---------------------------------------------------------------- the driver's side
class WeightSync:
    """Connects the actor group to the engines once; each call pushes the current weights."""

    def __init__(self, actor_group, engines: list, *, transport: str, bucket_mb: float, timeout_s: float, tp: int = 1,
                 overlap_load: bool = False):
        from common.cluster.ray_groups import get

        self.actor, self.engines, self.transport, self.timeout_s = actor_group, engines, transport, timeout_s
        # --async_train over a broadcast: return once the actor has sent; the engines load while the trainer
        # goes on (their next generate runs after the load: an actor's calls run in order), and the
        # next sync first waits for this one's loads (a failed load also stops the engine's next generate)
        self.overlap_load = overlap_load and transport in COLLECTIVE
        self.loading: list = []
        if transport == "cuda_ipc" and len(engines) * tp > len(actor_group):
            raise UserError(f"--vllm_sync_backend cuda_ipc: {len(engines)} engines x TP {tp} share the GPUs of "
                            f"{len(actor_group)} actor ranks, one engine worker per actor GPU at most; use nccl or "
                            "fewer engines")
        self.buckets = get(actor_group.actors[0].weight_plan.remote(bucket_mb), timeout_s, "actor weight plan")
        if transport in COLLECTIVE:  # actor rank 0 is rank 0; worker j of engine i is 1 + i x tp + j
            addr, port = get(actor_group.actors[0].sync_address.remote(timeout_s), timeout_s, "actor weight-sync address")
            world = 1 + len(engines) * tp
            refs = [actor_group.actors[0].join_sync_group.remote(transport, addr, port, 0, world, timeout_s)]
            refs += [e.join_sync_group.remote(transport, addr, port, 1 + i * tp, world, timeout_s)
                     for i, e in enumerate(engines)]
            self._wait(refs, "connecting the actor and the vLLM engines", time.perf_counter() + timeout_s)

    def _wait(self, refs: list, who, deadline: float):
        import ray

        from common.cluster.ray_groups import describe_failure

        try:
            return ray.get(refs, timeout=max(0.0, deadline - time.perf_counter()))
        except ray.exceptions.GetTimeoutError:
            if callable(who):
                _, late = ray.wait(refs, num_returns=len(refs), timeout=0)
                who = who(refs.index(late[0])) if late else "it"
            raise UserError(f"weight sync: {who} did not finish within {self.timeout_s:g} s (raise --vllm_sync_timeout "
                            "if the model is large or the engines are slow to become idle)") from None
        except ray.exceptions.RayError as e:
            raise TrainingError(f"weight sync ({self.transport}): {describe_failure(e)}") from None

    def __call__(self, version: int | None = None) -> dict:
        """Push the weights, policy `version` (training steps done; None: the engines count one more);
        a sync not done within the timeout stops naming the engine that did not answer.

        An engine only takes part once it is idle (Ray runs an actor's calls one at a time), so a
        generate call still running counts against the timeout.
        """
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        out = self.wait_loaded(deadline)
        k = len(self.actor)
        # Every rank takes part (ZeRO-3 gathers); with CUDA IPC every rank shares a copy on its GPU,
        # for the engine worker on that GPU.
        senders = k if self.transport == "cuda_ipc" else 1
        sent = self.actor.async_call("send_weights", self.transport, self.buckets, senders)
        if self.transport in COLLECTIVE:  # the engines receive while the actor sends
            got = [e.receive_weights.remote(self.buckets, self.transport, None, version) for e in self.engines]
            if self.overlap_load:
                self._wait(sent, "the actor", deadline)
                self.loading = got
                return {**out, "time/weight_sync_s": time.perf_counter() - t0, "sync/buckets": len(self.buckets)}
            loads = self._wait(sent + got, lambda i: "the actor" if i < k else f"vLLM engine {i - k}", deadline)[k:]
        else:
            payloads = self._wait(sent, "the actor's weight gather", deadline)
            # "ray": rank 0's object refs; "cuda_ipc": {GPU: handles}, each worker finds its GPU's copy.
            payload = payloads[0] if self.transport == "ray" else dict(payloads)
            got = [e.receive_weights.remote(self.buckets, self.transport, payload, version) for e in self.engines]
            loads = self._wait(got, lambda i: f"vLLM engine {i}", deadline)
            if self.transport == "cuda_ipc":  # the engines have loaded: the shared buffers can go
                self._wait(self.actor.async_call("release_sync_buffers"), "the actor", deadline)
        return {"time/weight_sync_s": time.perf_counter() - t0, "time/weight_load_s": max(loads),
                "sync/buckets": len(self.buckets)}

    def wait_loaded(self, deadline: float | None = None) -> dict:
        """With `overlap_load`: wait for the last sync's loads; {"time/weight_load_s": the slowest engine's
        seconds} ({} when none was pending). The load is reported by the sync after the one that sent it."""
        if not self.loading:
            return {}
        got, self.loading = self.loading, []
        loads = self._wait(got, lambda i: f"vLLM engine {i}", deadline or time.perf_counter() + self.timeout_s)
        return {"time/weight_load_s": max(loads)}


class AdapterSync:
    """A LoRA run's weight sync: each call sends only the actor's adapter, which every engine loads as a new
    adapter version and uses for its next generate calls (common.rollout.vllm_engine.VllmEngine.load_adapter).
    The frozen base never changes, so the engines keep the one they loaded at start. The adapter goes once
    through Ray's object store, whatever --vllm_sync_backend says: it is a few MB (the banner says so)."""

    def __init__(self, actor_group, engines: list, *, timeout_s: float):
        self.actor, self.engines, self.timeout_s = actor_group, engines, timeout_s
        self.transport = "ray"

    def _wait(self, refs: list, who, deadline: float):
        return WeightSync._wait(self, refs, who, deadline)

    def __call__(self, version: int | None = None) -> dict:
        """Push the adapter as policy `version` (None: the engines count one more); an engine that fails to
        load it keeps its previous version and refuses to generate, so the run stops with that message."""
        import ray

        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        tensors, config = self._wait(self.actor.async_call("adapter_tensors"), "the actor's adapter gather", deadline)[0]
        ref = ray.put(tensors)  # one copy in the object store for every engine
        sent = time.perf_counter()
        loads = self._wait([e.load_adapter.remote(ref, config, version) for e in self.engines],
                           lambda i: f"vLLM engine {i}", deadline)
        return {"time/weight_sync_s": time.perf_counter() - t0, "time/weight_load_s": max(loads),
                "time/adapter_gather_s": sent - t0,
                "sync/adapter_mb": sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20}

    def wait_loaded(self, deadline: float | None = None) -> dict:
        return {}  # each call waits for its loads

