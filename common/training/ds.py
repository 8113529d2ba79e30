"""DeepSpeed mechanisms shared by every script: configs, engines, saving, sleep (the process group
is common/training/dist.py). On a machine without CUDA the gloo backend is used, so everything here runs on
a laptop CPU.
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass

import torch

from common.training.dist import DistInfo, quiet_libraries, setup_distributed  # noqa: F401 (ds.setup_distributed)
from common.errors import UserError
from common.training.updates import SkipNonfinite


@dataclass(frozen=True)
class DSSettings:
    """The DeepSpeed part of a script's options (a script builds one per trained model)."""

    zero_stage: int = 2
    bf16: bool = False
    adam_offload: bool = False
    adam_offload_ratio: float = 1.0  # --adam_offload_ratio: ZeRO-3's partial offload (common.cluster.memory_estimate)
    gradient_checkpointing: bool = False
    max_norm: float = 1.0
    micro_train_batch_size: int = 1
    train_batch_size: int = 8
    fused_adam: bool = False  # DeepSpeed's own Adam: required by offload_states (sleep) under ZeRO-3
    # With bf16: keep the weights in fp32 and run the forward under torch.autocast (DeepSpeed's
    # torch_autocast) instead of bf16 weights with an fp32 master copy. One copy of the weights fewer,
    # no flat master/gradient copies, norms and softmax in fp32: faster on one GPU (dev/LOG.md).
    autocast: bool = False
    compile: bool = False  # torch.compile each transformer block (common.training.models.compile_layers)
    # OpenRLHF's DeepSpeed flags (from_options below): --zpg, --overlap_comm, --grad_accum_dtype,
    # --gradient_checkpointing_use_reentrant, --full_determinism.
    zpg: int = 1
    overlap_comm: bool = False
    grad_accum_dtype: str | None = None
    reentrant: bool = False
    deterministic: bool = False

    @classmethod
    def from_options(cls, a, bf16: bool, **more) -> DSSettings:
        """A script's DeepSpeed options (`a`: flag names to values); `bf16`: the dtype resolved on this device."""
        return cls(zero_stage=a["zero_stage"], bf16=bf16, adam_offload=a["adam_offload"],
                   adam_offload_ratio=a["adam_offload_ratio"], gradient_checkpointing=a["gradient_checkpointing"],
                   max_norm=a["max_norm"], micro_train_batch_size=a["micro_train_batch_size"],
                   train_batch_size=a["train_batch_size"], autocast=a["torch_autocast"], compile=a["torch_compile"],
                   zpg=a.get("zpg") or 1, overlap_comm=bool(a.get("overlap_comm")),
                   grad_accum_dtype=a.get("grad_accum_dtype"),
                   reentrant=bool(a.get("gradient_checkpointing_use_reentrant")),
                   deterministic=bool(a.get("full_determinism")), **more)


def resolve_dtype(bf16: bool, device: torch.device) -> tuple[torch.dtype, str | None]:
    """(dtype, note). bf16 on a CPU without native bf16 is emulated and slower than fp32."""
    if not bf16:
        return torch.float32, None
    if device.type == "cpu":
        native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(
            torch.cpu, "_is_amx_tile_supported", lambda: False
        )()
        if not native:
            return torch.float32, "--bf16: this CPU has no native bf16 (AVX512-BF16/AMX); training in fp32 instead"
    return torch.bfloat16, None


def grad_accumulation(s: DSSettings, world_size: int) -> int:
    per_step = s.micro_train_batch_size * world_size
    if s.train_batch_size % per_step:
        raise UserError(
            f"--train_batch_size {s.train_batch_size} must be a multiple of --micro_train_batch_size "
            f"{s.micro_train_batch_size} x world size {world_size} = {per_step}; change one of them"
        )
    return s.train_batch_size // per_step


def zero_note(stage: int, world_size: int, device: torch.device) -> str | None:
    """A banner warning for ZeRO-3 on a single GPU, where it costs time and saves nothing."""
    if stage == 3 and world_size == 1 and device.type == "cuda":
        return ("--zero_stage 3 on one GPU: nothing to shard, yet every layer's weights are gathered again on each "
                "forward and backward (3x slower than ZeRO-2 on an H200, docs/performance.md); prefer --zero_stage 2 "
                "unless the model only fits with 3")
    return None


