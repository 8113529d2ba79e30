"""The memory estimate: bytes each process holds on a GPU per phase, from the models' shapes.

Pure arithmetic, no torch: `plan_memory(Job)` for a layout, `read_shape` for a folder's config.json.
N parameters, D the role's data-parallel ranks, w = 2 bytes (bf16 weights) or 4, e the activations'
element size; the formulas and their sources: dev/LOG.md, "Memory plan"; the plan against measured
peaks: docs/performance.md.
- trained (DeepSpeed): weights w*N (/D at ZeRO-3); fp32 master 4N at ZeRO-0 with bf16 weights, 4N/D at
  ZeRO 1-3 (a clone, even of fp32 weights); Adam moments 8N (/D at ZeRO 1-3); gradients w*N/D kept,
  in backward the full w*N (ZeRO 0-1) or a bucket w*min(N, 5e8) (2-3), at the step an fp32 copy of
  the partition (bf16 weights). --adam_offload: master and moments in CPU memory (ZeRO 1-3).
- activations per token and layer: Korthikanti et al. 2022's 34h + 5as/h bytes ("Reducing Activation
  Recomputation in Large Transformer Models", eq. 2) redone for a Llama/Qwen block as autograd saves
  it: e*(3q + 2kv + 4f) + norms (no s^2 scores: SDPA and flash recompute them; SDPA with a padding mask
  repeats K, V to q wide, 5q, and the mask is b*s^2 bytes); --gradient_checkpointing keeps each layer's
  input and one recomputed layer.
- logits: tokens x vocab in the compute dtype, twice in training (kept, and their gradient): the fused
  log-probs hold no fp32 copy (common/algo/logprobs.py); the RL workers on a GPU (ZeRO 0-2) make them from
  the hidden state 2048 positions at a time, twice that chunk in training with the head's fp32 gradient.
- vLLM: --vllm_gpu_memory_utilization of the whole GPU, VLLM_ASLEEP asleep, + its weights at sync.
- each torch process: CONTEXT, and SLACK over its allocated peak; the caching allocator keeps what a
  process freed until empty_cache (DeepSpeed sleep, the offloaded reference's visits).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


GiB = 2**30
CONTEXT = int(0.75 * GiB)  # CUDA context, cuBLAS workspace, NCCL buffers of one torch process
SLACK = 0.08               # caching allocator: reserved over allocated at the peak (rounding, fragments)
VLLM_ASLEEP = 2 * GiB      # left of a sleeping engine: 0.6-2.6 GiB measured (docs/performance.md)
BUCKET = 500_000_000       # DeepSpeed's default reduce_bucket_size, elements
PHASES = ("generate", "logprobs", "train", "sync")


class _NoPlan(Exception):
    """The plan cannot be made (a hub id not in the cache): shown as a note, never a refusal."""


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes from config.json (counts of parameters or elements)."""
    params: int
    layers: int
    hidden: int
    inter: int          # MLP width f
    q_dim: int          # heads x head_dim
    kv_dim: int         # KV heads x head_dim
    vocab: int
    layer_params: int
    embed_params: int
    dtype_bytes: int    # of the saved weights (vLLM's "auto" dtype)
    kind: str = ""      # config.json's model_type


@dataclass(frozen=True)
class Model:
    role: str           # actor, critic, ref, reward (RL); policy, reference, reward model (DPO, RM)
    shape: Shape
    trainable: bool
    logits: bool        # a causal LM head (full-vocabulary logits), else a scalar head
    ranks: int          # data-parallel ranks: ZeRO shards over them
    group: str          # GPUs it shares with other roles (common.cluster.resources.Plan's groups)
    process: str        # models of one process share its allocator and context (DPO: policy + reference)
    gpus_flag: str = "" # the flag that gives it twice the GPUs
    adapter: int = 0    # trained with LoRA: the adapter's parameters (master, moments, gradients); 0: every weight
    bits4: bool = False # --load_in_4bit: the frozen base's linear layers in NF4


