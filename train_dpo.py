"""Direct Preference Optimization (DPO, IPO, conservative DPO) from preference pairs, with DeepSpeed.

The policy learns to raise log pi(chosen) - log pi(rejected) relative to a frozen reference
(a copy of the starting model), with loss -log sigmoid(beta * margin). `--ipo` uses IPO's squared
loss on length-averaged log-probs; `--label_smoothing` is conservative DPO; `--nll_loss_coef` adds
an NLL term on the chosen response (as in RPO). The implicit reward beta * (log pi - log pi_ref)
gives `train/reward_acc`: how often chosen out-scores rejected. `--packing_samples` runs a micro-batch's
chosen and rejected sequences as one row without padding (the same log-probs); `--ref_offload` keeps the
reference's weights in CPU memory.

Run book
    python train_dpo.py                                 # built-in tiny model and task, one CPU process
    torchrun --nproc_per_node 2 train_dpo.py ...        # several processes (CPU: gloo, GPU: NCCL)
    deepspeed train_dpo.py --pretrain meta-llama/Meta-Llama-3-8B --dataset prefs.jsonl \
        --apply_chat_template --chosen_key chosen --rejected_key rejected --beta 0.1 \
        --zero_stage 3 --bf16 --flash_attn --gradient_checkpointing \
        --train_batch_size 256 --micro_train_batch_size 2 --max_len 8192 --learning_rate 5e-7
    sbatch slurm/dpo_8b.sh                              # Slurm, several nodes
"""
from __future__ import annotations

import math
import os
import time

import typer

from common.cli import openrlhf_flags as orl
from common.cli import options as o
from common.errors import TrainingError, UserError, exit_on_user_error, require
from common.cli.checks import check_lora, template_notes

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich")


