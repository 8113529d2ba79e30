"""The driver's side of the hybrid engine (vLLM and the trained models on the same GPUs): the order in which
each phase's memory is given back and taken (OpenRLHF's), and each process's measured peak beside the plan.
A mixin of common.rl_run.RLRun: needs `self.a`, `self.plan`, `self.groups`, `self.trained`, `self.engines`,
`self.sync`, `self.memory` and `self._vllm_memory`. The trained workers' side is common/ds_sleep.py."""
from __future__ import annotations


class HybridEngine:
    def ds_sleep(self, method: str) -> float:
        """Hybrid engine: DeepSpeed states of the trained models leave the GPU (offload) or return."""
        if not self.a["deepspeed_enable_sleep"]:
            return 0.0
        return max(max(g.call(method)) for g in self.trained)

    def vllm_sleep(self, method: str, *args) -> None:
        from common.ray_groups import get

        if self.a["vllm_enable_sleep"]:
            get([getattr(e, method).remote(*args) for e in self.engines], 600, f"vLLM {method}")

    def to_training(self) -> float:
        """After generation: vLLM sleeps, the training states come back (the hybrid engine's order frees
        memory for each phase). Returns the reload's seconds."""
        self.vllm_sleep("sleep", self.a["vllm_sleep_level"])
        return self.ds_sleep("reload_states")

    def to_rollout(self, metrics: dict, version: int) -> None:
        """After training: new weights (policy `version`) to the engines, training states off the GPU, then the KV cache.

        vLLM's weights wake and are overwritten from the trainer's (which must still be on the GPU:
        offloading first made the engines load stale shards), then the training states leave, and only
        then does vLLM's KV cache, the largest piece, wake. Nothing to push when the policy generates itself."""
        if self.plan.use_gpu:  # each process's measured peak beside the plan's (the trainers' before they sleep)
            self.memory_metrics(metrics)
        if self.engines:
            self.vllm_sleep("wake_up", ["weights"])
            metrics.update(self.sync(version))
        metrics["time/offload_s"] = self.ds_sleep("offload_states")
        if self.engines:
            self.vllm_sleep("wake_up", ["kv_cache"])

    def memory_metrics(self, metrics: dict) -> None:
        """mem/{role}_... of every model's process and mem/vllm_... since the last call (common.gpu_memory)."""
        from common.gpu_memory import run_metrics

        self._vllm_memory = run_metrics(self.groups, self.engines, self.memory, metrics, self._vllm_memory,
                                        deferred=self.a["async_train"])