def train_config(s: DSSettings, world_size: int, dtype: torch.dtype) -> dict:
    if s.zero_stage not in (0, 1, 2, 3):
        raise UserError(f"--zero_stage {s.zero_stage}: DeepSpeed ZeRO has stages 0, 1, 2 and 3")
    zero: dict = {"stage": s.zero_stage, "stage3_gather_16bit_weights_on_model_save": True}
    if s.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if s.adam_offload_ratio < 1.0 and s.zero_stage == 3:  # partial offload: the other sub-groups step on the GPU
            zero["offload_optimizer"]["ratio"] = s.adam_offload_ratio
    cfg = {
        "train_micro_batch_size_per_gpu": s.micro_train_batch_size,
        "gradient_accumulation_steps": grad_accumulation(s, world_size),
        "train_batch_size": s.train_batch_size,
        "gradient_clipping": s.max_norm if s.max_norm > 0 and not _clips_itself(s, dtype) else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16 and not s.autocast},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # our logger prints; keep DeepSpeed's own step lines out of the log
        "wall_clock_breakdown": False,
    }
    if s.autocast and dtype == torch.bfloat16:
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if s.zpg > 1:  # ZeRO++ hierarchical partitioning: a secondary copy of the weights per group of zpg ranks
        zero["zero_hpz_partition_size"] = s.zpg
    if s.overlap_comm:
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if s.grad_accum_dtype:
        cfg["data_types"] = {"grad_accum_dtype": s.grad_accum_dtype}
    return cfg


def use_expandable_segments() -> str | None:
    """Let the caching allocator grow segments in place (PyTorch's expandable_segments) in a DeepSpeed
    worker, before its first allocation: the reserved memory then stays near the allocated peak instead
    of holding blocks that no later tensor fits (10.5 GiB at the 3B bench's peak, dev/LOG.md).
    Not where the user set PYTORCH_CUDA_ALLOC_CONF, nor with HYBRIDRL_EXPANDABLE_SEGMENTS=0 (an escape
    should CUDA IPC of such memory fail on some driver); never in vLLM's processes, whose sleep mode
    refuses it. Returns the setting made, or None."""
    if not torch.cuda.is_available() or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") \
            or os.environ.get("HYBRIDRL_EXPANDABLE_SEGMENTS", "1") == "0":
        return None
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return "expandable_segments:True"


def eval_config(s: DSSettings, dtype: torch.dtype, offload: bool = False) -> dict:
    """Config for a frozen model (reference, reward): ZeRO-3 shards it (its shards in CPU memory with
    `offload`), other stages keep it whole."""
    zero: dict = {"stage": 3 if s.zero_stage == 3 else 0}
    if offload and s.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": s.micro_train_batch_size,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10**9,
    }


def zero3_loading(config: dict):
    """Keep the returned object alive while calling `from_pretrained` so ZeRO-3 shards at load time."""
    if config["zero_optimization"]["stage"] != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(config)


def _clips_itself(s: DSSettings, dtype: torch.dtype) -> bool:
    """ZeRO-0 without DeepSpeed's bf16 optimizer steps a plain torch optimizer: ours clips there
    (`common.training.updates.SkipNonfinite`), so that the norm it clips by is kept; DeepSpeed clips everywhere else."""
    return s.zero_stage == 0 and not (dtype == torch.bfloat16 and not s.autocast)


def _optimizer(params, s: DSSettings, dtype: torch.dtype, lr: float, betas, weight_decay: float):
    kwargs = {}
    if s.adam_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam as cls
    elif s.fused_adam:
        from deepspeed.ops.adam import FusedAdam as cls
    else:
        cls, kwargs = torch.optim.AdamW, {"fused": torch.cuda.is_available()}
    if s.zero_stage == 0:
        cls = type(cls.__name__, (SkipNonfinite, cls), {"max_norm": s.max_norm if _clips_itself(s, dtype) else 0.0})
    return cls(params, lr=lr, betas=betas, weight_decay=weight_decay, **kwargs)


