"""Sequence packing: run several right-padded rows as one row without padding.

The rows' real tokens are laid end to end, positions restart at 0 for each, and attention is kept
inside each sequence: flash-attention does that from the position ids alone; other attention
implementations (SDPA on CPU) get an explicit block-diagonal causal mask. Results come back in
the padded layout, so losses are computed exactly as without packing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor          # [1, L]
    position_ids: torch.Tensor       # [1, L]
    attention_mask: torch.Tensor | None  # [1, 1, L, L] bool, or None for flash-attention
    starts: torch.Tensor             # [b] offset of each row in the packed row
    lengths: torch.Tensor            # [b]
    width: int                       # t, the padded width

    def model_inputs(self) -> dict:
        out = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        return out

    def unpack_next_token(self, x: torch.Tensor) -> torch.Tensor:
        """Per-position values about the NEXT token, [1, L-1] or [1, L] (e.g. log-probs of logits[:, :-1],
        critic values) -> the padded layout [b, t-1]; zeros where a row has no next token."""
        flat = torch.nn.functional.pad(x[0], (0, self.input_ids.shape[1] - x.shape[1]))
        cols = torch.arange(self.width - 1, device=x.device)
        idx = (self.starts[:, None] + cols[None, :]).clamp(max=flat.shape[0] - 1)
        valid = cols[None, :] < (self.lengths[:, None] - 1)
        return torch.where(valid, flat[idx], torch.zeros((), dtype=flat.dtype, device=flat.device))


def packs_here(attn: str, device_type: str) -> bool:
    """Whether --packing_samples packs with this attention on this device. SDPA has no variable-length
    kernel: a packed micro-batch of b rows is one row of b x t tokens under a block-diagonal mask, whose
    attention costs b times the padded rows' (on an H200 it made the 3B reference flags' training phase
    slower, dev/LOG.md); so on a GPU without flash-attention the rows stay padded (same results).
    On CPU packing stays on: the tests run its path there, and no kernel skips padding either."""
    return attn == "flash_attention_2" or device_type != "cuda"


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, flash: bool = False) -> Packed:
    """input_ids, attention_mask: [b, t], right-padded."""
    keep = attention_mask.bool()
    lengths = keep.sum(1)
    starts = torch.cumsum(lengths, 0) - lengths
    ids = input_ids[keep][None]
    L = ids.shape[1]
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths)
    pos = torch.arange(L, device=ids.device) - starts[seg]
    mask = None
    if not flash:
        causal = torch.ones(L, L, dtype=torch.bool, device=ids.device).tril()
        mask = (causal & (seg[:, None] == seg[None, :]))[None, None]
    return Packed(ids, pos[None], mask, starts, lengths, input_ids.shape[1])


# ---- preference pairs (train_rm.py, train_dpo.py): chosen and rejected rows packed into one ----------

def sequence_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, packing: bool,
                     flash: bool = False) -> torch.Tensor:
    """The scalar head at each right-padded row's last real token: [b, t] -> [b] fp32, with or without packing."""
    from common.training.models import reward_scores, token_values

    if not packing:
        return reward_scores(model, input_ids, attention_mask)
    p = pack(input_ids, attention_mask, flash=flash)
    values = token_values(model, **p.model_inputs())  # [1, L]
    return values[0, p.starts + p.lengths - 1]


def next_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, packing: bool,
                        flash: bool = False) -> torch.Tensor:
    """log pi(input_ids[:, 1:]) of right-padded rows: [b, t] -> [b, t-1] (zeros past a row's end when packed)."""
    from common.algo.logprobs import token_logprobs

    if not packing:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return token_logprobs(logits[:, :-1], input_ids[:, 1:])
    p = pack(input_ids, attention_mask, flash=flash)
    logits = model(**p.model_inputs()).logits  # [1, L, V]: no padding positions at all
    return p.unpack_next_token(token_logprobs(logits[:, :-1], p.input_ids[:, 1:]))
