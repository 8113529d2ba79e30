"""Loading and saving the models every script uses.

- A causal LM (actor, reference, DPO policy): `AutoModelForCausalLM`.
- A reward model / critic: transformers' `AutoModelForSequenceClassification` with one label,
  i.e. the LM body plus a scalar head (`score`). The reward is that head at a sequence's last real
  token; the critic applies the same head to every token. Folders saved by `train_rm.py` load back
  with `AutoModelForSequenceClassification.from_pretrained` or `load_reward_model`.
"""
from __future__ import annotations

import os

import torch

from common.errors import UserError


def resolve_pretrain(path: str | None) -> str:
    """None means the built-in tiny model (built on first use, then cached)."""
    if path is None:
        from common.tiny import tiny_model_path

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


def attn_implementation(flash_attn: bool) -> tuple[str, str | None]:
    """(attn_implementation, note). flash-attention 2 needs its package and a GPU."""
    if not flash_attn:
        return "sdpa", None
    try:
        import flash_attn  # noqa: F401

        if torch.cuda.is_available():
            return "flash_attention_2", None
    except ImportError:
        pass
    return "sdpa", "--flash_attn: flash-attention is not available here; using PyTorch SDPA attention"


def load_tokenizer(path: str, *, padding_side: str = "right"):
    from transformers import AutoTokenizer

    _check_folder(path, "tokenizer")
    tok = AutoTokenizer.from_pretrained(path)
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
        raise UserError(f"{what} {path}: could not be loaded ({str(e).splitlines()[0]})") from e


def load_causal_lm(path: str, *, dtype=torch.float32, attn_impl: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = _load(AutoModelForCausalLM, path, "model", dtype=dtype, attn_impl=attn_impl)
    model.config.use_cache = False
    return model


def load_reward_model(path: str, *, dtype=torch.float32, attn_impl: str = "sdpa", pad_token_id: int | None = None):
    """A scalar-head model. From an LM folder the head is new (seeded by the caller's torch seed)."""
    from transformers import AutoModelForSequenceClassification

    model = _load(AutoModelForSequenceClassification, path, "reward model", dtype=dtype,
                  attn_impl=attn_impl, num_labels=1)
    if pad_token_id is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    model.config.use_cache = False
    if not hasattr(model, "score"):
        raise UserError(f"reward model {path}: architecture {type(model).__name__} has no `score` head")
    return model


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
    separate kernels. The embedding, the head and the log-probs stay outside (common.logprobs fuses
    those)."""
    compile_in_process()
    blocks = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for m in blocks:
        m.compile()
    return len(blocks)


def token_values(model, **inputs) -> torch.Tensor:
    """The scalar head on every position: model inputs (input_ids [B, T] with attention_mask, or packed
    rows with position_ids) -> [B, T] fp32."""
    module = getattr(model, "module", model)
    hidden = module.base_model(**inputs).last_hidden_state
    return module.score(hidden).squeeze(-1).float()


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token, for right-padded rows. [B, T] -> [B]."""
    T = attention_mask.shape[1]
    pos = torch.arange(T, device=attention_mask.device).expand_as(attention_mask)
    return (pos * attention_mask.long()).argmax(dim=1)


def reward_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The reward of each (right-padded) sequence: the head at its last real token. -> [B] fp32."""
    values = token_values(model, input_ids=input_ids, attention_mask=attention_mask)
    return values.gather(1, last_token_index(attention_mask)[:, None]).squeeze(1)