@dataclass(frozen=True)
class Job:
    models: tuple[Model, ...]
    zero_stage: int
    bf16: bool
    autocast: bool
    adam_offload: bool
    checkpointing: bool
    seq: int                     # longest sequence, tokens
    train_rows: int              # sequences per training micro-batch
    infer_rows: int              # sequences per no-grad micro-batch (log-probs, values, scores)
    step_rows: int               # sequences per step over all ranks (caps each rank's micro-batches)
    gen_rows: int = 0            # sequences the policy decodes at once itself (no vLLM)
    rows_per_item: int = 1       # 2 for preference pairs: --micro_train_batch_size counts pairs
    flash: bool = False
    packing: bool = False
    ds_sleep: bool = False
    ref_offload: bool = False
    offload_flag: str = "--ref_reward_offload"
    vllm_group: str | None = None
    vllm_gpus: int = 0           # engine workers, one per GPU
    vllm_util: float = 0.0
    vllm_sleep: bool = False
    vllm_weights: int = 0        # bytes per engine worker (weights / TP)
    sync_bucket: int = 0         # bytes of one weight-sync bucket
    offload_ratio: float = 1.0   # --adam_offload under ZeRO-3: the share of optimizer sub-groups in CPU memory
    head_chunk: int = 0          # RL workers on a GPU, ZeRO 0-2: the head's logits made this many positions at a time
    phases: tuple[str, ...] = PHASES


@dataclass(frozen=True)
class ProcessMemory:
    """One process on each of `gpus` GPUs, bytes per phase: `phases` what the device holds for it (its
    allocator's running peak + slack + context), `allocated` its tensors (torch.cuda.memory_allocated);
    `breakdown` the allocated peak by component."""
    group: str
    process: str
    gpus: int
    phases: dict[str, int]
    allocated: dict[str, int]
    breakdown: dict[str, int]
    gpu_fraction: dict[str, float] = field(default_factory=dict)  # vLLM's share of a GPU of unknown size

    @property
    def allocated_peak(self) -> int:  # compare torch.cuda.max_memory_allocated
        return max(self.allocated.values())


@dataclass(frozen=True)
class MemoryPlan:
    processes: list[ProcessMemory]
    gpu_bytes: int | None        # the GPU's memory (None: none visible here)
    job: Job | None = None
    note: str | None = None      # why there is no plan

    def groups(self) -> list[str]:
        return list(dict.fromkeys(p.group for p in self.processes))

    def group_peak(self, group: str) -> tuple[str, int, float]:
        """(phase, bytes, GPU fraction) where the processes sharing one GPU of `group` peak together."""
        procs = [p for p in self.processes if p.group == group]
        sums = {ph: (sum(p.phases[ph] for p in procs), sum(p.gpu_fraction.get(ph, 0.0) for p in procs))
                for ph in self.job.phases}
        # on a known GPU, where the bytes peak; else the phase that needs the largest GPU (vLLM's share
        # of the GPU grows with it: bytes / (1 - share)), not a guessed size's peak
        ph = max(sums, key=lambda k: (sums[k][0] + sums[k][1] * self.gpu_bytes if self.gpu_bytes else
                                      sums[k][0] / max(1e-9, 1 - sums[k][1]),
                                      sum(p.allocated[k] for p in procs)))  # ties: where the tensors peak
        return (ph, *sums[ph])

    def worst(self) -> int:
        return max((self.group_peak(g)[1] for g in self.groups()), default=0)


def how_to_plan(model_id: str) -> str:
    """Why a hub id has no plan here, and the two ways to get one without its weights."""
    import re

    shapes = []
    try:  # bench/make_model.py's shapes: its --shape choices (the file imports typer only at the top)
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "_make_model", os.path.join(os.path.abspath(__file__).rsplit(os.sep + "common" + os.sep, 1)[0], "bench", "make_model.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        shapes = list(module.SHAPES)
    except Exception:  # not in a checkout of the repo (an installed package): no script to name
        pass
    size = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z])", model_id.rsplit("/", 1)[-1])
    known = size is not None and size.group(1) + "b" in shapes
    shape = size.group(1) + "b" if known else "|".join(shapes)
    local = (f"; or write a config of {'its' if known else 'similar'} sizes: `python bench/make_model.py --shape {shape} "
             "--config-only --out DIR` (8b: Llama-3-8B's sizes; the others Qwen2.5's) and give DIR (or any config.json) "
             f"in place of {model_id} to --dry_run" if shapes else "")
    return (f"{model_id} is neither a local folder nor in the Hugging Face cache, and the plan reads its config.json "
            f"without downloading. To see the plan, fetch that file alone (`hf download {model_id} config.json`, "
            f"online; the plan then reads it from the cache){local}")


