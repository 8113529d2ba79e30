"""The memory plan of a script's options, checked before any model loads (docs/performance.md).

`preflight` is what the scripts call: it reads the models' config.json (no weights, no torch), shows
each process's predicted GPU memory per phase (generate, log-probs, train, sync) as a table, and
refuses (UserError) a layout that cannot fit this machine's GPU, naming the flags that would make it
fit, most saving first. No GPU visible (a dry run on a laptop): the table only. The arithmetic is
`common.cluster.memory_estimate`; `mem_metrics` puts the predicted peaks beside the
measured ones in each step's `mem/` metrics, so every GPU run checks the plan.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import replace

from common.algo import HEAD_CHUNK, PLAIN_HEAD
from common.cluster.resources import hosted_note, hosts
from common.errors import UserError
from common.cluster.memory_estimate import PHASES, GiB, Job, MemoryPlan, Model, _NoPlan, adapter_params, plan_memory, read_shape
from common.cluster.memory_estimate import Shape, training_states  # noqa: F401  (for the tests and callers)

# With no GPU visible (a dry run on a laptop) the plan is checked against an 80 GB GPU, what OpenRLHF's
# 8-GPU commands are documented on: a layout that will be refused there names its fixes before the job
# waits in a queue. 81559 MiB is an H100 80GB's total in nvidia-smi (an A100 80GB has 81920).
REFERENCE_GPU = 81559 * 2**20
REFERENCE_NAME = "80 GB GPU (A100/H100 80GB: 79.6 GiB, the size OpenRLHF's 8-GPU commands are documented on)"


def _job_from_options(a: dict, script: str, plan, world: int) -> Job:
    bf16 = bool(a.get("bf16"))
    flags = dict(zero_stage=a["zero_stage"], bf16=bf16, autocast=bf16 and bool(a.get("torch_autocast")),
                 adam_offload=a["adam_offload"], checkpointing=a["gradient_checkpointing"],
                 flash=bool(a.get("flash_attn")) and importlib.util.find_spec("flash_attn") is not None,
                 packing=bool(a.get("packing_samples")))
    rank, targets = a.get("lora_rank") or 0, tuple(a.get("target_modules") or ("all-linear",))

    def lora(shape) -> dict:  # a trained model's LoRA fields (common.cluster.memory_estimate.Model)
        return dict(adapter=adapter_params(shape, rank, targets), bits4=bool(a.get("load_in_4bit"))) if rank else {}

    if script in ("dpo", "rm"):  # one process per GPU: each micro-batch holds chosen and rejected rows
        more = f"{2 * world} GPUs (torchrun --nproc_per_node {2 * world}, or more nodes)"
        rows = 2 * a["micro_train_batch_size"]
        if script == "rm":
            shape = read_shape(a["pretrain"], True)
            models = (Model("reward model", shape, True, False, world, "rank", "reward model", more, **lora(shape)),)
        elif rank:  # LoRA: the reference is the policy with its adapter off, no second copy
            shape = read_shape(a["pretrain"])
            models = (Model("policy", shape, True, True, world, "rank", "policy", more, **lora(shape)),)
        else:
            ref = read_shape(a.get("ref_pretrain") or a["pretrain"])
            both = "policy + reference"  # one process
            models = (Model("policy", read_shape(a["pretrain"]), True, True, world, "rank", both, more),
                      Model("reference", ref, False, True, world, "rank", both))
        return Job(models, seq=a["max_len"], train_rows=rows, infer_rows=rows, step_rows=rows * world, rows_per_item=2,
                   ref_offload=bool(a.get("ref_offload")), offload_flag="--ref_offload",
                   phases=("logprobs", "train") if script == "dpo" else ("train",), **flags)
    paths = {"actor": a["pretrain"], "ref": a["pretrain"], "reward": a.get("reward_pretrain"),
             "critic": a.get("critic_pretrain") or a.get("reward_pretrain") or a["pretrain"]}
    hosted = hosts(plan)  # a frozen role in a trained role's processes shares their allocator and context
    shapes = {r.role: read_shape(paths[r.role], r.role in ("critic", "reward")) for r in plan.roles}
    models = tuple(Model(r.role, shapes[r.role], r.role in ("actor", "critic"), r.role in ("actor", "ref"), r.workers,
                         r.group, hosted.get(r.role, r.role), f"--{r.role}_num_gpus_per_node {2 * r.gpus_per_node}",
                         **(lora(shapes[r.role]) if r.role in ("actor", "critic") else {}))
                   for r in plan.roles)
    n, engines = a["n_samples_per_prompt"], plan.vllm_engines
    actor = models[0].shape
    return Job(models, seq=a["prompt_max_len"] + a["generate_max_len"], train_rows=a["micro_train_batch_size"],
               infer_rows=a["micro_rollout_batch_size"], step_rows=a["rollout_batch_size"] * n,
               gen_rows=0 if engines else max(1, a["micro_rollout_batch_size"] // n) * n,
               ds_sleep=bool(a.get("deepspeed_enable_sleep")), ref_offload=bool(a.get("ref_reward_offload")),
               vllm_group=plan.vllm_group, vllm_gpus=engines * plan.vllm_tp, vllm_util=a["vllm_gpu_memory_utilization"],
               vllm_sleep=bool(a.get("vllm_enable_sleep")), vllm_weights=actor.params * (2 if bf16 else actor.dtype_bytes) // plan.vllm_tp,
               sync_bucket=int(a.get("vllm_sync_bucket_mb", 256) * 2**20), phases=PHASES if engines else PHASES[:3],
               offload_ratio=a.get("adam_offload_ratio", 1.0) if a["adam_offload"] else 1.0,
               head_chunk=HEAD_CHUNK if a["zero_stage"] != 3 and actor.kind in PLAIN_HEAD else 0, **flags)


def from_options(a: dict, script: str, plan=None, world_size: int = 1, gpu_bytes: int | None = None,
                 seq: int | None = None) -> MemoryPlan:
    """The plan of a script's options. script: "dpo", "rm" (`world_size` ranks), else an RL script with its
    resource plan `plan`. seq: the longest sequence in tokens, if known (default: the flags' longest)."""
    try:
        job = _job_from_options(a, script, plan, world_size)
        return plan_memory(replace(job, seq=min(seq, job.seq)) if seq else job, gpu_bytes)
    except _NoPlan as e:
        return MemoryPlan([], gpu_bytes, None, str(e))


# ------------------------------------------------------------------------------ the check
def _vllm_least(j: Job, g: int) -> float:
    """The smallest --vllm_gpu_memory_utilization (steps of 0.05) that holds vLLM's weights and some KV cache."""
    return -(-(j.vllm_weights + 2 * GiB) * 20 // g) / 20


def _fixes(j: Job, g: int) -> list[tuple[str, object]]:
    """(flags, Job -> Job) that could lower the peak, for the layout `j` on GPUs of `g` bytes."""
    trained, frozen = any(m.trainable for m in j.models), any(not m.trainable for m in j.models)
    out = []
    if trained and not j.adam_offload and j.zero_stage:
        out.append(("--adam_offload", lambda x: replace(x, adam_offload=True)))
    if trained and j.zero_stage < 3:  # on one rank it still steps the master in sub-groups, but slowly
        alone = all(m.ranks == 1 for m in j.models if m.trainable)
        out.append(("--zero_stage 3" + (" (3x slower on one GPU)" if alone else ""), lambda x: replace(x, zero_stage=3)))
    if trained and not j.checkpointing:
        out.append(("--gradient_checkpointing", lambda x: replace(x, checkpointing=True)))
    if j.train_rows >= 2 * j.rows_per_item:
        k = j.train_rows // j.rows_per_item // 2
        out.append((f"--micro_train_batch_size {k}", lambda x: replace(x, train_rows=k * j.rows_per_item)))
    if j.rows_per_item == 1 and j.infer_rows >= 2:
        out.append((f"--micro_rollout_batch_size {j.infer_rows // 2}", lambda x: replace(x, infer_rows=j.infer_rows // 2)))
    if frozen and not j.ref_offload:
        out.append((j.offload_flag, lambda x: replace(x, ref_offload=True)))
    if j.vllm_gpus and j.vllm_group != "vllm":  # vLLM on the trainers' GPUs
        sleep = [f for f, on in (("--deepspeed_enable_sleep", j.ds_sleep), ("--vllm_enable_sleep", j.vllm_sleep)) if not on]
        if sleep:  # the hybrid engine: each side's memory goes while the other works; one alone frees little
            out.append((" ".join(sleep), lambda x: replace(x, ds_sleep=True, vllm_sleep=True)))
        low = _vllm_least(j, g)
        fit = [u / 20 for u in range(int(j.vllm_util * 20) - 1, 0, -1) if u / 20 >= low
               and plan_memory(replace(j, vllm_util=u / 20), g).worst() <= g]
        u = fit[0] if fit else low
        if u < j.vllm_util:
            out.append((f"--vllm_gpu_memory_utilization {u:g}", lambda x: replace(x, vllm_util=min(x.vllm_util, u))))
    flag = " ".join(dict.fromkeys(m.gpus_flag for m in j.models if m.gpus_flag))
    if trained and flag:
        colocated = j.vllm_gpus and j.vllm_group != "vllm"
        out.append((flag + (f" --vllm_num_engines {2 * j.vllm_gpus}" if colocated else ""), lambda x: replace(
            x, models=tuple(replace(m, ranks=2 * m.ranks) for m in x.models), vllm_gpus=x.vllm_gpus * (2 if colocated else 1))))
    return out


def check_memory(mp: MemoryPlan) -> None:
    """UserError when the processes sharing a GPU need more than it has (no GPU known: no check)."""
    g, j = mp.gpu_bytes, mp.job
    if not g or j is None:
        return
    low = _vllm_least(j, g)
    if j.vllm_gpus and j.vllm_util < low:  # else vLLM stops at start: no memory for the cache blocks
        raise UserError(f"--vllm_gpu_memory_utilization {j.vllm_util:g} gives each vLLM worker {j.vllm_util * g / GiB:.1f} "
                        f"GiB, less than its weights ({j.vllm_weights / GiB:.1f} GiB) and a KV cache: raise it to {low:g} or more")
    if mp.worst() <= g:
        return
    group = max(mp.groups(), key=lambda k: mp.group_peak(k)[1])
    phase, need, _ = mp.group_peak(group)
    parts = " + ".join(f"{p.process} {p.phases[phase] / GiB:.1f}" for p in mp.processes if p.group == group)
    base = mp.worst()
    ranked = sorted(((base - plan_memory(fn(j), g).worst(), flags, fn) for flags, fn in _fixes(j, g)), key=lambda t: -t[0])
    ranked = [r for r in ranked if r[0] > 0]
    said = [f"{flags} (-{s / GiB:.1f} GiB{', fits' if base - s <= g else ''})" for s, flags, _ in ranked]

    def apply(chosen):
        x = j
        for _, _, fn in chosen:
            x = fn(x)
        return plan_memory(x, g).worst()

    combo = []  # the most saving first until it fits, then without those it does not need
    for r in ranked:
        if apply(combo) > g:
            combo.append(r)
    for r in reversed(combo[:-1]):
        if apply([c for c in combo if c is not r]) <= g:
            combo.remove(r)
    left = apply(combo)
    combo = [flags for _, flags, _ in combo]
    verdict = (f"together {' '.join(combo)} fit ({left / GiB:.1f} GiB)" if left <= g and len(combo) > 1 else
               "" if left <= g else f"even with all of them {left / GiB:.1f} GiB: a GPU with more memory, or more GPUs")
    raise UserError(
        f"the memory plan needs {need / GiB:.1f} GiB on each GPU of {group} ({LABELS[phase]}: {parts}) but the GPU has "
        f"{g / GiB:.1f} GiB. Flags that lower it, most saving first: {', '.join(said) or 'none found'}"
        f"{'; ' + verdict if verdict else ''}.{_why_not_openrlhf(mp, group, phase)} (the plan is for sequences of "
        f"{j.seq} tokens; --dry_run prints it; docs/performance.md, Memory plan)")


def _why_not_openrlhf(mp: MemoryPlan, group: str, phase: str) -> str:
    """Why OpenRLHF's PPO commands need a flag more here: a user reads the refusal of a documented command
    as a bug. Our critic trains beside the actor (train_ppo.py, step 5) and both keep their training memory
    until the weight sync (common/rl/run.py); OpenRLHF's hybrid engine trains the critic, offloads it,
    then trains the actor, offloads it, then syncs (its PPOTrainer.ppo_train), so only one of them peaks."""
    trained = {m.role for m in mp.job.models if m.trainable and m.group == group}
    if not {"actor", "critic"} <= trained or phase not in ("train", "sync"):
        return ""
    return (" The actor and the critic train at the same time here, each in processes of its own, and keep their "
            f"training memory{' until the new weights reach vLLM' if phase == 'sync' else ''}, so both peaks add up "
            "on these GPUs; OpenRLHF's hybrid engine trains and offloads one after the other, so a PPO command "
            "written for it may need one of these flags here.")


# ------------------------------------------------------------------------------ table, scripts, metrics
LABELS = {"generate": "generate", "logprobs": "log-probs", "train": "train", "sync": "sync"}


def _gib(b: int, frac: float = 0.0) -> str:
    return " + ".join(([f"{b / GiB:.1f}"] if b or not frac else []) + ([f"{frac:g} x GPU"] if frac else []))


def rows(mp: MemoryPlan) -> list[dict]:
    """Rows for `MetricsLogger.table`: one per process (GiB on each of its GPUs, per phase, and what its
    peak holds), then each GPU's total and the phase it peaks in."""
    out = []
    for group in mp.groups():
        procs = [p for p in mp.processes if p.group == group]
        for p in procs:
            row = {"GPUs": f"{p.gpus} x {group}", "process": p.process}  # on every row: lines grep alone
            row.update({LABELS[ph]: _gib(p.phases[ph], p.gpu_fraction.get(ph, 0.0)) for ph in mp.job.phases})
            frac = max(p.gpu_fraction.values(), default=0.0)
            row["at its peak (GiB)"] = (f"weights, KV cache: {frac:g} of the GPU" if frac else
                                        ", ".join(f"{k} {v / GiB:.2f}" for k, v in p.breakdown.items()))
            out.append(row)
        phase, need, frac = mp.group_peak(group)
        total = {LABELS[ph]: _gib(sum(p.phases[ph] for p in procs), sum(p.gpu_fraction.get(ph, 0.0) for p in procs))
                 for ph in mp.job.phases}
        g, j = mp.gpu_bytes, mp.job
        # vLLM takes its share of whatever GPU it gets (0 bytes of its own here): the GPU must hold the rest
        # beside that share, and the share vLLM's weights and a KV cache (as check_memory asks)
        vllm = j.vllm_util > 0 and any(p.process == "vllm" for p in procs)
        least = max(need / (1 - frac) if frac < 1 else 0.0, (j.vllm_weights + 2 * GiB) / j.vllm_util if vllm else 0.0)
        if g:
            fits = f"of {g / GiB:.1f} GiB: {'fits' if need <= g else 'DOES NOT FIT'}"
        elif frac >= 1 and need:
            fits = f"fits no GPU: vLLM's share {frac:g} leaves nothing for the other {need / GiB:.1f} GiB"
        else:
            fits = f"needs a GPU of {least / GiB:.1f} GiB or more"
            fits += f" ({j.vllm_util:g} of it for vLLM's weights and KV cache)" if vllm else ""
        out.append({"GPUs": f"{procs[0].gpus} x {group}", "process": "= one GPU", **total,
                    "at its peak (GiB)": f"peak at {LABELS[phase]}, {fits}"})
    return out


@functools.lru_cache(maxsize=1)
def visible_gpu_bytes() -> int | None:
    """The smallest visible GPU's memory in bytes: torch's count where it has started (RM, DPO), else
    nvidia-smi's (the Ray driver loads no torch); None when no GPU is visible."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    if not shutil.which("nvidia-smi"):
        return None
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    mib = [int(x) for x in text.split() if x.isdigit()]
    return min(mib) * 2**20 if mib else None


def show(log, mp: MemoryPlan) -> None:
    """The plan as a table in `log` (a MetricsLogger), or the note saying why there is none; a layout that
    does not fit (in a dry run, which does not refuse it) gets the check's message as a warning."""
    if mp.job is None:
        log.info(f"memory plan: none ({mp.note})")
        return
    j = mp.job
    log.table(f"memory plan (GiB on each GPU; sequences of {j.seq} tokens, micro-batches of {j.train_rows} "
              f"(train) and {j.infer_rows} (no grad) sequences)", rows(mp))
    shared = {m.role: m.process for m in j.models if m.process != m.role and m.role in ("ref", "reward")}
    if hosted_note(shared):
        log.info(f"memory plan: {hosted_note(shared)}")
    if not mp.gpu_bytes:  # a dry run on a laptop: checked against the GPUs most such commands are written for
        try:
            check_memory(plan_memory(j, REFERENCE_GPU))
            log.info(f"memory plan: no GPU visible here; it fits an {REFERENCE_NAME}")
        except UserError as e:
            log.warn_once("memory plan", f"no GPU visible here; on an {REFERENCE_NAME}: {e}")
        return
    try:
        check_memory(mp)
    except UserError as e:
        log.warn_once("memory plan", str(e))


def preflight(mp: MemoryPlan, log=None) -> MemoryPlan:
    """What the scripts call before loading a model, with the plan of their options (`from_options`): the
    plan on this machine's GPU. With `log` (a dry run): shown there, a misfit as a warning; without: a
    layout that cannot fit the GPU raises UserError naming the flags that would make it fit."""
    if mp.job is not None:
        mp = plan_memory(mp.job, visible_gpu_bytes())
    if log is not None:
        show(log, mp)
    else:
        check_memory(mp)
    return mp