def initialize(model, s: DSSettings, dist: DistInfo, dtype: torch.dtype, *, lr: float, total_steps: int,
               warmup_ratio: float = 0.03, scheduler: str = "cosine_with_min_lr",
               betas=(0.9, 0.95), weight_decay: float = 0.0, min_lr_ratio: float = 0.1):
    """Wrap a model for training; the scheduler steps once per optimizer step.

    As OpenRLHF: ceil(warmup_ratio x total_steps) warm-up steps, and cosine_with_min_lr decays to
    lr x min_lr_ratio (its `min_lr` = lr x --min_lr_ratio for DPO, lr x 0.1 elsewhere)."""
    import deepspeed
    from transformers import get_scheduler

    from common.training.models import rope_in_fp32

    rope_in_fp32(model)  # zero.Init made them bf16 (ZeRO-3)
    if s.deterministic:  # OpenRLHF's --full_determinism: deterministic kernels (cuBLAS needs its workspace set)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if s.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": s.reentrant})
    if s.compile:
        from common.training.models import compile_layers

        compile_layers(model)
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 shard is flat: use its full shape
            (no_decay if ndim < 2 or "norm" in n.lower() else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
              if g["params"]]
    opt = _optimizer(groups, s, dtype, lr, betas, weight_decay)
    kwargs = {"min_lr_rate": min_lr_ratio} if scheduler == "cosine_with_min_lr" else {}

    def make_scheduler(wrapped):  # built on DeepSpeed's wrapped optimizer, whose groups it steps
        return get_scheduler(scheduler, wrapped, num_warmup_steps=math.ceil(warmup_ratio * total_steps),
                             num_training_steps=max(total_steps, 1), scheduler_specific_kwargs=kwargs)

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=make_scheduler,
                                      config=train_config(s, dist.world_size, dtype))
    if s.zero_stage == 0 and dist.world_size == 1:
        # One rank: the all-reduce at each step's end is the identity, but DeepSpeed still copies the gradients
        # into flat buckets of 5e8 elements and back, 2 GiB in fp32 beside them at the training step's peak
        engine.enable_backward_allreduce = False
    if s.autocast and dtype == torch.bfloat16:
        engine.forward = _without_weight_cache(engine.forward)
    return engine


def _without_weight_cache(forward):
    """`forward` without torch.autocast's weight cache, which keeps the bf16 cast of every fp32 weight until the
    outermost autocast exits, i.e. the whole forward, though with gradient checkpointing or no grad nothing else
    holds it: a bf16 copy of the model's matrices at the peak (2.4 GiB at 1.5B, 5.2 at 3B, seen on an H200).
    Each weight is cast once per forward either way; checkpoint's recompute inherits the setting. Generation
    outside the engine's forward keeps the cache (one cast per weight, not one per token)."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        prev = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            return forward(*args, **kwargs)
        finally:
            torch.set_autocast_cache_enabled(prev)

    return run


def initialize_eval(model, s: DSSettings, dtype: torch.dtype, device: torch.device, offload: bool = False):
    """A frozen model: a DeepSpeed engine under ZeRO-3 (sharded), else the plain module on device
    (with `offload`: left in CPU memory, for the caller to move over for each forward pass)."""
    model.eval().requires_grad_(False)
    if s.compile:
        from common.training.models import compile_layers

        compile_layers(model)
    from common.training.models import rope_in_fp32

    if s.zero_stage != 3:
        model = model.to(device="cpu" if offload else device, dtype=dtype)
        rope_in_fp32(model)  # .to(dtype) cast them
        return model
    import deepspeed

    rope_in_fp32(model)  # zero.Init made them bf16
    engine, *_ = deepspeed.initialize(model=model, config=eval_config(s, dtype, offload))
    engine.eval()
    return engine


def unwrap(model):
    return getattr(model, "module", model)


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters on CPU, on every rank; collective under ZeRO-3."""
    import deepspeed

    module = unwrap(model)
    out = {}
    for name, p in module.named_parameters():
        if hasattr(p, "ds_id"):  # a ZeRO-3 shard: gather the full tensor
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                out[name] = p.detach().to("cpu", copy=True)
        else:
            out[name] = p.detach().to("cpu", copy=True)
    transient = {f"{m}.{b}" if m else b for m, sub in module.named_modules() for b in sub._non_persistent_buffers_set}
    for name, b in module.named_buffers():
        if name not in transient:  # e.g. rotary caches are rebuilt at load; saving them confuses loaders
            out[name] = b.detach().to("cpu", copy=True)
    return out


def save_hf(model, tokenizer, path: str, rank: int, dtype: torch.dtype | None = None) -> None:
    """Save in Hugging Face format (safetensors); a model with a LoRA adapter saves the adapter alone, in
    peft's format (common.training.lora). Collective: every rank calls it."""
    from common.training.lora import has_adapter, save_adapter

    if has_adapter(model):
        return save_adapter(model, tokenizer, path, rank)
    state = full_state_dict(model)
    if rank == 0:
        from common.training.models import head_saved_as

        module = unwrap(model)
        state = head_saved_as(module, state)  # an OpenRLHF-style head keeps its name (value_head_prefix)
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        os.makedirs(path, exist_ok=True)
        cfg_path = os.path.join(path, "config.json")
        run_options = None
        if os.path.exists(cfg_path):  # the logger's record of the run's options: keep it
            with open(cfg_path) as f:
                run_options = json.load(f).get("hybridrl")
        module.save_pretrained(path, state_dict=state, safe_serialization=True)
        if run_options is not None:
            with open(cfg_path) as f:
                cfg = json.load(f)
            cfg["hybridrl"] = run_options
            with open(cfg_path, "w") as f:
                json.dump(cfg, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
