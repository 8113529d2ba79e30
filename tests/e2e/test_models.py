"""Model folders: what cannot load stops with one message naming the folder."""
from __future__ import annotations


PRECISION = r"""
import json, torch
from common.training import ds
from common.training.models import compile_layers, load_causal_lm
from common.training.tiny import tiny_model_path
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


WEIGHT_CASTS = r"""
import gc, json, weakref, torch
from torch.utils._python_dispatch import TorchDispatchMode
import common.training.ds as ds
from common.training.tiny import tiny_model_path
from common.rl.workers import ModelSpec, ModelWorker

ds.resolve_dtype = lambda bf16, device: (torch.bfloat16, None)  # bf16 as on a GPU (this CPU would train in fp32)
w = object.__new__(ModelWorker)
w.role = "actor"
s = ds.DSSettings(zero_stage=0, bf16=True, autocast=True, gradient_checkpointing=True, micro_train_batch_size=4,
                  train_batch_size=4)
w.setup(ModelSpec(tiny_model_path(), "causal_lm", True, s, bf16=True, head_chunk_tokens=0,
                  optim=dict(lr=0.0, total_steps=10, warmup_ratio=0.0, scheduler="constant_with_warmup")))
weights = {p.data_ptr() for p in w.model.module.parameters() if p.dim() == 2}


class Casts(TorchDispatchMode):
    # weak references to the bf16 copies that autocast makes of the model's fp32 weight matrices
    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16 and args[0].data_ptr() in weights:
            self.refs.append(weakref.ref(out))
        return out


seen, out = {}, {}
torch.manual_seed(0)
micro = {"input_ids": torch.randint(5, 200, (4, 12)), "attention_mask": torch.ones(4, 12, dtype=torch.long)}
w.model.train()
ours = w.model.forward  # common.training.ds: the engine's forward without autocast's weight cache
for name, forward in (("worker", ours), ("autocast_cache", ours.__wrapped__)):
    w.model.forward = forward
    for grad in (True, False):
        casts = Casts()

        def at_last_norm(*_):  # the forward's end: every layer has run, the head not yet
            gc.collect()
            seen.update(alive=sum(r() is not None for r in casts.refs), cast=len(casts.refs))

        hook = w.model.module.model.norm.register_forward_hook(at_last_norm)
        with casts, torch.set_grad_enabled(grad):
            lp, _ = w._token_logprobs(micro)
            if grad:
                w.model.backward(lp.float().sum())
        hook.remove()
        out[f"{name}/{'train' if grad else 'no_grad'}"] = dict(seen)
print("RESULT", json.dumps(out))
"""


def test_forwards_under_autocast_keep_no_bf16_copy_of_the_weights():
    """--torch_autocast keeps fp32 weights and casts each to bf16 for its matmul. torch.autocast caches those
    casts until the outermost autocast exits: with gradient checkpointing (nothing saved for backward) and in
    the no-grad log-prob passes, that cache alone held a bf16 copy of every weight matrix at the forward's end
    (2.4 GiB at 1.5B, 5.2 at 3B on an H200). Every trained engine's forward (common.training.ds, all scripts) runs without it: at the last layer's end no
    cast is alive, while the same forward with autocast's cache holds all of them."""
    import json

    from tests.helpers import PY, run

    p = run([PY, "-c", WEIGHT_CASTS])
    res = json.loads(p.stdout.split("RESULT ", 1)[1])
    n = res["worker/train"]["cast"]
    assert n >= 7 * 2, res  # 7 matrices a layer (q, k, v, o, gate, up, down), 2+ layers
    assert res["worker/train"] == res["worker/no_grad"] == {"alive": 0, "cast": n}, res
    assert res["autocast_cache/train"] == res["autocast_cache/no_grad"] == {"alive": n, "cast": n}, res
