"""The trainer's side of the weight sync to vLLM (`common.rollout.weight_sync` drives it): a mixin of the
model worker, so its methods run on every rank of the actor's group.

Every rank gathers each bucket of parameters (collective under ZeRO-3); rank 0 (or, with CUDA IPC,
each rank that shares a GPU with an engine worker) sends it in the engines' dtype.
"""
from __future__ import annotations

import torch


class WeightSender:
    """Needs `self.model` (a DeepSpeed engine or module), `self.dtype` and `self.dist` (common.training.ds.DistInfo)."""

    def _named_params(self) -> list:
        return list(getattr(self.model, "module", self.model).named_parameters())

    def weight_plan(self, bucket_mb: float) -> list:
        """The buckets `send_weights` will send, in order (ZeRO-3 shapes are the full ones)."""
        from common.rollout.weight_sync import plan_buckets

        named = [(n, tuple(getattr(p, "ds_shape", p.shape))) for n, p in self._named_params()]
        return plan_buckets(named, bucket_mb, self.dtype)

    def sync_address(self, timeout_s: float) -> tuple[str, int]:
        """Where the weight-sync group meets: a store this rank serves from now on (`host_store`)."""
        import ray

        from common.training.dist import host_store

        addr = ray.util.get_node_ip_address()
        self._sync_store, port = host_store(addr, timeout_s)
        return addr, port

    def join_sync_group(self, backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        from common.rollout.weight_sync import join_group

        self._sync_group = join_group(backend, addr, port, rank, world, timeout_s,
                                      self._sync_store if rank == 0 else None)

    def send_weights(self, transport: str, buckets: list, senders: int = 1) -> list:
        """Every rank gathers (ZeRO-3 is collective); rank 0 sends each bucket in the engines' dtype.
        Returns the payloads: object refs ("ray"), (this GPU's UUID, IPC handles) ("cuda_ipc": ranks
        below `senders` share a copy each, for the engine worker on their GPU) or nothing (broadcast)."""
        import deepspeed
        import ray

        from common.rollout import weight_sync as ws

        params = dict(self._named_params())
        device = self.dist.device if transport in ("nccl", "cuda_ipc") else torch.device("cpu")
        out, self._sync_keep = [], []
        for bucket in buckets:  # weight_plan's, as the engines expect them
            group = [params[n] for n in bucket.names]
            with deepspeed.zero.GatheredParameters(group, enabled=hasattr(group[0], "ds_id")):
                flat = ws.pack(group, self.dtype, device) if self.dist.rank < senders else None
            if flat is None:
                continue
            if transport == "ray":
                out.append(ray.put(flat))
            elif transport == "cuda_ipc":
                self._sync_keep.append(flat)  # alive until the engines have loaded (release_sync_buffers)
                out.append(ws.share(flat))
            else:
                ws.broadcast(self._sync_group, flat)
        if transport == "cuda_ipc" and out:
            torch.cuda.current_stream().synchronize()  # the engines read what the copies wrote
            return str(torch.cuda.get_device_properties(self.dist.device).uuid), out
        return out

    def release_sync_buffers(self) -> None:
        self._sync_keep = []

    def adapter_tensors(self) -> tuple[dict, dict] | None:
        """A LoRA actor's adapter for `common.rollout.weight_sync.AdapterSync`: (peft-named tensors on CPU, its
        LoraConfig as a dict) on rank 0, None elsewhere. Every rank takes part: ZeRO-3 gathers the adapter's
        parameters, and only those (the frozen base reached the engines when they loaded the model)."""
        from common.training.lora import adapter_config, adapter_state

        tensors = adapter_state(self.model)
        if self.dist.rank != 0:
            return None
        # the engines' dtype, as the full sync sends it
        return {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in tensors.items()}, adapter_config(self.model)