def read_shape(path: str | None, value_head: bool = False) -> Shape:
    """Shape of a model folder (None: the built-in tiny model) from its config.json; a hub id only if the
    Hugging Face cache holds its config (never downloads). Llama/Qwen/Mistral-style dense decoders (no
    experts; a multimodal config's text_config)."""
    if path is None:
        from common.training.tiny import tiny_model_path

        path = tiny_model_path()
    file = os.path.join(path, "config.json")
    if os.path.isfile(path) and path.endswith(".json"):  # a config.json alone: all a dry run's plan needs
        file = path
    elif not os.path.isdir(path):
        try:
            from huggingface_hub import try_to_load_from_cache

            file = try_to_load_from_cache(path, "config.json")
        except Exception:  # an id the hub library rejects, or no hub library: no plan either way
            file = None
        if not isinstance(file, str):
            raise _NoPlan(how_to_plan(path))
    if not os.path.exists(file):
        raise _NoPlan(f"{path}: no config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    h, L, V, a = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // a
    q, kv, f = a * d, (cfg.get("num_key_value_heads") or a) * d, cfg.get("intermediate_size") or 4 * h
    kind = cfg.get("model_type", "")
    bias = q + 2 * kv if cfg.get("attention_bias", kind == "qwen2") else 0
    layer = 2 * h * q + 2 * h * kv + bias + (2 * d if kind.startswith("qwen3") else 0) + 3 * h * f + 2 * h
    head = h if value_head else 0 if cfg.get("tie_word_embeddings", False) else V * h
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return Shape(L * layer + V * h + h + head, L, h, f, q, kv, V, layer, V * h, 4 if "32" in dtype else 2, kind)


LORA_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_params(s: Shape, rank: int, targets: tuple[str, ...] = ("all-linear",)) -> int:
    """A LoRA adapter's parameters: rank x (in + out) for each targeted linear layer of every block (all-linear:
    the seven of a Llama/Qwen block; the output head is never targeted)."""
    h, q, kv, f = s.hidden, s.q_dim, s.kv_dim, s.inter
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h, "gate_proj": h + f,
             "up_proj": h + f, "down_proj": f + h}
    chosen = LORA_LAYERS if "all-linear" in targets else [t for t in targets if t in sizes]
    return s.layers * rank * sum(sizes[t] for t in chosen)


def _tokens(m: Model, j: Job, rows: int, train: bool) -> dict[str, int]:
    """Transient bytes of one micro-batch of `rows` sequences: forward, and backward when `train`."""
    s, t = m.shape, rows * j.seq
    e = 2 if j.bf16 else 4
    master = j.bf16 and not (m.trainable and j.autocast)  # bf16 weights (frozen models are bf16 under autocast too)
    # RMSNorm keeps an fp32 copy of its input, the normalised x and the product: 8h bytes with bf16
    # weights, 12h in fp32, 14h under autocast (+ the bf16 cast its linear saves)
    norms = 2 * (8 if master else 14 if j.bf16 else 12) * s.hidden
    per_layer = e * ((3 * s.q_dim + 2 * s.kv_dim if j.flash else 5 * s.q_dim) + 4 * s.inter) + norms
    out = {"activations": 0 if j.flash else t * t if j.packing else rows * j.seq * j.seq}  # the attention mask
    if j.zero_stage == 3:  # a layer's gathered weights and the next one's prefetch
        out["buffers"] = 2 * max(s.layer_params, s.embed_params) * (2 if master else 4)
    if train:
        ckpt = s.layers * s.hidden * (2 if master else 4) + per_layer  # layer inputs + one recomputed layer
        out["activations"] += t * (ckpt if j.checkpointing else s.layers * per_layer)
        out["logits"] = 2 * t * s.vocab * e if m.logits else 0
        if m.logits and j.head_chunk:  # a chunk's logits and their gradient; the head's gradient in fp32 and a cast
            out["logits"] = 2 * min(t, j.head_chunk) * s.vocab * e + s.embed_params * (4 + e)
    else:  # no grad: one layer's intermediates at a time, then the logits
        out["activations"] += t * e * (3 * s.inter + 3 * s.hidden)
        out["logits"] = (min(t, j.head_chunk) if j.head_chunk else t) * s.vocab * e if m.logits else 0
    return out


