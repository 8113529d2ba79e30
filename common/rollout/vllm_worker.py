"""The vLLM worker's side of the weight sync, mixed into every worker (`worker_extension_cls`).

With tensor parallelism each engine runs one worker per GPU (or CPU rank), and each must receive
the full weights: `reload_weights` takes full tensors and keeps the worker's own shard. The engine
reaches all its workers with `collective_rpc("hybridrl_...")`; with one worker the call stays in
the engine's process. The protocol and the transports are in `common.rollout.weight_sync`.

With LoRA the trainer pushes only its adapter (`hybridrl_add_adapter`): vLLM keeps the base weights and
serves the adapter beside them, each worker holding its shard of the adapter's tensors.
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

    # ---------------------------------------------------------------- LoRA adapters pushed from the trainer
    def hybridrl_add_adapter(self, lora_id: int, tensors: dict | bytes, config: dict | None = None) -> None:
        """Serve the adapter `tensors` (peft's state-dict names: "base_model.model.model.layers.0.self_attn
        .q_proj.lora_A.weight": [r, in], "...lora_B.weight": [out, r]) under `lora_id`, replacing one of that id.

        `config`: the adapter's LoraConfig as a dict (r, lora_alpha, target_modules, ...). Built from the
        tensors in memory: vLLM's own add_lora path reads a folder, and a request naming this id later
        finds it registered and never reads its path. Every tensor-parallel worker gets the full tensors;
        each LoRA layer keeps its own slice when the adapter is activated, as for a loaded adapter.
        """
        import pickle

        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

        if isinstance(tensors, bytes):  # pickled by an engine whose core runs in a process of its own
            lora_id, tensors, config = pickle.loads(tensors)
        workers = getattr(self.model_runner, "lora_manager", None)
        if workers is None:
            raise RuntimeError("this vLLM engine serves no LoRA adapters: start it with EngineSpec.lora_rank > 0")
        manager = workers._adapter_manager
        # peft keeps target_modules as a set; vLLM reads it as a list or a regex string
        config = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.items()}
        helper = PEFTHelper.from_dict(dict(config, vllm_max_position_embeddings=workers.max_position_embeddings))
        helper.validate_legal(workers.lora_config)  # rank above max_lora_rank, DoRA, bias: refused here
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        mapper = getattr(mapper, "get_rename_mapper", lambda: mapper)() if mapper is not None else None  # 0.22: no such split
        # A module vLLM has no LoRA layer for would be dropped without a word at activation, serving a
        # different policy than the trainer's: refuse it, as vLLM's loader refuses such a folder.
        expected = set(helper.modules_to_save or ())
        for module in manager.supported_lora_modules:
            expected.update(manager.packed_modules_mapping.get(module, [module]))
        names = {parse_fine_tuned_lora_name(k, mapper)[0] for k in tensors if not is_base_embedding_weights(k)}
        # (MoE experts: vLLM checks their names its own way)
        unknown = sorted(n for n in names if ".experts" not in n and n.rsplit(".", 1)[-1] not in expected)
        if unknown:
            raise ValueError(f"LoRA adapter {lora_id}: vLLM has no LoRA layer for {unknown[:4]}"
                             f"{' ...' if len(unknown) > 4 else ''} (it has {sorted(expected)})")
        lora = LoRAModel.from_lora_tensors(lora_id, tensors, helper, device="cpu", dtype=workers.lora_config.lora_dtype,
                                           model_vocab_size=workers.vocab_size, weights_mapper=mapper,
                                           skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        for check in ("_validate_modules_to_save", "_validate_token_classification_lora"):  # vLLM 0.32's; 0.22 has none
            if hasattr(manager, check):
                getattr(manager, check)(lora)
        manager.remove_adapter(lora_id)  # a second push of one id replaces it
        manager.add_adapter(lora)  # merges q/k/v and gate/up into vLLM's packed layers
        manager.activate_adapter(lora_id)  # copies it into a slot of the LoRA layers, this worker's shard

    def hybridrl_remove_adapter(self, lora_id: int) -> bool:
        """Stop serving adapter `lora_id` and free its slot; False if this worker did not hold it."""
        return self.model_runner.lora_manager.remove_adapter(lora_id)

    def hybridrl_adapters(self) -> list[int]:
        """The adapter ids this worker holds."""
        return sorted(self.model_runner.lora_manager.list_adapters())
