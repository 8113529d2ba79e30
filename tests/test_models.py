"""Model folders: what cannot load stops with one message naming the folder."""
from __future__ import annotations


def test_model_folders_that_cannot_work_get_one_message(tmp_path):
    """Bad model folders (issue 6): a folder without config.json, a file, a tokenizer without pad
    and eos tokens. A tokenizer with eos but no pad borrows eos (padding is masked out)."""
    import os
    import shutil

    import pytest

    from common.errors import UserError
    from common.models import load_causal_lm, load_tokenizer
    from common.tiny import tiny_model_path

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"empty: no config.json in this folder"):
        load_causal_lm(str(empty))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UserError, match=r"weights.bin: a file, not a model folder"):
        load_tokenizer(str(tmp_path / "weights.bin"))

    from transformers import AutoTokenizer

    for name, drop in (("no_pad", ("pad_token",)), ("no_pad_no_eos", ("pad_token", "eos_token"))):
        t = AutoTokenizer.from_pretrained(tiny_model_path())
        for attr in drop:
            setattr(t, attr, None)
        t.save_pretrained(str(tmp_path / name))
        shutil.copy(os.path.join(tiny_model_path(), "config.json"), tmp_path / name)  # a model folder
    tok = load_tokenizer(str(tmp_path / "no_pad"))
    assert tok.pad_token_id == tok.eos_token_id is not None
    with pytest.raises(UserError, match=r"neither a pad nor an eos token; add a pad token"):
        load_tokenizer(str(tmp_path / "no_pad_no_eos"))


PRECISION = r"""
import json, torch
from common import ds
from common.models import compile_layers, load_causal_lm
from common.tiny import tiny_model_path
dist = ds.setup_distributed()
torch.manual_seed(0)
ids = torch.randint(5, 200, (4, 12))
out = {}
for mode in ("master", "autocast"):
    model = load_causal_lm(tiny_model_path())
    ref = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    s = ds.DSSettings(zero_stage=2, bf16=True, autocast=mode == "autocast", micro_train_batch_size=4, train_batch_size=4)
    engine = ds.initialize(model, s, dist, torch.bfloat16, lr=1e-2, total_steps=10, scheduler="constant")
    logits = engine(input_ids=ids).logits
    engine.backward(logits.float().logsumexp(-1).mean())
    engine.step()
    w = engine.module.model.layers[0].mlp.down_proj.weight
    out[mode] = {"weights": str(w.dtype), "logits": str(logits.dtype), "moved": (w.float() - ref).abs().max().item()}
# regional compilation: every block compiled, same outputs as eager
model = load_causal_lm(tiny_model_path()).eval()
with torch.no_grad():
    eager = model(input_ids=ids).logits
    out["blocks"] = compile_layers(model)
    out["compiled_diff"] = (model(input_ids=ids).logits - eager).abs().max().item()
import torch._inductor.config as inductor
out["compile_threads"] = inductor.compile_threads
print("RESULT", json.dumps(out))
"""


def test_torch_autocast_keeps_fp32_weights_and_compiled_blocks_match_eager():
    """--torch_autocast: DeepSpeed keeps fp32 weights and runs the forward in bf16 (bf16 logits), and
    the update reaches the weights; DeepSpeed's bf16 mode (the default) holds bf16 weights instead.
    --torch_compile compiles each transformer block, which computes what eager mode does."""
    import json

    from tests.helpers import PY, run

    p = run([PY, "-c", PRECISION])
    res = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert res["autocast"]["weights"] == "torch.float32" and res["autocast"]["logits"] == "torch.bfloat16", res
    assert res["master"]["weights"] == "torch.bfloat16", res
    assert res["autocast"]["moved"] > 1e-4 and res["master"]["moved"] > 1e-4, res
    assert res["blocks"] >= 2 and res["compiled_diff"] < 1e-4, res
    # compiled in the worker's own process: no pool of compile workers left beside the engines
    assert res["compile_threads"] == 1, res
