"""Loading and saving the models every script uses.

- A causal LM (actor, reference, DPO policy): `AutoModelForCausalLM`.
- A reward model / critic: transformers' `AutoModelForSequenceClassification` with one label,
  i.e. the LM body plus a scalar head (`score`). The reward is that head at a sequence's last real
  token; the critic applies the same head to every token. Folders saved by `train_rm.py` load back
  with `AutoModelForSequenceClassification.from_pretrained` or `load_reward_model`.
- OpenRLHF's reward models and critics are the same thing saved another way: the base model's
  weights (`model.*`) plus a bias-free linear head whose attribute name is `value_head_prefix`
  (recorded in config.json, `score` by default), and the reward statistics `mean` and `std` in the
  config. `load_reward_model` reads them, renaming the head to `score` on load (`head_saved_as`
  names it back on save), and applies `(v - mean) / std` when asked to (`normalize_reward`).
"""
from __future__ import annotations

import json
import os
import re

import torch

from common.errors import UserError


def resolve_pretrain(path: str | None) -> str:
    """None means the built-in tiny model (built on first use, then cached)."""
    if path is None:
        from common.training.tiny import tiny_model_path

        return tiny_model_path()
    return path


def _check_folder(path: str, what: str) -> None:
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise UserError(f"{what} {path}: no config.json in this folder; is it a Hugging Face model folder?")
        return
    if os.path.exists(path):
        raise UserError(f"{what} {path}: a file, not a model folder")
    if path.startswith((".", "/", "~")):
        raise UserError(f"{what} {path}: no such folder")
    # anything else is taken as a hub id; transformers says if it cannot be fetched


def attn_implementation(flash_attn: bool | str) -> tuple[str, str | None]:
    """(attn_implementation, note). flash-attention 2 needs its package and a GPU. "eager" is
    OpenRLHF's `--attn_implementation eager` (common.cli.openrlhf_flags), passed through."""
    if flash_attn == "eager":
        return "eager", None
    if not flash_attn:
        return "sdpa", None
    try:
        import flash_attn  # noqa: F401

        if torch.cuda.is_available():
            return "flash_attention_2", None
    except ImportError:
        pass
    return "sdpa", "--flash_attn: flash-attention is not available here; using PyTorch SDPA attention"


def max_len_note(config, max_len: int) -> str | None:
    """A banner warning when --max_len exceeds the model's max_position_embeddings (`config`: its transformers
    config): a sequence that long runs past the positions the model was made for, which fails (a table of
    learned positions) or degrades quietly (rotary positions). The PPO/GRPO scripts check their prompts
    and --generate_max_len instead (common.rollout.samples.positions_note)."""
    positions = getattr(config, "max_position_embeddings", None)
    if not positions or max_len <= positions:
        return None
    return (f"--max_len {max_len} exceeds the model's {positions} positions (max_position_embeddings in its "
            f"config.json): sequences longer than {positions} tokens run past the positions it was made for; lower "
            f"--max_len to {positions}")


def _not_loadable(what: str, path: str, e: Exception) -> UserError:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if not os.path.isdir(path):  # a hub id: offline, unreachable, gated or misspelt
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        return UserError(f"{what} {path}: not a local folder, and not in the Hugging Face cache"
                         f"{' with the hub offline (HF_HUB_OFFLINE=1)' if offline else ' nor fetchable from the hub'}"
                         f"; download it first (hf download {path}) or give a model folder ({first})")
    return UserError(f"{what} {path}: could not be loaded ({first})")


def load_tokenizer(path: str, *, padding_side: str = "right", what: str = "--pretrain"):
    from transformers import AutoTokenizer

    _check_folder(path, what)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise _not_loadable(what, path, e) from e
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise UserError(f"tokenizer {path}: it has neither a pad nor an eos token; add a pad token to it")
        # Padding is always masked out, so borrowing eos is safe; attention masks, not ids, mark padding.
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def _load(cls, path: str, what: str, *, dtype, attn_impl: str, **kw):
    _check_folder(path, what)
    try:
        return cls.from_pretrained(path, dtype=dtype, attn_implementation=attn_impl, **kw)
    except (OSError, ValueError) as e:
        raise _not_loadable(what, path, e) from e


def _merged(model, adapter: str):
    """`model` (the base a LoRA run trained on) with the adapter saved at `adapter` merged into its weights."""
    from peft import PeftConfig, PeftModel

    config = PeftConfig.from_pretrained(adapter)
    # an SFT adapter under a reward model's body (or the reverse): peft's task wrapper would expect the other head
    config.task_type = None
    merged = PeftModel.from_pretrained(model, adapter, config=config).merge_and_unload()
    return merged.requires_grad_(True)  # peft loads for inference, frozen; a model loaded here is one like any other


