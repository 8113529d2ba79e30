"""Resumable checkpoints that survive being killed mid-save.

Layout under the checkpoint folder:
    step00000040/            one complete checkpoint (renamed into place only when complete)
        manifest.json        step, roles, world size, time: written last, before the rename
        state.json           the script's client state (data position, counters, KL controller...)
        rng_rank{r}.pt       Python / NumPy / torch RNG state of rank r (tensors + strings only)
        <role>/...           DeepSpeed `save_checkpoint` output of each engine (model, optimizer, scheduler)
    .tmp-step00000050/       a save in progress (ignored, and cleared by the next save)

A checkpoint counts only when its folder has a manifest; rotation (`max_keep`) deletes the oldest
complete ones and never the one just written, so a crash during a save leaves the previous one usable.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time

import numpy as np
import torch

_STEP = re.compile(r"^step(\d{8})$")


def _barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": json.dumps(random.getstate()),
        "numpy": json.dumps([np_state[0], np_state[1].tolist(), *np_state[2:]]),
        "torch": torch.get_rng_state(),
        **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}),
    }


def set_rng_state(state: dict) -> None:
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, *rest = json.loads(state["numpy"])
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoints, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        if _STEP.match(name) and os.path.exists(os.path.join(root, name, "manifest.json")):
            found.append(name)
    return [os.path.join(root, n) for n in sorted(found)]


def latest_checkpoint(root: str) -> str | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(root: str, step: int, engines: dict, client_state: dict, *, rank: int,
                    max_keep: int = 3, hf_tokenizer=None) -> str:
    """Collective: every rank calls it with its engines ({role: DeepSpeed engine}). With `hf_tokenizer`
    (OpenRLHF's --save_hf_ckpt) each role also gets a Hugging Face copy in <checkpoint>/<role>/hf."""
    tag = f"step{step:08d}"
    final, tmp = os.path.join(root, tag), os.path.join(root, f".tmp-{tag}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of a save that was killed
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    for role, engine in engines.items():
        engine.save_checkpoint(os.path.join(tmp, role), tag="ds", save_latest=False)
        if hf_tokenizer is not None:
            from common.training.ds import save_hf

            save_hf(engine, hf_tokenizer, os.path.join(tmp, role, "hf"), rank)
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump(client_state, f)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        manifest = {"step": step, "roles": sorted(engines), "world_size": world, "time": time.time()}
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-max_keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str, engines: dict, *, rank: int) -> dict:
    """Restore engines, this rank's RNG, and return the client state. Collective."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if manifest["world_size"] != world:
        from common.errors import UserError

        raise UserError(f"checkpoint {path} was written by {manifest['world_size']} ranks; this run has {world}. "
                        "Resume with the same number of processes.")
    for role, engine in engines.items():
        load_path, _ = engine.load_checkpoint(os.path.join(path, role), tag="ds")
        if load_path is None:
            raise RuntimeError(f"checkpoint {path}: DeepSpeed found nothing to load for {role}")
    set_rng_state(torch.load(os.path.join(path, f"rng_rank{rank}.pt"), weights_only=True))
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)


class Preemption:
    """SIGTERM (Slurm preemption, `scontrol requeue`, a cluster scheduler) asks for a checkpoint and a
    clean exit at the end of the current step, so a requeued job resumes instead of starting over.

    A first Ctrl-C (SIGINT) does the same, so work since the last checkpoint is not lost; a second one
    stops at once (KeyboardInterrupt), for a step that would take too long. Each says so on stderr.
    """

    def __init__(self):
        import signal

        self._asked = False
        self._why = "SIGTERM"
        self._first_ctrl_c = None
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._ctrl_c)

    def _handle(self, signum, frame):
        self._asked = True

    def _ctrl_c(self, signum, frame):
        import signal

        now = time.monotonic()
        if self._first_ctrl_c is None:
            self._first_ctrl_c, self._asked, self._why = now, True, "Ctrl-C"
            _say("Ctrl-C: finishing this step, then saving a checkpoint and stopping; press Ctrl-C again to stop "
                 "now (without saving)")
            return
        if now - self._first_ctrl_c < 1.0:  # the same press, passed on by a launcher (torchrun forwards SIGINT)
            return
        _say("Ctrl-C again: stopping now; nothing since the last checkpoint is saved")
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        raise KeyboardInterrupt

    def mark_stopped(self) -> None:
        """Say that the run stopped early for the signal. A stop for SIGTERM exits 143, as does a driver that
        SIGTERM killed before it could save, so a launcher that must tell them apart (slurm/ray_cluster.sh
        requeues only a job that saved) names a file in HYBRIDRL_STOPPED_FILE, which this creates."""
        path = os.environ.get("HYBRIDRL_STOPPED_FILE")
        if path:
            with open(path, "w") as f:
                f.write("stopped\n")

    def reason(self) -> str:
        """What asked for the stop, for the driver's last line."""
        return getattr(self, "_why", "SIGTERM")

    def stopped(self) -> Exception:
        """What the script raises once the stop's checkpoint is saved and its last lines are out: the process
        then exits 143 (SIGTERM) or 130 (Ctrl-C), not 0, since training did not finish (common.errors.Stopped)."""
        import signal

        from common.errors import Stopped

        return Stopped(signal.SIGINT if self.reason() == "Ctrl-C" else signal.SIGTERM)

    def requested(self) -> bool:
        """The same answer on every rank (one rank may have seen the signal a step earlier)."""
        flag = torch.tensor([float(self._asked)])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            backend = torch.distributed.get_backend()
            flag = flag.cuda() if backend == "nccl" else flag
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)


def _say(message: str) -> None:
    """From a signal handler, on the driver only (rank 0; a Ray driver has no RANK)."""
    if os.environ.get("RANK", "0") != "0":
        return
    try:
        print(message, file=sys.stderr, flush=True)  # rich's live bar (if any) redirects stderr above itself
    except RuntimeError:  # the signal landed inside another write to stderr
        os.write(2, (message + "\n").encode())
