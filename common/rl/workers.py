"""The Ray worker that hosts one model of one role (actor, critic, reference or reward).

A role is a group of these workers forming one DeepSpeed process group (`common.cluster.ray_groups`).
The driver (the script) sends each rank its shard of a batch; the worker runs forward passes in
micro-batches and, for trained roles, optimizer steps with a loss function that the script passes in
(`loss_fn`), so an edited copy of a script changes training without touching this module.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from common.training.ds_sleep import Sleeper
from common.rl.guests import Host
from common.cluster.ray_groups import BaseWorker
from common.rollout.weight_sender import WeightSender


@dataclass(frozen=True)
class ModelSpec:
    """What a worker loads. kind: "causal_lm" (actor, reference) or "value" (reward model, critic)."""

    path: str
    kind: str
    trainable: bool
    ds: object                   # common.training.ds.DSSettings
    bf16: bool = False
    flash_attn: bool = False
    seed: int = 42
    temperature: float = 1.0     # log-probs are taken of logits / temperature, as sampled
    packing: bool = False
    share_prefix: bool = False   # causal LMs: each prompt runs once for its consecutive rows (common.algo.shared_prefix)
    static_cache: bool = False   # generate with transformers' static (compiled on GPU) KV cache
    value_head_prefix: str = "score"  # value models: the head's name when the folder's config does not say
    normalize_reward: bool = False    # value models: (v - mean) / std with the folder's recorded statistics
    offload: bool = False        # frozen models on a GPU: weights kept in CPU memory (--ref_reward_offload)
    liger: bool = False          # causal LMs: liger-kernel's fused kernels on a GPU (--use_liger_kernel)
    # causal LMs: log-probs from the last hidden state, the head's logits made in chunks of this many
    # positions and never held whole (common.algo.logprobs.head_token_stats); None: 2048 on a GPU, where the
    # [tokens, vocab] logits are the largest tensor of a small model's step; 0: the whole logits
    head_chunk_tokens: int | None = None
    optim: dict = field(default_factory=dict)  # lr, total_steps, warmup_ratio, scheduler, betas, weight_decay
    lora: object = None          # trained roles: common.training.lora.LoraSettings (None or rank 0: every weight trains)


class ModelWorker(Sleeper, Host, WeightSender, BaseWorker):
    def setup(self, spec: ModelSpec) -> dict:
        from common.training import ds
        from common.algo.logprobs import chunked_head
        from common.algo import HEAD_CHUNK
        from common.training.models import attn_implementation, load_causal_lm, load_reward_model, load_tokenizer

        self.spec = spec
        ds.use_expandable_segments()  # before this process's first CUDA allocation
        from common.cluster.gpu_memory import start_history

        start_history()
        self.dist = ds.setup_distributed()
        torch.manual_seed(spec.seed)
        self.dtype, dtype_note = ds.resolve_dtype(spec.bf16, self.dist.device)
        attn, attn_note = attn_implementation(spec.flash_attn)
        self.attn = attn
        from common.algo.packing import packs_here

        self.packing = spec.packing and packs_here(attn, self.dist.device.type)
        pack_note = ("--packing_samples: without flash-attention the rows stay padded on the GPU (SDPA would attend "
                     "over the whole packed micro-batch)") if spec.packing and not self.packing else None
        self.tokenizer = load_tokenizer(spec.path)
        settings = spec.ds
        offload = spec.offload and not spec.trainable and self.dist.device.type == "cuda"  # on a CPU they are there anyway
        cfg = ds.train_config(settings, self.dist.world_size, self.dtype) if spec.trainable else ds.eval_config(settings, self.dtype, offload)
        _keep = ds.zero3_loading(cfg)  # noqa: F841  (must outlive from_pretrained)
        load_dtype = torch.float32 if spec.trainable else self.dtype
        liger_note = None
        from common.training.lora import apply_lora, quantization

        lora = spec.lora if spec.trainable and spec.lora is not None and spec.lora.on else None
        quant = quantization(lora, self.dist.device) if lora else {}
        if spec.kind == "causal_lm":
            model = load_causal_lm(spec.path, dtype=load_dtype, attn_impl=attn, **quant)
            if spec.liger:
                from common.training.liger import apply_liger

                liger_note = apply_liger(model, self.dist.device)
        else:
            model = load_reward_model(spec.path, dtype=load_dtype, attn_impl=attn, pad_token_id=self.tokenizer.pad_token_id,
                                      value_head_prefix=spec.value_head_prefix, normalize_reward=spec.normalize_reward, **quant)
        if lora:  # a critic's value head trains in full beside its adapter
            apply_lora(model, lora, head="score" if spec.kind == "value" else None)
        if spec.trainable:
            self.model = ds.initialize(model, settings, self.dist, self.dtype, **spec.optim)
        else:
            self.model = ds.initialize_eval(model, settings, self.dtype, self.dist.device, offload=offload)
        chunk = spec.head_chunk_tokens if spec.head_chunk_tokens is not None else HEAD_CHUNK if self.dist.device.type == "cuda" else 0
        self.head = chunked_head(model, chunk, spec.ds.zero_stage, spec.ds.autocast and self.dtype == torch.bfloat16) \
            if spec.kind == "causal_lm" else None
        # ZeRO-3 streams offloaded shards in by itself; a whole model in CPU memory visits the GPU per batch
        self._visits = offload and settings.zero_stage != 3
        zero = ds.zero_note(settings.zero_stage, self.dist.world_size, self.dist.device) if spec.trainable else None
        cpu = "--ref_reward_offload: on the CPU the frozen models are in CPU memory anyway" if spec.offload and not offload else None
        return {"notes": [n for n in (dtype_note, attn_note, pack_note, zero, cpu, liger_note) if n], "device": str(self.dist.device),
                "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())}

    # ---------------------------------------------------------------- forward passes
    @contextmanager
    def _on_device(self):
        """An offloaded frozen model under ZeRO 0-2 comes to the GPU for one batch's forward passes."""
        if not getattr(self, "_visits", False):
            yield
            return
        self.model.to(self.dist.device)
        try:
            yield
        finally:
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def _to(self, batch: dict) -> dict:
        return {k: v.to(self.dist.device) for k, v in batch.items()}

    def _inputs(self, micro: dict):
        """Model inputs for a micro-batch, packed without padding when --packing_samples is on."""
        if not self.packing:
            return {"input_ids": micro["input_ids"], "attention_mask": micro["attention_mask"]}, None
        from common.algo.packing import pack

        packed = pack(micro["input_ids"], micro["attention_mask"], flash=self.attn == "flash_attention_2")
        return packed.model_inputs(), packed

    def _token_logprobs(self, micro: dict, entropy: bool = False):
        """log pi(token) for every next-token position: [b, t-1] (and entropy [b, t-1]); with share_prefix
        from each prompt's last position on (zeros before: no action sits there)."""
        from common.algo.logprobs import head_stats, token_stats
        from common.algo.shared_prefix import shared_prefix_stats

        if self.spec.share_prefix:
            return shared_prefix_stats(self.model, micro, self.spec.temperature, entropy)
        inputs, packed = self._inputs(micro)
        # Every position against the next token, the last against an arbitrary one, dropped after:
        # the logits stay one contiguous tensor (a [:, :-1] view would cost a copy of them).
        labels = torch.roll(inputs["input_ids"], -1, dims=1)
        if self.head is not None:
            head, chunk, dtype = self.head
            with head_stats(head, labels, self.spec.temperature, entropy, chunk, dtype):
                out = self.model(**inputs).logits  # [b, t, 2]: log p and entropy, or [b, t, 1]
            lp, ent = out[..., 0], (out[..., 1] if entropy else None)
        else:
            lp, ent = token_stats(self.model(**inputs).logits, labels, self.spec.temperature, entropy)
        lp, ent = lp[:, :-1], (ent[:, :-1] if entropy else None)
        if packed is not None:
            lp, ent = packed.unpack_next_token(lp), (packed.unpack_next_token(ent) if entropy else None)
        return lp, ent

    def _token_values(self, micro: dict) -> torch.Tensor:
        """Critic values at the positions that predict each next token: [b, t-1]."""
        from common.training.models import token_values

        inputs, packed = self._inputs(micro)
        values = token_values(self.model, **inputs)
        return packed.unpack_next_token(values) if packed is not None else values[:, :-1]

    def _micro_batches(self, batch: dict, size: int):
        from common.rollout.samples import trim

        N = batch["input_ids"].shape[0]
        for i in range(0, N, size):
            yield i, self._to(trim({k: v[i: i + size] for k, v in batch.items()}))

    def _pad_to(self, x: torch.Tensor, width: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))

    @torch.no_grad()
    def logprobs(self, batch: dict, micro_batch: int) -> torch.Tensor:
        """[n, T-1] log-probs of this rank's shard (zeros off the action mask); the base model's for the
        reference that `host_base` made of a LoRA actor."""
        from contextlib import nullcontext

        from common.training.lora import adapter_disabled

        self.model.eval()
        with self._on_device(), adapter_disabled(self.model) if getattr(self, "adapter_off", False) else nullcontext():
            out = [self._pad_to(self._token_logprobs(m)[0].float().cpu(), batch["input_ids"].shape[1] - 1)
                   for _, m in self._micro_batches(batch, micro_batch)]
        return torch.cat(out) * batch["action_mask"]

    @torch.no_grad()
    def values(self, batch: dict, micro_batch: int) -> torch.Tensor:
        self.model.eval()
        out = [self._pad_to(self._token_values(m).float().cpu(), batch["input_ids"].shape[1] - 1)
               for _, m in self._micro_batches(batch, micro_batch)]
        return torch.cat(out) * batch["action_mask"]

    @torch.no_grad()
    def rewards(self, batch: dict, micro_batch: int) -> torch.Tensor:
        """[n] scores: the scalar head at each sequence's last real token."""
        from common.training.models import reward_scores

        self.model.eval()
        with self._on_device():
            return torch.cat([reward_scores(self.model, m["input_ids"], m["attention_mask"]).float().cpu()
                              for _, m in self._micro_batches(batch, micro_batch)])

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: dict, seed: int):
        """Sample with transformers' generate (the rollout path without vLLM)."""
        from common.rollout.decode import hf_generate

        torch.manual_seed(seed)
        self.model.eval()
        module = getattr(self.model, "module", self.model)
        synced = self.spec.ds.zero_stage == 3 and self.dist.world_size > 1  # all ranks step together under ZeRO-3
        # Outside DeepSpeed's forward its torch_autocast does not apply: fp32 weights would decode in fp32.
        cast = self.spec.ds.autocast and self.dtype == torch.bfloat16 and self.spec.trainable
        with torch.autocast(self.dist.device.type, dtype=torch.bfloat16, enabled=cast):
            return hf_generate(module, prompt_ids, eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id,
                               synced_gpus=synced, static_cache=self.spec.static_cache, seed=seed, **sampling)

    # ---------------------------------------------------------------- training
    def train(self, batch: dict, loss_fn, *, output: str, micro_batch: int, steps: int, entropy: bool = False,
              skip_nonfinite: bool = False, step: int | None = None) -> list[dict]:
        """`steps` optimizer steps over this rank's shard, split evenly; returns one stats dict per step.

        loss_fn(out, micro) -> (loss, stats): `out` is {"logprobs": [b, t-1], "entropy": ...} for a
        causal LM, {"values": [b, t-1]} for a value model; `micro` holds the micro-batch's tensors
        and the step's "step_tokens" / "step_seqs": its valid action tokens and non-empty rows over
        all micro-batches and data-parallel ranks, divided by the number of ranks. `loss` is the
        micro-batch's share of the step's loss (`common.algo.losses.aggregate` with those counts): the
        shares are backpropagated as they are, so the step's gradient is that of their sum,
        averaged over the ranks. Stats whose name ends in "_loss" are such shares and are summed
        over the micro-batches; the others are averaged.
        A non-finite loss or gradient raises TrainingError naming the role and `step` (the
        driver's step number); with `skip_nonfinite` that update is skipped instead (the weights stay
        as they were) and its stats say "skipped": 1.
        """
        from common.training.updates import poison_nonfinite, update_skipped
        from common.errors import TrainingError

        at = f"step {step}, " if step is not None else ""
        self.model.train()
        N = batch["input_ids"].shape[0]
        bounds = [round(s * N / steps) for s in range(steps + 1)]
        # Filtering can leave fewer samples than the configured batch: close each optimizer step
        # ourselves and weight the micro-batches so the step still averages over what it got.
        gas = self.model.gradient_accumulation_steps()
        history = []
        for s in range(steps):
            t0 = time.perf_counter()
            part = {k: v[bounds[s]:bounds[s + 1]] for k, v in batch.items()}
            acc: dict[str, float] = {}
            micros = [m for _, m in self._micro_batches(part, micro_batch)]
            tokens, seqs = self._step_counts(part["action_mask"])
            for j, micro in enumerate(micros):
                micro["step_tokens"], micro["step_seqs"] = tokens, seqs
                if output == "logprobs":
                    lp, ent = self._token_logprobs(micro, entropy)
                    out = {"logprobs": lp, "entropy": ent}
                else:
                    out = {"values": self._token_values(micro)}
                loss, stats = loss_fn(out, micro)
                if not skip_nonfinite and not torch.isfinite(loss):  # stop before a NaN reaches the weights
                    raise TrainingError(f"{at}optimizer step {s + 1} of {steps}: the {self.role} loss is "
                                        f"{loss.item()}; lower the learning rate or check the rewards, or pass "
                                        "--skip_nonfinite_updates to skip such updates")
                self.model.set_gradient_accumulation_boundary(j == len(micros) - 1)
                # Every rank runs backward, a non-finite loss included (ZeRO's collectives need all ranks);
                # its NaN gradients make DeepSpeed skip the update on every rank.
                self.model.backward(poison_nonfinite(loss) * gas)  # DeepSpeed divides by gas; shares add up
                self.model.step()
                for k, v in stats.items():
                    acc[k] = acc.get(k, 0.0) + float(v)
            skipped = update_skipped(self.model, allow=skip_nonfinite, who=f"{at}optimizer step {s + 1} of {steps}: "
                                     f"the {self.role}", fix="Lower the learning rate or check the rewards")
            n_micro = len(micros)
            stats = {k: v if k.endswith("_loss") else v / n_micro for k, v in acc.items()}
            stats["skipped"] = float(skipped)
            norm = self.model.get_global_grad_norm()
            stats["grad_norm"] = float(norm) if norm is not None else float("nan")
            stats["lr"] = self.model.get_lr()[0]
            stats["step_s"] = time.perf_counter() - t0
            history.append(stats)
        return history

    def _step_counts(self, action_mask: torch.Tensor) -> tuple[float, float]:
        """(valid tokens, non-empty rows) of one optimizer step over all ranks, per rank: the
        denominators that make a token or sequence mean span the whole step (DAPO's token-level
        loss), not each micro-batch or rank on its own."""
        import torch.distributed as dist

        counts = torch.tensor([action_mask.sum(), action_mask.bool().any(-1).sum()], dtype=torch.float64)
        world = self.dist.world_size
        if world > 1:
            counts = counts.to(self.dist.device)
            dist.all_reduce(counts)
        return float(counts[0]) / world, float(counts[1]) / world

    # ---------------------------------------------------------------- GPU memory (the hybrid engine's sleep: common.training.ds_sleep.Sleeper)
    def gpu_memory(self, reset: bool = True) -> dict:
        """This rank's GPU memory in GiB since the last call (common.cluster.gpu_memory.measure; {} on CPU)."""
        from common.cluster.gpu_memory import dump_history, measure

        self._memory_calls = getattr(self, "_memory_calls", 0) + 1
        dump_history(f"{self.role}-rank{self.dist.rank}", self._memory_calls)
        return measure(reset)

    # ---------------------------------------------------------------- saving
    def save_hf(self, path: str) -> None:
        from common.training import ds

        ds.save_hf(self.model, self.tokenizer, path, self.dist.rank)

    def save_checkpoint(self, root: str, step: int, state: dict, max_keep: int, hf_copy: bool = False) -> str:
        from common.training.checkpoint import save_checkpoint

        return save_checkpoint(root, step, {self.role: self.model}, state, rank=self.dist.rank, max_keep=max_keep,
                               hf_tokenizer=self.tokenizer if hf_copy else None)

    def load_checkpoint(self, path: str) -> dict:
        from common.training.checkpoint import load_checkpoint

        return load_checkpoint(path, {self.role: self.model}, rank=self.dist.rank)