def load_causal_lm(path: str, *, dtype=torch.float32, attn_impl: str = "sdpa", **kw):
    """A causal LM; a LoRA run's saved adapter folder loads as its base with the adapter merged in.
    kw: more from_pretrained arguments (--load_in_4bit's quantization_config)."""
    from transformers import AutoModelForCausalLM

    from common.training.lora import adapter_base

    base = adapter_base(path) if os.path.isdir(path) else None
    if base:
        return _merged(load_causal_lm(base, dtype=dtype, attn_impl=attn_impl, **kw), path)
    model = _load(AutoModelForCausalLM, path, "model", dtype=dtype, attn_impl=attn_impl, **kw)
    model.config.use_cache = False
    return model


def _checkpoint_keys(path: str) -> set[str] | None:
    """The weight names of a local folder's safetensors files (their headers only); None when unknown."""
    if not os.path.isdir(path):
        return None  # a hub id: transformers fetches it; the checks below then rely on its config alone
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return set(json.load(f).get("weight_map", {}))
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    if not files:
        return None
    from safetensors import safe_open

    keys: set[str] = set()
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as f:
            keys.update(f.keys())
    return keys


# The class names OpenRLHF's saved reward models and critics record under `architectures`.
OPENRLHF_VALUE_CLASSES = ("RewardModel", "CriticModel")


