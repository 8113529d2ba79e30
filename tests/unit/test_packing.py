"""--packing_samples: packed rows give the same log-probs, values and loss as padded rows."""
from __future__ import annotations

import torch

from common.algo.logprobs import token_logprobs
from common.algo.losses import policy_loss
from common.algo.packing import pack


def _batch(lengths, vocab=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), 3)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


def test_packed_logprobs_and_policy_loss_equal_padded():
    from transformers import AutoModelForCausalLM

    from common.training.tiny import tiny_model_path

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), attn_implementation="sdpa").eval()
    ids, mask = _batch([9, 4, 12, 2])
    with torch.no_grad():
        padded = token_logprobs(model(input_ids=ids, attention_mask=mask).logits[:, :-1], ids[:, 1:])
        p = pack(ids, mask)
        out = model(**p.model_inputs()).logits[:, :-1]
        packed = p.unpack_next_token(token_logprobs(out, p.input_ids[:, 1:]))
    valid = mask[:, 1:].float()
    assert torch.allclose(packed * valid, padded * valid, atol=1e-5)
    assert (packed[valid == 0] == 0).all()
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(padded.shape, generator=g) * valid
    old = padded + 0.05 * torch.randn(padded.shape, generator=g)
    a = policy_loss(padded, old, adv, valid, 0.2, 0.2)[0]
    b = policy_loss(packed, old, adv, valid, 0.2, 0.2)[0]
    assert torch.allclose(a, b, atol=1e-6)


def test_packed_values_equal_padded():
    from transformers import AutoModelForSequenceClassification

    from common.training.tiny import tiny_model_path

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1).eval()
    ids, mask = _batch([6, 11, 3], seed=2)
    with torch.no_grad():
        padded = model.score(model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state).squeeze(-1)[:, :-1]
        p = pack(ids, mask)
        packed = p.unpack_next_token(model.score(model.base_model(**p.model_inputs()).last_hidden_state).squeeze(-1))
    valid = mask[:, 1:].float()
    assert torch.allclose(packed * valid, padded * valid, atol=1e-5)


def test_pack_layout():
    ids, mask = _batch([3, 1, 2])
    p = pack(ids, mask, flash=True)
    assert p.input_ids.shape == (1, 6) and p.attention_mask is None
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert p.starts.tolist() == [0, 3, 4]


def test_packing_only_where_a_kernel_skips_the_mask():
    """A GPU without flash-attention keeps rows padded (SDPA would attend over the whole packed row)."""
    from common.algo.packing import packs_here

    assert packs_here("flash_attention_2", "cuda") and packs_here("sdpa", "cpu")
    assert not packs_here("sdpa", "cuda") and not packs_here("eager", "cuda")
