"""The process group every DeepSpeed program joins, and what the libraries print while it forms.

One process or many: `python train_rm.py` (a single rank; the rendezvous variables are set here),
`torchrun --nproc_per_node N train_rm.py` and `deepspeed train_rm.py` (which set them), or a Ray
actor (which sets them before calling `setup_distributed`). Without CUDA the backend is gloo.
"""
from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device



_hosted: list = []  # the rendezvous stores this process serves: alive as long as the process


def host_store(addr: str, timeout_s: float = 1800):
    """A TCPStore server on a port the kernel picks, held from this moment: (store, port).

    Taking a free port, closing it and letting torch bind it later (at `init_process_group`, after
    the model is read) leaves a window in which any outgoing connection on the host may be given
    that ephemeral port; with Ray's and vLLM's many sockets that happened in CI (EADDRINUSE). The
    other ranks, and this one through `setup_distributed`, connect to it as clients."""
    store = torch.distributed.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                                       multi_tenant=True, timeout=timedelta(seconds=timeout_s))
    _hosted.append(store)
    return store, store.port


def _no_overflow_line(record) -> bool:
    """DeepSpeed warns at each update it skips for non-finite gradients; our own log counts them in
    train/skipped_updates (or the run stops naming the step), so its line would only repeat that."""
    return "OVERFLOW! Skipping step" not in record.getMessage()


def quiet_libraries() -> None:
    """Only the driver prints: keep DeepSpeed's and transformers' own progress bars and info lines out."""
    import logging

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed warns that it fell back to CPU
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    ds_logger.addFilter(_no_overflow_line)  # added once however often this runs: the same function


def setup_distributed(timeout_s: float = 1800) -> DistInfo:
    """Join (or create) the process group. Idempotent."""
    quiet_libraries()
    import deepspeed

    # A plain `python script.py` has no launcher: make it a world of one.
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(host_store("127.0.0.1", timeout_s)[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not torch.distributed.is_initialized():
        if device.type == "cpu" and rank == 0 and not _shm_op_built():
            print("building DeepSpeed's shared-memory op (first run only: 1-2 min on 2 cores; kept in "
                  f"{os.environ.get('TORCH_EXTENSIONS_DIR', '~/.cache/torch_extensions')})", flush=True)
        # With a store this process already serves (host_store), torch's env:// rendezvous must join it
        # as a client, as under torchrun's agent, instead of binding MASTER_PORT a second time. Set
        # only for this call: vLLM's own tcp:// rendezvous, later in some of these processes, reads it too.
        served = any(store.port == int(os.environ["MASTER_PORT"]) for store in _hosted)
        agent = {"TORCHELASTIC_USE_AGENT_STORE": "True"} if served else {}
        # DeepSpeed prints "... shm_comm_op built successfully" at every start, built or cached: not news
        with contextlib.redirect_stdout(io.StringIO()), _env(agent):
            deepspeed.init_distributed(
                dist_backend="nccl" if device.type == "cuda" else "gloo",
                timeout=timedelta(seconds=timeout_s),
                verbose=False,
            )
    return DistInfo(rank, world, local_rank, device)


@contextlib.contextmanager
def _env(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _shm_op_built() -> bool:
    """Whether DeepSpeed's CPU shared-memory all-reduce op is already compiled in the extensions cache."""
    from torch.utils import cpp_extension

    try:
        return os.path.exists(os.path.join(cpp_extension._get_build_directory("deepspeed_shm_comm", verbose=False),
                                           "deepspeed_shm_comm.so"))
    except Exception:  # a private helper of torch's: never let it stop a run
        return True