def value_head_name(path: str, flag: str = "score") -> tuple[str, str]:
    """(the value head's attribute name, where it came from): the folder's config `value_head_prefix`
    wins over the `--value_head_prefix` flag, as in OpenRLHF's loader."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"reward model {path}: could not read its config ({str(e).splitlines()[0]})") from e
    recorded = getattr(config, "value_head_prefix", None)
    prefix, source = (recorded, f"{path}/config.json value_head_prefix") if recorded else (flag, "--value_head_prefix")
    if not isinstance(prefix, str) or not prefix.isidentifier():
        raise UserError(f"{source} {prefix!r}: a value head's name is a Python identifier such as score or value_head")
    if prefix == getattr(config, "base_model_prefix", None) or prefix in ("model", "lm_head"):
        raise UserError(f"{source} {prefix!r}: that name is the model's body or LM head, not a value head")
    keys = _checkpoint_keys(path)
    archs = getattr(config, "architectures", None) or []
    is_value_model = any(a.endswith("ForSequenceClassification") or a in OPENRLHF_VALUE_CLASSES for a in archs)
    if keys is not None and is_value_model and f"{prefix}.weight" not in keys:
        # A reward model whose head is not where we look would silently get a new random head.
        heads = sorted(k[: -len(".weight")] for k in keys if k.count(".") == 1 and k.endswith(".weight")
                       and not k.startswith("lm_head"))
        raise UserError(f"reward model {path}: its weights have no value head named {prefix!r} ({source}); its "
                        f"top-level weights are {heads or 'none'}: pass --value_head_prefix with the head's name")
    return prefix, source


def load_reward_model(path: str, *, dtype=torch.float32, attn_impl: str = "sdpa", pad_token_id: int | None = None,
                      value_head_prefix: str = "score", normalize_reward: bool = False, **kw):
    """A scalar-head model: ours (`score`), OpenRLHF's (head `value_head_prefix`), or an LM folder,
    whose head is new (seeded by the caller's torch seed).

    normalize_reward: the head's outputs become (v - mean) / std with the folder's recorded mean and
    std (0 and 1 when it has none), in training as at inference. As in OpenRLHF it is the caller's
    choice (a critic's values too), never the folder's recorded `normalize_reward`."""
    from transformers import AutoModelForSequenceClassification

    from common.training.lora import adapter_base

    base = adapter_base(path) if os.path.isdir(path) else None
    if base:  # a LoRA reward model: its base, then the adapter and its trained head merged in
        model = load_reward_model(base, dtype=dtype, attn_impl=attn_impl, pad_token_id=pad_token_id,
                                  value_head_prefix=value_head_prefix, normalize_reward=normalize_reward, **kw)
        return _merged(model, path)
    _check_folder(path, "reward model")
    prefix, _ = value_head_name(path, value_head_prefix)
    # The head is `score` in memory whatever its name on disk: transformers' key mapping renames it on
    # load, and `head_saved_as` (common.training.ds.save_hf) on save, so a folder keeps the name it came with.
    mapping = {rf"^{re.escape(prefix)}\.": "score."} if prefix != "score" else None
    model = _load(AutoModelForSequenceClassification, path, "reward model", dtype=dtype,
                  attn_impl=attn_impl, num_labels=1, key_mapping=mapping, **kw)
    if pad_token_id is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    model.config.use_cache = False
    if not hasattr(model, "score"):
        raise UserError(f"reward model {path}: architecture {type(model).__name__} has no `score` head")
    # Recorded in every folder we save, so OpenRLHF's loader (and ours) finds the head by name.
    model.config.value_head_prefix = prefix
    model.config.normalize_reward = normalize_reward
    return model


def head_saved_as(module, state: dict) -> dict:
    """`state` (name -> tensor) with the value head under the name its config records (`value_head_prefix`),
    as the folder it came from had it; saving must not rely on transformers reversing the load's key mapping,
    which it does only for keys the load renamed (not for a new head)."""
    prefix = getattr(module.config, "value_head_prefix", None)
    if prefix in (None, "score") or not hasattr(module, "score"):
        return state
    return {prefix + k[len("score"):] if k.startswith("score.") else k: v for k, v in state.items()}


def rope_in_fp32(model) -> int:
    """Give rotary embeddings back their fp32 inverse frequencies; returns how many were fixed.

    ZeRO-3's zero.Init (loading under HfDeepSpeedConfig) makes every floating tensor created during
    from_pretrained in the weights' dtype, RoPE's `inv_freq` too, and a frozen model's `.to(bfloat16)` casts
    it: in bf16 a frequency is off by up to 2^-9 of itself, so at position 268 the fastest rotation is off
    by ~0.5 rad. That doubled `rollout/logprob_diff` at 3B with --zero_stage 3 --bf16 (0.059 against 0.030
    under autocast; vLLM keeps them in fp32, dev/LOG.md). The buffers are not ZeRO-partitioned:
    rebuilding the module outside zero.Init gives the fp32 values."""
    fixed = 0
    for module in model.modules():
        inv = module._buffers.get("inv_freq") if hasattr(module, "_buffers") else None
        if inv is None or inv.dtype == torch.float32 or not hasattr(module, "config"):
            continue
        try:
            fresh = type(module)(module.config)
        except TypeError:  # a rotary module built from other arguments: left as it is
            continue
        for name, buf in fresh.named_buffers(recurse=False):
            if name in module._buffers and buf.is_floating_point():
                module._buffers[name] = buf.to(device=inv.device)
        fixed += 1
    return fixed


def compile_in_process() -> None:
    """Inductor compiles in this process unless TORCHINDUCTOR_COMPILE_THREADS says otherwise.

    Its default is a pool of one compile-worker process per core, kept after compiling; each
    worker wakes periodically, and the trainer, the reference and a CPU-bound vLLM engine share the
    host's cores (vLLM compiles in-process after warm-up for the same reason). The blocks and the
    log-prob kernels compile once, so the pool's speed-up is a few seconds per run."""
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config as inductor

        inductor.compile_threads = 1


def compile_layers(model) -> int:
    """torch.compile each transformer block in place; returns how many.

    Regional compilation: the blocks share one piece of code, compiled once (seconds) and reused by
    every layer, which fuses the norms, activations and rotary embeddings that eager mode runs as
    separate kernels. The embedding, the head and the log-probs stay outside (common.algo.logprobs fuses
    those)."""
    compile_in_process()
    blocks = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for m in blocks:
        m.compile()
    return len(blocks)


def token_values(model, **inputs) -> torch.Tensor:
    """The scalar head on every position: model inputs (input_ids [B, T] with attention_mask, or packed
    rows with position_ids) -> [B, T] fp32; (v - mean) / std where the model was loaded with
    normalize_reward (`load_reward_model`)."""
    module = getattr(model, "module", model)
    mask = inputs.get("attention_mask")
    if "position_ids" not in inputs and mask is not None and mask.dim() == 2:
        # Positions count real tokens only, so a left-padded row scores as the same row right-padded
        # (OpenRLHF's convention; for right-padded rows these are transformers' own positions).
        inputs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = module.base_model(**inputs).last_hidden_state
    values = module.score(hidden).squeeze(-1).float()
    config = module.config
    if getattr(config, "normalize_reward", False):
        values = (values - float(getattr(config, "mean", 0.0))) / float(getattr(config, "std", 1.0))
    return values


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token, right- or left-padded. [B, T] -> [B]."""
    T = attention_mask.shape[1]
    pos = torch.arange(T, device=attention_mask.device).expand_as(attention_mask)
    return (pos * attention_mask.long()).argmax(dim=1)


def reward_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The reward of each (right- or left-padded) sequence: the head at its last real token. -> [B] fp32."""
    values = token_values(model, input_ids=input_ids, attention_mask=attention_mask)
    return values.gather(1, last_token_index(attention_mask)[:, None]).squeeze(1)