def _add(into: dict, part: dict) -> None:
    for k, v in part.items():
        into[k] = into.get(k, 0) + v


def _weight_bytes(m: Model, j: Job) -> int:
    return 4 if not j.bf16 or (m.trainable and j.autocast) else 2  # frozen models: bf16 under autocast too


def _frozen_base(m: Model, wb: int) -> int:
    """Bytes of a LoRA model's frozen base: NF4 (half a byte and its double-quantised scales) for the blocks'
    linear layers under --load_in_4bit, `wb` bytes for the rest."""
    s = m.shape
    if not m.bits4:
        return wb * s.params
    linear = s.layers * (2 * s.hidden * s.q_dim + 2 * s.hidden * s.kv_dim + 3 * s.hidden * s.inter)
    return int(linear * 0.515) + 2 * (s.params - linear)


def training_states(m: Model, j: Job) -> dict[str, int]:
    """Bytes a trained model keeps on each of its GPUs between steps: weights, fp32 master, Adam moments,
    gradients (the CPU tests count them in real DeepSpeed engines, tests/*/test_memory_plan.py)."""
    base, d, z, wb = m.shape.params, m.ranks, j.zero_stage, _weight_bytes(m, j)
    n = m.adapter or base  # LoRA: only the adapter has master, moments and gradients
    off = j.adam_offload and z >= 1  # ZeRO-Offload: master and moments (and the gradient partition) in CPU memory
    # ZeRO-3 means to share fp32 weights with its master, but compares a device with a string: it never does
    master = 0 if off or (wb == 4 and z == 0) else 4 * n // (1 if z == 0 else d)
    weights = wb * n if not m.adapter else _frozen_base(m, wb) + 4 * n  # the base frozen beside an fp32 adapter
    out = {"weights": weights // (d if z == 3 else 1), "master": master, "moments": 0 if off else 8 * n // (d if z else 1),
           "grads": (0 if z == 0 or off else wb * n // d) + (wb * min(n, BUCKET) if z == 3 else 0)}
    if off and z == 3 and j.offload_ratio < 1:  # partial offload: the GPU's sub-groups keep master, moments, fp32 grads
        gpu = int((1 - j.offload_ratio) * n / d)
        out["master"], out["moments"], out["grads"] = 4 * gpu, 8 * gpu, out["grads"] + 4 * gpu
    return out


def _model_phases(m: Model, j: Job) -> dict[str, dict[str, int]]:
    """Allocated bytes of one model on one GPU, per phase and component."""
    n, d, z = m.adapter or m.shape.params, m.ranks, j.zero_stage  # LoRA: the adapter's gradients and step
    per_rank = -(-j.step_rows // d)
    per: dict[str, dict[str, int]] = {ph: {} for ph in j.phases}
    weights = _weight_bytes(m, j) * n // (d if z == 3 else 1)
    infer = _tokens(m, j, min(j.infer_rows, per_rank), False)
    if not m.trainable:  # frozen: its forward in "logprobs"; offloaded: ZeRO-3 streams shards, else it visits
        for ph in j.phases:
            per[ph]["weights"] = 0 if j.ref_offload and (z == 3 or ph != "logprobs") else weights
        _add(per.get("logprobs", {}), infer)
        return per
    off, wb = j.adam_offload and j.zero_stage >= 1, _weight_bytes(m, j)
    states = training_states(m, j)
    for ph in j.phases:
        if not (j.ds_sleep and ph == "generate"):  # asleep: in CPU memory (common.training.ds_sleep) ...
            per[ph].update(states)
        elif not off:  # ... all but the bf16 weights (OpenRLHF's choice) ...
            per[ph]["weights"] = states["weights"]
        elif j.offload_ratio < 1:  # ... or with --adam_offload all DeepSpeed holds, but offload_states leaves a CPU optimizer's states
            # alone, also the sub-groups that partial offload keeps on the GPU (and their fp32 gradients)
            per[ph].update(master=states["master"], moments=states["moments"], grads=4 * (states["master"] // 4))
    if "logprobs" in per and m.role != "policy":  # DPO's policy has no no-grad pass
        _add(per["logprobs"], infer)
    if "train" in per:
        t = _tokens(m, j, min(j.train_rows, per_rank), True)
        backward = wb * n if z <= 1 else wb * min(n, BUCKET) if z == 2 else 0
        if z == 0 and d > 1:  # DeepSpeed all-reduces ZeRO-0's gradients through a flat fp32 copy of 5e8 at a time
            backward += 4 * min(n, BUCKET)
        # the fp32 gradient the master steps with (ZeRO-3: one sub-group of 1e9 elements at a time)
        step = 0 if wb == 4 or off else 4 * (min(n // d, 10**9) if z == 3 else n // (d if z else 1))
        if off and z == 3 and j.offload_ratio < 1:  # partial offload steps the GPU sub-groups with torch's AdamW
            # (foreach): about three fp32 temporaries of one sub-group (7B: 12.5 GiB over the plan without them)
            step = 3 * 4 * min(int((1 - j.offload_ratio) * n / d), 10**9)
        per["train"]["grads"] += backward + (step if step > sum(t.values()) else 0)
        if step <= sum(t.values()):  # the step runs after backward has freed the activations
            _add(per["train"], t)
            # ... but the caching allocator cannot hand their blocks to one tensor larger than the largest
            # (the logits, else an MLP intermediate): then the device holds both ("reserved", not allocated)
            tokens = min(j.train_rows, per_rank) * j.seq
            if step > tokens * max(m.shape.vocab if m.logits else 0, m.shape.inter) * (2 if j.bf16 else 4):
                per["train"]["reserved"] = step
    if "generate" in per and j.gen_rows and m.role == "actor":  # HF generate's KV cache
        per["generate"]["kv cache"] = j.gen_rows * j.seq * m.shape.layers * 2 * m.shape.kv_dim * (2 if j.bf16 else 4)
    if "sync" in per and j.vllm_gpus and m.role == "actor":  # a packed bucket (ZeRO-3: and its gather)
        per["sync"]["buffers"] = j.sync_bucket * (2 if z == 3 else 1)
    return per


def plan_memory(job: Job, gpu_bytes: int | None = None) -> MemoryPlan:
    """Each process's device bytes per phase on one GPU of its group (`gpu_bytes`: the GPU's memory)."""
    out = []
    for proc in dict.fromkeys(m.process for m in job.models):
        models = [m for m in job.models if m.process == proc]
        alloc: dict[str, dict[str, int]] = {ph: {} for ph in job.phases}
        for m in models:
            for ph, part in _model_phases(m, job).items():
                _add(alloc[ph], part)
        total = {ph: sum(v for k, v in c.items() if k != "reserved") for ph, c in alloc.items()}
        sleeps = job.ds_sleep and any(m.trainable for m in models)  # offload_states + empty_cache after sync
        visits = job.ref_offload and job.zero_stage != 3 and not any(m.trainable for m in models)
        held, run = {}, 0
        device = {ph: total[ph] + alloc[ph].get("reserved", 0) for ph in job.phases}
        for ph in job.phases:  # the allocator holds its running peak since the last empty_cache
            run = device[ph] if visits or (sleeps and ph == job.phases[0]) else max(run, device[ph])
            held[ph] = run if sleeps or visits else max(device.values())
        top = max(total, key=total.get)
        breakdown = {k: v for k, v in alloc[top].items() if v} | {"slack": int(total[top] * SLACK), "context": CONTEXT}
        out.append(ProcessMemory(models[0].group, proc, models[0].ranks,
                                 {ph: int(held[ph] * (1 + SLACK)) + CONTEXT for ph in job.phases}, total, breakdown))
    if job.vllm_gpus:
        awake = {ph: not job.vllm_sleep or ph == "generate" for ph in job.phases}
        fixed = {ph: 0 if awake[ph] else VLLM_ASLEEP + (job.vllm_weights if ph == "sync" else 0) for ph in job.phases}
        frac = {ph: job.vllm_util if awake[ph] else 0.0 for ph in job.phases}
        if gpu_bytes:
            fixed, frac = {ph: fixed[ph] + int(frac[ph] * gpu_bytes) for ph in job.phases}, {}
        top = max(job.phases, key=lambda ph: fixed[ph] + frac.get(ph, 0.0) * 100 * GiB)
        out.append(ProcessMemory(job.vllm_group, "vllm", job.vllm_gpus, fixed, fixed, {"weights, KV cache": fixed[top]}, frac))
    return MemoryPlan(out, gpu_bytes, job)
