"""The weight-sync protocol's pieces that need no engine: bucket plans, packing, and which transport
a placement may use (the transports themselves run against vLLM in test_vllm.py)."""
from __future__ import annotations

import pytest
import torch

from common.errors import UserError
from common.rollout.weight_sync import choose_transport, pack, plan_buckets, unpack


def test_buckets_cover_every_parameter_once_in_order_and_round_trip():
    torch.manual_seed(0)
    named = {"embed": torch.randn(10, 4), "a.w": torch.randn(3, 3), "a.b": torch.randn(3), "big": torch.randn(40, 10),
             "head": torch.randn(2)}
    buckets = plan_buckets([(n, tuple(t.shape)) for n, t in named.items()], bucket_mb=60 * 2 / 2**20, dtype=torch.bfloat16)
    # 60 bf16 elements a bucket: embed (40) + a.w (9) + a.b (3) fit; big (400) alone; head after it
    assert [b.names for b in buckets] == [("embed", "a.w", "a.b"), ("big",), ("head",)]
    assert [b.numel for b in buckets] == [52, 400, 2] and {b.dtype for b in buckets} == {"bfloat16"}
    got = {}
    for b in buckets:
        flat = pack([named[n] for n in b.names], torch.bfloat16, "cpu")
        assert flat.shape == (b.numel,) and flat.dtype == torch.bfloat16
        got.update(unpack(flat, b))
    assert list(got) == list(named)
    for n, t in named.items():
        assert torch.equal(got[n], t.to(torch.bfloat16)), n


@pytest.mark.parametrize("requested,gpu,colocated,expected", [
    ("auto", False, False, "gloo"), ("auto", True, True, "cuda_ipc"), ("auto", True, False, "nccl"),
    ("ray", True, True, "ray"), ("gloo", True, False, "gloo"), ("nccl", True, False, "nccl"),
])
def test_transport_choice(requested, gpu, colocated, expected):
    assert choose_transport(requested, use_gpu=gpu, colocated=colocated) == expected


@pytest.mark.parametrize("requested,gpu,colocated,says", [
    ("nccl", False, False, "needs GPUs; on CPU use gloo, ray or auto"),
    ("cuda_ipc", True, False, "needs the engines on the actor's GPUs (--colocate_all_models); use nccl or auto"),
    ("nccl", True, True, "NCCL cannot connect them; use cuda_ipc or auto"),
    ("shm", False, False, "choose one of auto, cuda_ipc, nccl, gloo, ray"),
])
def test_transport_refusals_name_the_flag_and_the_fix(requested, gpu, colocated, says):
    with pytest.raises(UserError, match="--vllm_sync_backend " + requested) as e:
        choose_transport(requested, use_gpu=gpu, colocated=colocated)
    assert says in str(e.value)