@app.command(help=__doc__.split("\n\n")[0], cls=orl.Command)
@orl.openrlhf_flags("train_dpo")  # OpenRLHF's other flags, and its defaults with --pretrain
def main(
    pretrain: o.Pretrain = None,
    ref_pretrain: o.RefPretrain = None,
    bf16: o.BF16 = False,
    torch_autocast: o.TorchAutocast = False,
    torch_compile: o.TorchCompile = False,
    flash_attn: o.FlashAttn = False,
    gradient_checkpointing: o.GradCkpt = False,
    lora_rank: o.LoraRank = 0,
    lora_alpha: o.LoraAlpha = 16,
    target_modules: o.TargetModules = None,
    lora_dropout: o.LoraDropout = 0.0,
    load_in_4bit: o.LoadIn4bit = False,
    use_liger_kernel: o.UseLigerKernel = False,
    dataset: o.Dataset = None,
    dataset_probs: o.DatasetProbs = None,
    dataset_split: o.DatasetSplit = "train",
    eval_dataset: o.EvalDataset = None,
    eval_split: o.EvalSplit = "test",
    chosen_key: o.ChosenKey = "chosen",
    rejected_key: o.RejectedKey = "rejected",
    prompt_key: o.PromptKey = None,
    input_template: o.InputTemplate = None,
    apply_chat_template: o.ApplyChatTemplate = False,
    tokenizer_chat_template: o.TokenizerChatTemplate = None,
    max_len: o.MaxLen = 512,
    max_samples: o.MaxSamples = None,
    beta: o.Beta = 0.1,
    label_smoothing: o.LabelSmoothing = 0.0,
    ipo: o.IPO = False,
    nll_loss_coef: o.NLLLossCoef = 0.0,
    max_epochs: o.MaxEpochs = 1,
    max_steps: o.MaxSteps = None,
    train_batch_size: o.TrainBatchSize = 32,
    micro_train_batch_size: o.MicroTrainBatchSize = 16,
    learning_rate: o.LearningRate = 5e-4,
    lr_warmup_ratio: o.WarmupRatio = 0.03,
    lr_scheduler: o.LRScheduler = "cosine_with_min_lr",
    min_lr_ratio: o.MinLRRatio = 0.1,
    l2: o.WeightDecay = 0.0,
    adam_betas: o.AdamBetas = (0.9, 0.95),
    max_norm: o.MaxNorm = 1.0,
    seed: o.Seed = 42,
    skip_nonfinite_updates: o.SkipNonfiniteUpdates = False,
    packing_samples: o.PackingSamples = False,
    zero_stage: o.ZeroStage = 2,
    adam_offload: o.AdamOffload = False,
    adam_offload_ratio: o.AdamOffloadRatio = 1.0,
    ref_offload: o.RefOffload = False,
    local_rank: o.LocalRank = -1,
    save_path: o.SavePath = "./output/dpo",
    save_steps: o.SaveSteps = -1,
    logging_steps: o.LoggingSteps = 1,
    eval_steps: o.EvalSteps = -1,
    ckpt_path: o.CkptPath = None,
    max_ckpt_num: o.MaxCkptNum = 3,
    load_checkpoint: o.LoadCheckpoint = False,
    use_wandb: o.UseWandb = None,
    wandb_project: o.WandbProject = "hybridrl",
    wandb_run_name: o.WandbRunName = None,
    use_tensorboard: o.UseTensorboard = None,
):
    options = orl.options(locals())
    with exit_on_user_error():
        check_lora(options)
        require(not (lora_rank and (ref_pretrain or ref_offload)), f"--{'ref_pretrain' if ref_pretrain else 'ref_offload'} "
                "with --lora_rank: the reference is the policy with its adapter switched off, so there is no "
                "reference model to load or offload; drop it")
        require(beta > 0, f"--beta {beta}: must be > 0 (it scales the implicit reward)")
        require(not (ipo and label_smoothing > 0), "--ipo and --label_smoothing: IPO has no label smoothing; drop one")
        template_notes(options, "--prompt_key")
        require(zero_stage in (0, 1, 2, 3), f"--zero_stage {zero_stage}: DeepSpeed ZeRO has stages 0, 1, 2 and 3")
        o.check_precision(options)
        require(train_batch_size % micro_train_batch_size == 0,
                f"--train_batch_size {train_batch_size} must be a multiple of --micro_train_batch_size {micro_train_batch_size}")
        train(o.typed(options, main, "DPOOptions"))  # a misspelt option is an AttributeError


