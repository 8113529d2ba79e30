"""A stand-in for the flash-attn package, for running OpenRLHF 0.11.2 as the bench's third row on a GPU
machine without a flash-attn build. OpenRLHF imports a few of its names when its modules load, but
calls them only for --packing_samples (which the bench does not pass); the bench gives OpenRLHF
--ds.attn_implementation sdpa when no real build is there (no `flash_attn_2_cuda`). Any call fails."""


def _missing(*_a, **_k):
    raise RuntimeError("flash-attn is not installed: this is the bench's import stand-in (dev/probes/flash_attn_stub)")
