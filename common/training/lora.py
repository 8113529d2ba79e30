"""LoRA and QLoRA (OpenRLHF's --lora_rank, --lora_alpha, --target_modules, --lora_dropout, --load_in_4bit) through
peft, as transformers' own adapter integration: the model stays its transformers class with LoRA layers
inside it, so every script's forward, chunked head and value head work unchanged, and

- the reference is the same model with its adapter switched off (`adapter_disabled`): no second copy;
- a reward model's or critic's value head trains in full beside the adapter (peft's modules_to_save)
  and is saved with it;
- saving writes the adapter in peft's format (`PeftModel.from_pretrained(base, folder)` loads it), and
  `python -m common.training.lora` merges it into its base for serving (OpenRLHF's LoRA combiner);
- the weight sync sends only the adapter (`adapter_state`): under ZeRO-3 only adapter parameters are gathered.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import torch

from common.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 0  # 0: no adapter, every weight trains
    alpha: int = 16
    target_modules: tuple[str, ...] = ("all-linear",)
    dropout: float = 0.0
    load_in_4bit: bool = False

    @classmethod
    def from_options(cls, a) -> LoraSettings:
        """A script's --lora_* flags (`a`: flag names to values); --target_modules None is peft's all-linear."""
        targets = a.get("target_modules") or ["all-linear"]
        return cls(rank=a.get("lora_rank") or 0, alpha=a.get("lora_alpha", 16), target_modules=tuple(targets),
                   dropout=a.get("lora_dropout") or 0.0, load_in_4bit=bool(a.get("load_in_4bit")))

    @property
    def on(self) -> bool:
        return self.rank > 0

    def describe(self) -> str:
        where = "all linear layers" if self.target_modules == ("all-linear",) else " ".join(self.target_modules)
        return (f"rank {self.rank}, alpha {self.alpha}, dropout {self.dropout:g}, on {where}"
                f"{', the base in 4-bit NF4' if self.load_in_4bit else ''}")


def quantization(s: LoraSettings, device: torch.device) -> dict:
    """from_pretrained's extra arguments for --load_in_4bit (NF4, double quantisation, bf16 compute, as
    OpenRLHF and QLoRA): refused where bitsandbytes cannot run, naming why."""
    if not s.load_in_4bit:
        return {}
    if not s.on:
        raise UserError("--load_in_4bit quantises the frozen base under a LoRA adapter: add --lora_rank (e.g. 16)")
    if device.type != "cuda":
        raise UserError("--load_in_4bit: bitsandbytes' 4-bit layers run on CUDA GPUs only; this run is on "
                        f"{device.type}: drop --load_in_4bit (LoRA alone trains here)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("--load_in_4bit needs the bitsandbytes package: pip install bitsandbytes") from None
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_use_double_quant=True,
                                                      bnb_4bit_compute_dtype=torch.bfloat16)}


def linear_names(model) -> list[str]:
    """The last name part of every linear layer of `model` (what --target_modules matches), sorted."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n})


def apply_lora(model, s: LoraSettings, *, head: str | None = None) -> str:
    """Put a fresh LoRA adapter into `model` in place (its base weights frozen); returns the banner's note.

    head: a reward model's or critic's value head attribute ("score"), trained in full and saved with the
    adapter. A --target_modules name that matches no layer is refused, naming the ones that exist."""
    from peft import LoraConfig

    targets = list(s.target_modules)
    if targets != ["all-linear"]:
        names = linear_names(model)
        missing = [t for t in targets if t not in names and not any(n.endswith(t) for n in names)]
        if missing:
            raise UserError(f"--target_modules {' '.join(missing)}: no such layer in this model; its linear "
                            f"layers are {' '.join(n for n in names if n != head)} (or all-linear, the default)")
    config = LoraConfig(r=s.rank, lora_alpha=s.alpha, lora_dropout=s.dropout, bias="none",
                        target_modules="all-linear" if targets == ["all-linear"] else targets,
                        exclude_modules=[head] if head else None, modules_to_save=[head] if head else None,
                        task_type="SEQ_CLS" if head else "CAUSAL_LM")
    model.add_adapter(config)
    if getattr(model, "is_gradient_checkpointing", False) or getattr(model, "hf_quantizer", None) is not None:
        model.enable_input_require_grads()  # a frozen embedding's output must still carry a graph into the adapter
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    return (f"LoRA {s.describe()}{' plus the value head in full' if head else ''}: {trained:,} of {total:,} "
            "parameters train")


def has_adapter(model) -> bool:
    return bool(getattr(_module(model), "_hf_peft_config_loaded", False))


def _module(model):
    return getattr(model, "module", model)  # a DeepSpeed engine's model


