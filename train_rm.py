"""Train a reward model on preference pairs (Bradley-Terry), with DeepSpeed.

The model is the LM body plus a scalar head; it learns r(prompt, chosen) > r(prompt, rejected)
by minimising -log sigmoid(r_c - r_r) (minus each pair's margin with `--margin_loss`), or the equivalent
log(1 + exp(r_r - r_c)) with `--loss logexp`. `--packing_samples` runs a micro-batch's chosen and
rejected sequences as one row without padding (the same scores). The saved folder loads with `AutoModelForSequenceClassification` and is what
`train_ppo.py --reward_pretrain` takes. Its config.json records, as OpenRLHF's does, the head's name
(`value_head_prefix`) and the mean and std of the last evaluation's rewards (`--normalize_reward` in
the RL scripts), so OpenRLHF's loader reads it too.

Run book
    python train_rm.py                                  # built-in tiny model and task, one CPU process
    torchrun --nproc_per_node 2 train_rm.py ...         # several processes (CPU: gloo, GPU: NCCL)
    deepspeed train_rm.py --pretrain meta-llama/Meta-Llama-3-8B --dataset prefs.jsonl \
        --apply_chat_template --chosen_key chosen --rejected_key rejected \
        --zero_stage 3 --bf16 --flash_attn --gradient_checkpointing \
        --train_batch_size 256 --micro_train_batch_size 1 --max_len 8192 --learning_rate 9e-6
    sbatch slurm/rm_8b.sh                               # Slurm, several nodes
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
@orl.openrlhf_flags("train_rm")  # OpenRLHF's other flags, and its defaults with --pretrain
def main(
    pretrain: o.Pretrain = None,
    value_head_prefix: o.ValueHeadPrefix = "score",
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
    dataset: o.Dataset = None,
    dataset_probs: o.DatasetProbs = None,
    dataset_split: o.DatasetSplit = "train",
    eval_dataset: o.EvalDataset = None,
    eval_split: o.EvalSplit = "train",
    chosen_key: o.ChosenKey = "chosen",
    rejected_key: o.RejectedKey = "rejected",
    prompt_key: o.PromptKey = None,
    input_template: o.InputTemplate = None,
    apply_chat_template: o.ApplyChatTemplate = False,
    tokenizer_chat_template: o.TokenizerChatTemplate = None,
    max_len: o.MaxLen = 512,
    max_samples: o.MaxSamples = None,
    loss: o.RMLoss = "sigmoid",
    margin_loss: o.MarginLoss = False,
    margin_key: o.MarginKey = "margin",
    compute_fp32_loss: o.ComputeFP32Loss = False,
    max_epochs: o.MaxEpochs = 2,
    max_steps: o.MaxSteps = None,
    train_batch_size: o.TrainBatchSize = 32,
    micro_train_batch_size: o.MicroTrainBatchSize = 16,
    learning_rate: o.LearningRate = 5e-4,
    lr_warmup_ratio: o.WarmupRatio = 0.03,
    lr_scheduler: o.LRScheduler = "cosine_with_min_lr",
    l2: o.WeightDecay = 0.0,
    adam_betas: o.AdamBetas = (0.9, 0.95),
    max_norm: o.MaxNorm = 1.0,
    seed: o.Seed = 42,
    skip_nonfinite_updates: o.SkipNonfiniteUpdates = False,
    packing_samples: o.PackingSamples = False,
    zero_stage: o.ZeroStage = 2,
    adam_offload: o.AdamOffload = False,
    adam_offload_ratio: o.AdamOffloadRatio = 1.0,
    local_rank: o.LocalRank = -1,
    save_path: o.SavePath = "./output/rm",
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
        require(loss in ("sigmoid", "logexp"), f"--loss {loss}: choose sigmoid or logexp")
        require(not (margin_loss and loss == "logexp"), "--margin_loss adds the margins to the sigmoid loss; "
                "--loss logexp has no margin term (OpenRLHF ignores them there): drop one of the two")
        template_notes(options, "--prompt_key")
        require(zero_stage in (0, 1, 2, 3), f"--zero_stage {zero_stage}: DeepSpeed ZeRO has stages 0, 1, 2 and 3")
        o.check_precision(options)
        if compute_fp32_loss:  # OpenRLHF's flag; said as its other flags that change nothing here (common.cli.openrlhf_flags)
            options["openrlhf"]["notes"].append("--compute_fp32_loss: the reward model's loss is computed in fp32 here "
                                                "whatever --bf16 (the scores are cast first); the flag changes nothing")
        require(train_batch_size % micro_train_batch_size == 0,
                f"--train_batch_size {train_batch_size} must be a multiple of --micro_train_batch_size {micro_train_batch_size}")
        train(o.typed(options, main, "RMOptions"))  # a misspelt option is an AttributeError


def train(a: o.Options) -> None:
    from common import cpu_threads
    cpu_threads.configure()  # before torch: OpenMP reads its wait policy once, when it loads
    import torch

    from common.training import ds
    from common.cluster import gpu_memory, memory_plan
    from common.training import updates
    from common.training.checkpoint import Preemption, latest_checkpoint, load_checkpoint, save_checkpoint
    from common.data.rows import iterate_batches
    from common.algo.packing import sequence_rewards
    from common.data.preferences import collate_pairs, load_preference_data
    from common.data.prompts import set_chat_template
    from common.logger import MetricsLogger, git_commit, versions
    from common.algo.losses import bradley_terry_loss, log_exp_loss
    from common.training.lora import LoraSettings, apply_lora, quantization
    from common.training.models import attn_implementation, load_reward_model, load_tokenizer, max_len_note, resolve_pretrain

    dist = ds.setup_distributed()
    torch.manual_seed(a.seed)
    dtype, dtype_note = ds.resolve_dtype(a.bf16, dist.device)
    attn, attn_note = attn_implementation(a.flash_attn)
    settings = ds.DSSettings.from_options(a, bf16=dtype == torch.bfloat16)
    accum = ds.grad_accumulation(settings, dist.world_size)
    # refused here if it cannot fit the GPU
    memory = memory_plan.preflight(memory_plan.from_options(a, "rm", world_size=dist.world_size))

    # ---- data: the built-in copy task (chat messages) unless --dataset is given
    pretrain = resolve_pretrain(a.pretrain)
    tokenizer = load_tokenizer(pretrain)
    set_chat_template(tokenizer, a.tokenizer_chat_template)
    train_pairs, train_src, eval_pairs, eval_src = load_preference_data(
        a.dataset, a.eval_dataset, tokenizer, max_samples=a.max_samples, chosen_key=a.chosen_key,
        rejected_key=a.rejected_key, prompt_key=a.prompt_key, apply_chat_template=a.apply_chat_template,
        max_len=a.max_len, margin_key=a.margin_key, input_template=a.input_template,
        dataset_probs=a.dataset_probs, dataset_split=a.dataset_split, eval_split=a.eval_split,
        default_eval_split="train", seed=a.seed)
    with_margin = any(p.margin is not None for p in train_pairs)
    if a.margin_loss and not with_margin:
        raise UserError(f"--margin_loss: no row of {train_src} has a '{a.margin_key}' value; set --margin_key")
    B = a.train_batch_size
    if len(train_pairs) < B:
        raise UserError(f"{train_src}: {len(train_pairs)} pairs is fewer than one batch (--train_batch_size {B})")
    steps_per_epoch = len(train_pairs) // B
    total_steps = a.max_steps or steps_per_epoch * a.max_epochs

    # ---- model
    ds_cfg = ds.train_config(settings, dist.world_size, dtype)
    _keep = ds.zero3_loading(ds_cfg)  # noqa: F841  (must outlive from_pretrained)
    lora = LoraSettings.from_options(a)
    model = load_reward_model(pretrain, dtype=torch.float32, attn_impl=attn, pad_token_id=tokenizer.pad_token_id,
                              value_head_prefix=a.value_head_prefix, **quantization(lora, dist.device))
    # with --lora_rank the value head trains in full beside the adapter and is saved with it
    lora_note = apply_lora(model, lora, head="score") if lora.on else None
    engine = ds.initialize(model, settings, dist, dtype, lr=a.learning_rate, total_steps=total_steps,
                           warmup_ratio=a.lr_warmup_ratio, scheduler=a.lr_scheduler,
                           betas=a.adam_betas, weight_decay=a.l2)

    # ---- resume
    ckpt_root = a.ckpt_path or os.path.join(a.save_path, "checkpoints")
    state = {"step": 0, "epoch": 0, "step_in_epoch": 0, "skipped_updates": 0}
    resume_from = latest_checkpoint(ckpt_root) if a.load_checkpoint else None
    if resume_from:
        state = load_checkpoint(resume_from, {"model": engine}, rank=dist.rank)

    log = MetricsLogger(a.save_path, total_steps, enabled=dist.rank == 0, config=dict(a, pretrain=pretrain),
                        use_wandb=a.use_wandb,
                        wandb_project=a.wandb_project, wandb_run_name=a.wandb_run_name,
                        tensorboard_dir=a.use_tensorboard, plot_keys=("train/loss", "train/acc", "eval/acc"),
                        title="reward model", start_step=state["step"] + 1, append=bool(resume_from))
    log.banner("hybridrl train_rm", {
        "run": {"model": pretrain, **({"LoRA": lora_note} if lora_note else {}),
                "data": f"{train_src} ({len(train_pairs)} pairs)",
                "eval": f"{eval_src} ({len(eval_pairs)} pairs)" if eval_pairs else "none",
                "world size": dist.world_size, "device": dist.device.type, "dtype": str(dtype).replace("torch.", ""),
                "zero stage": a.zero_stage, "batch": f"{B} = {a.micro_train_batch_size} x {accum} accum x {dist.world_size} ranks",
                "steps": total_steps, "resumed from": resume_from or "-", "output": a.save_path, "git": git_commit()},
        "versions": versions()})
    memory_plan.show(log, memory)
    notes = template_notes(a, "--prompt_key") + [max_len_note(model.config, a.max_len)]
    if with_margin and not a.margin_loss:
        notes.append(f"the data's '{a.margin_key}' column is not used: --margin_loss adds it to the loss")
    if a.packing_samples and attn != "flash_attention_2":
        notes.append("--packing_samples without flash-attention: SDPA with a block-diagonal mask, whose memory grows "
                     "with the square of the packed length (--flash_attn on a GPU needs none)")
    for note in (dtype_note, attn_note, ds.zero_note(a.zero_stage, dist.world_size, dist.device), *notes):
        if note:
            log.warn_once(note, note)

    def batch_scores(pairs):
        """Rewards of chosen and rejected: ([b], [b]) for b pairs."""
        batch = {k: v.to(dist.device) if torch.is_tensor(v) else v
                 for k, v in collate_pairs(pairs, tokenizer.pad_token_id).items()}
        scores = sequence_rewards(engine, batch["input_ids"], batch["attention_mask"], packing=a.packing_samples,
                                  flash=attn == "flash_attention_2")
        b = len(pairs)
        return scores[:b], scores[b:], batch

    def evaluate(pairs) -> dict:
        """Pairwise accuracy on `pairs`, each rank scoring a shard; as OpenRLHF's evaluation, the mean and
        (unbiased) std of all their chosen and rejected rewards go into the model's config, to be saved."""
        engine.eval()
        t = torch.zeros(5, dtype=torch.float64)  # correct, pairs, margin sum, reward sum, reward square sum
        mine = pairs[dist.rank::dist.world_size]
        with torch.no_grad():
            for i in range(0, len(mine), a.micro_train_batch_size):
                c, r, _ = batch_scores(mine[i: i + a.micro_train_batch_size])
                both = torch.cat([c, r]).double()
                t += torch.tensor([(c > r).sum().item(), len(c), (c - r).sum().item(), both.sum().item(),
                                   both.square().sum().item()], dtype=torch.float64)
        if dist.world_size > 1:
            torch.distributed.all_reduce(t)
        engine.train()
        n = 2 * t[1]
        mean = t[3] / n
        std = ((t[4] - n * mean**2) / (n - 1).clamp(min=1)).clamp(min=0).sqrt().clamp(min=1e-8)
        config = ds.unwrap(engine).config
        config.mean, config.std = mean.item(), std.item()
        return {"eval/acc": (t[0] / t[1]).item(), "eval/reward_margin": (t[2] / t[1]).item(),
                "eval/reward_mean": mean.item(), "eval/reward_std": std.item()}

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
        sums = torch.zeros(5, dtype=torch.float64)  # loss, correct, chosen, rejected, tokens
        for i in range(0, per_rank, micro):
            chosen, rejected, batch = batch_scores(mine[i: i + micro])
            if a.loss == "logexp":
                loss = log_exp_loss(chosen, rejected)
            else:
                loss = bradley_terry_loss(chosen, rejected, batch["margin"] if a.margin_loss else None)
            if not torch.isfinite(loss) and not a.skip_nonfinite_updates:  # stop before a NaN reaches the weights
                raise TrainingError(f"step {step + 1}: the reward model loss is {loss.item()}; lower the learning rate "
                                    "or check the data, or pass --skip_nonfinite_updates to skip such updates "
                                    "(nothing after the last checkpoint was saved)")
            # Every rank runs backward, a non-finite loss included (ZeRO's collectives need all ranks);
            # its NaN gradients make DeepSpeed skip the update on every rank.
            engine.backward(updates.poison_nonfinite(loss))
            engine.step()
            sums += torch.tensor([loss.item() * len(chosen), (chosen > rejected).sum().item(), chosen.sum().item(),
                                  rejected.sum().item(), batch["attention_mask"].sum().item()], dtype=torch.float64)
        skipped += updates.update_skipped(engine, allow=a.skip_nonfinite_updates, who=f"step {step + 1}: the reward model",
                                     fix="Lower the learning rate or check the data (nothing after the last checkpoint "
                                     "was saved)")
        if dist.world_size > 1:
            torch.distributed.all_reduce(sums)
        step += 1
        grad_norm = engine.get_global_grad_norm()
        dt = time.perf_counter() - t0
        metrics = {"train/loss": sums[0].item() / B, "train/acc": sums[1].item() / B,
                   "train/chosen_reward": sums[2].item() / B, "train/rejected_reward": sums[3].item() / B,
                   "train/lr": engine.get_lr()[0], "train/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                   "time/step_s": dt, "perf/tokens_per_s": sums[4].item() / dt, "train/epoch": epoch}
        if a.skip_nonfinite_updates:
            metrics["train/skipped_updates"] = skipped
        if dist.device.type == "cuda":
            metrics.update(gpu_memory.mem_metrics("", None, memory))  # mem/peak_gb beside mem/predicted_gb
        last = step == total_steps
        epoch_end = step_in_epoch + 1 == steps_per_epoch
        if eval_pairs and ((a.eval_steps > 0 and step % a.eval_steps == 0) or
                           (a.eval_steps <= 0 and epoch_end) or last):
            metrics.update(evaluate(eval_pairs))
        if step % a.logging_steps == 0 or last or "eval/acc" in metrics:
            log.log(step, metrics)
        preempted = not last and preempt.requested()
        if (a.save_steps > 0 and step % a.save_steps == 0 and not last) or preempted:
            pos = (epoch + 1, 0) if epoch_end else (epoch, step_in_epoch + 1)
            path = save_checkpoint(ckpt_root, step, {"model": engine},
                                   {"step": step, "epoch": pos[0], "step_in_epoch": pos[1], "skipped_updates": skipped},
                                   rank=dist.rank, max_keep=a.max_ckpt_num,
                                   hf_tokenizer=tokenizer if a.save_hf_ckpt else None)
            log.info(f"checkpoint saved: {path}")
        if preempted:
            log.info(f"{preempt.reason()}: stopped after step {step}; --load_checkpoint resumes from {ckpt_root}")
            preempt.mark_stopped()
            log.end({}, resume_from=ckpt_root)
            raise preempt.stopped()  # exit 143 / 130: training did not finish

    if not eval_pairs and len(train_pairs) >= 100:  # OpenRLHF's statistics set then: the first 1% of the training data,
        ws = dist.world_size                         # whole shards (ZeRO-3 ranks run their forward passes together)
        n = max(len(train_pairs) // 100 // ws * ws, ws)
        stats = evaluate(train_pairs[:n])
        log.info(f"reward mean {stats['eval/reward_mean']:.4g}, std {stats['eval/reward_std']:.4g} over the first {n} "
                 "training pairs (no held-out set), recorded in config.json")
    ds.save_hf(engine, tokenizer, a.save_path, dist.rank)
    log.end({"reward model": a.save_path})


if __name__ == "__main__":
    app()
