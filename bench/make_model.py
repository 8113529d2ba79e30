"""Write a random-weight model of a real model's shape, with the built-in tokenizer, for GPU figures.

    python bench/make_model.py --shape 0.5b --out /tmp/q05            # causal LM, Qwen2.5-0.5B shape
    python bench/make_model.py --shape 0.5b --out /tmp/q05rm --reward # the same body with a scalar head
    python bench/make_model.py --shape 8b --out /tmp/l8b --config-only # config.json + tokenizer: --dry_run's memory plan

No download: the config is written here (Qwen2.5 0.5B / 1.5B / 3B / 7B dimensions; 8b: Llama-3-8B's), the weights are random
(seeded) and the tokenizer is the built-in tiny one (ids past its 512 tokens decode to nothing,
which is fine for timing: rewards then come from a reward model, not from text).
"""
from __future__ import annotations

import shutil

import typer

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, tie_word_embeddings=False),
    # Llama-3-8B's sizes (the reference commands' model) in Qwen2's architecture, which adds q/k/v biases
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, tie_word_embeddings=False, rope_theta=5e5),
}


def main(shape: str = "0.5b", out: str = "/tmp/q05", reward: bool = False, seed: int = 0, config_only: bool = False):
    """--config-only: config.json and the tokenizer, no weights (enough for --dry_run and the memory plan)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config

    from common.training.tiny import tiny_model_path

    tiny = tiny_model_path()
    tok = AutoTokenizer.from_pretrained(tiny)
    shape_kw = {"vocab_size": 151936, "tie_word_embeddings": True, **SHAPES[shape]}  # Qwen2.5's; 7B unties them
    cfg = Qwen2Config(max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **{"rope_theta": 1e6, **shape_kw})
    if config_only:
        if reward:
            cfg.num_labels, cfg.architectures = 1, ["Qwen2ForSequenceClassification"]
        else:
            cfg.architectures = ["Qwen2ForCausalLM"]
        cfg.save_pretrained(out)
        tok.save_pretrained(out)
        print(f"{out}: {shape} config only")
        return
    torch.manual_seed(seed)
    # On a GPU the random init takes seconds (7B: minutes on the CPU); the weights differ from a CPU build's
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        if reward:
            cfg.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.bfloat16)
        else:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    for name in ("generation_config.json",):
        if os.path.exists(os.path.join(tiny, name)) and not reward:
            shutil.copy(os.path.join(tiny, name), out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: {shape} {'reward' if reward else 'causal'} model, {n / 1e6:.1f} M parameters")


if __name__ == "__main__":
    typer.run(main)