@contextlib.contextmanager
def adapter_disabled(model):
    """The base model alone inside the block: the reference of DPO and of the RL KL, with no second copy."""
    module = _module(model)
    module.disable_adapters()
    try:
        yield
    finally:
        module.enable_adapters()


def adapter_state(model, *, gather: bool = True) -> dict[str, torch.Tensor]:
    """The adapter's tensors (and a trained value head's) under the names of peft's saved adapters
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": [r, in]), on CPU, on every rank.

    Only the adapter's parameters are gathered under ZeRO-3 (collective: every rank calls it), so a sync
    or a save moves the adapter's bytes, not the model's. They are gathered together, in one collective:
    one per tensor (2 x 7 per layer with all-linear targets) made the 7B adapter's gather 0.54-0.59 s on an
    H200 for 80 MB."""
    import deepspeed
    from peft import get_peft_model_state_dict

    module = _module(model)
    own = {n: p for n, p in module.named_parameters() if "lora_" in n or "modules_to_save" in n}
    sharded = [p for p in own.values() if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(sharded, modifier_rank=None, enabled=gather and bool(sharded)):
        out = {name: p.detach().to("cpu", copy=True) for name, p in own.items()}
    # peft's saved names sit under its wrapper's prefix (what PeftModel.from_pretrained and vLLM read)
    return {f"base_model.model.{k}": v for k, v in get_peft_model_state_dict(module, state_dict=out).items()}


def adapter_config(model) -> dict:
    """The adapter's LoraConfig as a dict (what vLLM and peft read)."""
    config = _module(model).peft_config["default"].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def save_adapter(model, tokenizer, path: str, rank: int) -> None:
    """The adapter (and a trained value head) in peft's format, loadable with `PeftModel.from_pretrained` on
    its base, whose path the adapter's config records. Collective: every rank calls it."""
    from safetensors.torch import save_file

    state = adapter_state(model)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "adapter_model.safetensors"))
        config = dict(adapter_config(model), base_model_name_or_path=_module(model).name_or_path)
        with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2, default=str)
        # config.json: the base's, so that what reads a model's shape (the memory plan, --dry_run) reads the
        # base's; the run's options (the logger's "hybridrl" key) stay
        cfg_path = os.path.join(path, "config.json")
        run = json.load(open(cfg_path)).get("hybridrl") if os.path.exists(cfg_path) else None
        model_cfg = _module(model).config.to_dict()
        with open(cfg_path, "w") as f:
            json.dump(model_cfg | ({"hybridrl": run} if run is not None else {}), f, indent=2, default=str)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def adapter_base(path: str) -> str | None:
    """The base model of a saved adapter folder (its adapter_config.json), None when `path` is not one."""
    cfg = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg):
        return None
    with open(cfg) as f:
        return json.load(f).get("base_model_name_or_path")


def merge(lora_path: str, output_path: str, *, model_path: str | None = None, is_rm: bool = False,
          dtype: torch.dtype = torch.float32) -> str:
    """Merge the adapter at `lora_path` into its base (`model_path`, default: the base recorded in the
    adapter) and save a plain transformers model at `output_path`, a reward model's head included."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    base = model_path or adapter_base(lora_path)
    if base is None:
        raise UserError(f"--lora_path {lora_path}: no {ADAPTER_CONFIG} here; give the folder a LoRA run saved")
    if is_rm:
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    merged = PeftModel.from_pretrained(model, lora_path).merge_and_unload()
    merged.save_pretrained(output_path, safe_serialization=True)
    AutoTokenizer.from_pretrained(lora_path if os.path.exists(os.path.join(lora_path, "tokenizer_config.json"))
                                  else base).save_pretrained(output_path)
    return output_path


if __name__ == "__main__":  # OpenRLHF's LoRA combiner, its flags: python -m common.training.lora --lora_path ...
    import argparse

    from common.errors import exit_on_user_error

    p = argparse.ArgumentParser(prog="python -m common.training.lora",
                                description="Merge a saved LoRA adapter into its base model for serving.")
    p.add_argument("--model_path", default=None, help="the base model (default: the one the adapter records)")
    p.add_argument("--lora_path", required=True, help="the adapter folder a --lora_rank run saved")
    p.add_argument("--output_path", required=True, help="where the merged model goes")
    p.add_argument("--is_rm", action="store_true", help="a reward model (or critic): its value head is kept")
    p.add_argument("--bf16", action="store_true", help="save the merged weights in bf16")
    args = p.parse_args()
    with exit_on_user_error():
        print(merge(args.lora_path, args.output_path, model_path=args.model_path, is_rm=args.is_rm,
                    dtype=torch.bfloat16 if args.bf16 else torch.float32))