def train(a: o.Options) -> None:
    from common import cpu_threads
    cpu_threads.configure()  # before torch: OpenMP reads its wait policy once, when it loads
    import torch

    from common.training import ds
    from common.cluster import gpu_memory, memory_plan
    from common.training import updates
    from common.training.checkpoint import Preemption, latest_checkpoint, load_checkpoint, save_checkpoint
    from common.data.rows import iterate_batches
    from common.algo.packing import next_token_logprobs
    from common.data.preferences import collate_pairs, load_preference_data
    from common.data.prompts import set_chat_template
    from common.logger import MetricsLogger, git_commit, versions
    from common.algo.losses import dpo_loss, nll_loss, sequence_logprobs
    from common.training.lora import LoraSettings, adapter_disabled, apply_lora, quantization
    from common.training.models import attn_implementation, load_causal_lm, load_tokenizer, max_len_note, resolve_pretrain

    dist = ds.setup_distributed()
    torch.manual_seed(a.seed)
    dtype, dtype_note = ds.resolve_dtype(a.bf16, dist.device)
    attn, attn_note = attn_implementation(a.flash_attn)
    settings = ds.DSSettings.from_options(a, bf16=dtype == torch.bfloat16)
    accum = ds.grad_accumulation(settings, dist.world_size)
    # refused here if it cannot fit the GPU
    memory = memory_plan.preflight(memory_plan.from_options(a, "dpo", world_size=dist.world_size))

    # ---- data: the built-in copy task (chat messages) unless --dataset is given
    pretrain = resolve_pretrain(a.pretrain)
    tokenizer = load_tokenizer(pretrain)
    set_chat_template(tokenizer, a.tokenizer_chat_template)
    train_pairs, train_src, eval_pairs, eval_src = load_preference_data(
        a.dataset, a.eval_dataset, tokenizer, max_samples=a.max_samples, chosen_key=a.chosen_key,
        rejected_key=a.rejected_key, prompt_key=a.prompt_key, apply_chat_template=a.apply_chat_template,
        max_len=a.max_len, input_template=a.input_template, dataset_probs=a.dataset_probs,
        dataset_split=a.dataset_split, eval_split=a.eval_split, seed=a.seed)
    B = a.train_batch_size
    if len(train_pairs) < B:
        raise UserError(f"{train_src}: {len(train_pairs)} pairs is fewer than one batch (--train_batch_size {B})")
    steps_per_epoch = len(train_pairs) // B
    total_steps = a.max_steps or steps_per_epoch * a.max_epochs

    # ---- models: the policy (trained) and the reference (frozen)
    ds_cfg = ds.train_config(settings, dist.world_size, dtype)
    _keep = ds.zero3_loading(ds_cfg)  # noqa: F841  (must outlive from_pretrained)
    lora = LoraSettings.from_options(a)
    policy = load_causal_lm(pretrain, dtype=torch.float32, attn_impl=attn, **quantization(lora, dist.device))
    notes = template_notes(a, "--prompt_key") + [max_len_note(policy.config, a.max_len)]
    if a.use_liger_kernel:  # the policy only, as OpenRLHF
        from common.training.liger import apply_liger

        notes.append(apply_liger(policy, dist.device))
    # with --lora_rank the reference is the policy with its adapter off: no second model below
    lora_note = apply_lora(policy, lora) if lora.on else None
    engine = ds.initialize(policy, settings, dist, dtype, lr=a.learning_rate, total_steps=total_steps,
                           warmup_ratio=a.lr_warmup_ratio, scheduler=a.lr_scheduler,
                           betas=a.adam_betas, weight_decay=a.l2, min_lr_ratio=a.min_lr_ratio)
    # --ref_offload: ZeRO-3 keeps the reference's shards in CPU memory; other stages keep the whole model
    # there and move it over for each forward pass (ref_logps). On a CPU it is there anyway.
    offload = a.ref_offload and dist.device.type == "cuda"
    move_ref = offload and a.zero_stage != 3
    if a.ref_offload and not offload:
        notes.append("--ref_offload: on the CPU the reference is in CPU memory anyway")
    _keep = ds.zero3_loading(ds.eval_config(settings, dtype, offload))  # noqa: F841
    reference = None if lora.on else ds.initialize_eval(load_causal_lm(
        resolve_pretrain(a.ref_pretrain or a.pretrain), dtype=dtype, attn_impl=attn), settings, dtype, dist.device,
        offload=offload)

    # ---- resume
    ckpt_root = a.ckpt_path or os.path.join(a.save_path, "checkpoints")
    state = {"step": 0, "epoch": 0, "step_in_epoch": 0, "skipped_updates": 0}
    resume_from = latest_checkpoint(ckpt_root) if a.load_checkpoint else None
    if resume_from:
        state = load_checkpoint(resume_from, {"policy": engine}, rank=dist.rank)

    log = MetricsLogger(a.save_path, total_steps, enabled=dist.rank == 0, config=dict(a, pretrain=pretrain),
                        use_wandb=a.use_wandb,
                        wandb_project=a.wandb_project, wandb_run_name=a.wandb_run_name,
                        tensorboard_dir=a.use_tensorboard,
                        plot_keys=("train/loss", "train/reward_acc", "train/reward_margin", "eval/reward_acc"),
                        title="DPO", start_step=state["step"] + 1, append=bool(resume_from))
    log.banner("hybridrl train_dpo", {
        "run": {"model": pretrain, **({"LoRA": f"{lora_note}; the reference is the base, adapter off"} if lora_note else {}),
                "loss": "IPO" if a.ipo else f"DPO (beta {a.beta}, label smoothing {a.label_smoothing})",
                "data": f"{train_src} ({len(train_pairs)} pairs)",
                "eval": f"{eval_src} ({len(eval_pairs)} pairs)" if eval_pairs else "none",
                "world size": dist.world_size, "device": dist.device.type, "dtype": str(dtype).replace("torch.", ""),
                "zero stage": a.zero_stage, "batch": f"{B} = {a.micro_train_batch_size} x {accum} accum x {dist.world_size} ranks",
                "steps": total_steps, "resumed from": resume_from or "-", "output": a.save_path, "git": git_commit()},
        "versions": versions()})
    memory_plan.show(log, memory)
    if a.packing_samples and attn != "flash_attention_2":
        notes.append("--packing_samples without flash-attention: SDPA with a block-diagonal mask, whose memory grows "
                     "with the square of the packed length (--flash_attn on a GPU needs none)")
    for note in (dtype_note, attn_note, ds.zero_note(a.zero_stage, dist.world_size, dist.device), *notes):
        if note:
            log.warn_once(note, note)

    def logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sequence response log-probs [2B] (mean per token under IPO) and token log-probs [2B, T-1]."""
        token_lp = next_token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                       packing=a.packing_samples, flash=attn == "flash_attention_2")
        return sequence_logprobs(token_lp, batch["loss_mask"][:, 1:], average=a.ipo), token_lp

    def ref_logps(batch) -> torch.Tensor:
        if reference is None:  # --lora_rank: the base model is the reference
            with torch.no_grad(), adapter_disabled(engine):
                return logps(engine, batch)[0]
        if move_ref:
            reference.to(dist.device)
        try:
            with torch.no_grad():
                return logps(reference, batch)[0]
        finally:
            if move_ref:
                reference.to("cpu")

    def pair_loss(pairs) -> tuple[torch.Tensor, dict]:
        batch = {k: v.to(dist.device) if torch.is_tensor(v) else v
                 for k, v in collate_pairs(pairs, tokenizer.pad_token_id).items()}
        b = len(pairs)
        ref = ref_logps(batch)
        pol, token_lp = logps(engine, batch)
        loss, r_c, r_r = dpo_loss(pol[:b], pol[b:], ref[:b], ref[b:], a.beta,
                                  label_smoothing=a.label_smoothing, ipo=a.ipo)
        if a.nll_loss_coef > 0:
            loss = loss + a.nll_loss_coef * nll_loss(token_lp[:b], batch["loss_mask"][:b, 1:])
        stats = {"correct": (r_c > r_r).sum().item(), "margin": (r_c - r_r).sum().item(),
                 "chosen": r_c.sum().item(), "rejected": r_r.sum().item(), "tokens": batch["attention_mask"].sum().item()}
        return loss, stats

    def evaluate() -> dict:
        engine.eval()
        t = torch.zeros(4, dtype=torch.float64)  # loss, correct, margin, count
        mine = eval_pairs[dist.rank::dist.world_size]
        with torch.no_grad():
            for i in range(0, len(mine), a.micro_train_batch_size):
                chunk = mine[i: i + a.micro_train_batch_size]
                loss, s = pair_loss(chunk)
                t += torch.tensor([loss.item() * len(chunk), s["correct"], s["margin"], len(chunk)], dtype=torch.float64)
        if dist.world_size > 1:
            torch.distributed.all_reduce(t)
        engine.train()
        return {"eval/loss": (t[0] / t[3]).item(), "eval/reward_acc": (t[1] / t[3]).item(),
                "eval/reward_margin": (t[2] / t[3]).item()}

    # ---- train
    per_rank = B // dist.world_size
    micro = a.micro_train_batch_size
    step, skipped = state["step"], state.get("skipped_updates", 0)  # older checkpoints have no count
    batches = iterate_batches(len(train_pairs), B, a.seed, start_epoch=state["epoch"], start_step=state["step_in_epoch"])
    preempt = Preemption()
    engine.train()
    while step < total_steps:
        epoch, step_in_epoch, idx = next(batches)
        t0 = time.perf_counter()
        mine = [train_pairs[i] for i in idx[dist.rank * per_rank: (dist.rank + 1) * per_rank]]
        sums = torch.zeros(6, dtype=torch.float64)  # loss, correct, margin, chosen, rejected, tokens
        for i in range(0, per_rank, micro):
            chunk = mine[i: i + micro]
            loss, s = pair_loss(chunk)
            if not torch.isfinite(loss) and not a.skip_nonfinite_updates:  # stop before a NaN reaches the weights
                raise TrainingError(f"step {step + 1}: the policy loss is {loss.item()}; lower the learning rate "
                                    "or check the data, or pass --skip_nonfinite_updates to skip such updates "
                                    "(nothing after the last checkpoint was saved)")
            # Every rank runs backward, a non-finite loss included (ZeRO's collectives need all ranks);
            # its NaN gradients make DeepSpeed skip the update on every rank.
            engine.backward(updates.poison_nonfinite(loss))
            engine.step()
            sums += torch.tensor([loss.item() * len(chunk), s["correct"], s["margin"], s["chosen"], s["rejected"],
                                  s["tokens"]], dtype=torch.float64)
        skipped += updates.update_skipped(engine, allow=a.skip_nonfinite_updates, who=f"step {step + 1}: the policy",
                                     fix="Lower the learning rate or check the data (nothing after the last checkpoint "
                                     "was saved)")
        if dist.world_size > 1:
            torch.distributed.all_reduce(sums)
        step += 1
        grad_norm = engine.get_global_grad_norm()
        dt = time.perf_counter() - t0
        metrics = {"train/loss": sums[0].item() / B, "train/reward_acc": sums[1].item() / B,
                   "train/reward_margin": sums[2].item() / B, "train/chosen_reward": sums[3].item() / B,
                   "train/rejected_reward": sums[4].item() / B, "train/lr": engine.get_lr()[0],
                   "train/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                   "time/step_s": dt, "perf/tokens_per_s": sums[5].item() / dt, "train/epoch": epoch}
        if a.skip_nonfinite_updates:
            metrics["train/skipped_updates"] = skipped
        if dist.device.type == "cuda":
            metrics.update(gpu_memory.mem_metrics("", None, memory))  # mem/peak_gb beside mem/predicted_gb
        last = step == total_steps
        epoch_end = step_in_epoch + 1 == steps_per_epoch
        if eval_pairs and ((a.eval_steps > 0 and step % a.eval_steps == 0) or
                           (a.eval_steps <= 0 and epoch_end) or last):
            metrics.update(evaluate())
        if step % a.logging_steps == 0 or last or "eval/reward_acc" in metrics:
            log.log(step, metrics)
        preempted = not last and preempt.requested()
        if (a.save_steps > 0 and step % a.save_steps == 0 and not last) or preempted:
            pos = (epoch + 1, 0) if epoch_end else (epoch, step_in_epoch + 1)
            path = save_checkpoint(ckpt_root, step, {"policy": engine},
                                   {"step": step, "epoch": pos[0], "step_in_epoch": pos[1], "skipped_updates": skipped},
                                   rank=dist.rank, max_keep=a.max_ckpt_num,
                                   hf_tokenizer=tokenizer if a.save_hf_ckpt else None)
            log.info(f"checkpoint saved: {path}")
        if preempted:
            log.info(f"{preempt.reason()}: stopped after step {step}; --load_checkpoint resumes from {ckpt_root}")
            preempt.mark_stopped()
            log.end({}, resume_from=ckpt_root)
            raise preempt.stopped()  # exit 143 / 130: training did not finish

    ds.save_hf(engine, tokenizer, a.save_path, dist.rank)
    log.end({"policy": a.save_path})


if __name__ == "__main__":
    app()
