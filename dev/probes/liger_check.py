"""GPU check of --use_liger_kernel: the liger-patched tiny policy gives the same log-probs and gradients
as the plain one, padded and packed (run on the GPU machine with liger-kernel installed; docs/openrlhf.md)."""
import torch
from transformers import AutoModelForCausalLM

from common.training.liger import apply_liger
from common.algo.packing import next_token_logprobs
from common.training.tiny import tiny_model_path

path, dev = tiny_model_path(), torch.device("cuda")
torch.manual_seed(0)
m0 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(dev)
m1 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(dev)
print("note:", apply_liger(m1, dev))
print("norm:", type(m1.model.norm).__name__, "mlp:", type(m1.model.layers[0].mlp).__name__,
      "forward:", m1.forward.__func__.__module__ if hasattr(m1.forward, "__func__") else m1.forward)
V = m0.config.vocab_size
ids = torch.randint(5, V, (4, 40), device=dev)
mask = torch.ones_like(ids)
mask[1, 25:] = 0
mask[3, 10:] = 0
valid = mask[:, 1:].bool()
for packing in (False, True):
    out = []
    for m in (m0, m1):
        m.zero_grad()
        lp = next_token_logprobs(m, ids, mask, packing=packing)
        (lp * valid).sum().backward()
        g = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        out.append((lp.detach(), g))
    d_lp = ((out[0][0] - out[1][0]).abs() * valid).max().item()
    d_g = (out[0][1] - out[1][1]).abs().max().item() / out[0][1].abs().max().item()
    print(f"packing={packing}: max |dlogp| {d_lp:.2e}, max rel grad diff {d_g:.2e}")
print("torch", torch.__version__, "transformers", __import__("transformers").__version__)
