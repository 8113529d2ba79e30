"""Supervised fine-tuning (SFT) of a causal LM on prompt/response data, with DeepSpeed.

The loss is the negative log-likelihood of the response tokens: the last assistant turn, every
assistant turn with `--multiturn`, every token with `--pretrain_mode`. Each optimizer step averages
it over all the step's loss tokens, across its micro-batches and ranks, so every loss token weighs
the same. OpenRLHF's loss at the CLI these flags follow (76351db1) is each micro-batch's own token
mean, which DeepSpeed then averages over the step's micro-batches and ranks: a token weighs more in
a micro-batch with fewer loss tokens (with one sample per micro-batch, a short answer weighs as much
as a long one); its later code takes the step's token mean, as here. `--packing_samples`
runs a micro-batch as one row without padding: positions restart for each sample and attention stays
inside it (the same loss). Rows: OpenRLHF's `--input_key`/`--output_key` (strings or message lists),
whole conversations, and TRL's `messages` and `prompt`/`completion` layouts (common/data/sft.py).

Built-in default: the tiny model's architecture and tokenizer, freshly initialised (it has never seen
the copy task), learn the copy task; `eval/exact_match` is greedy decoding's held-out exact-match.
The saved folder is what `train_rm.py --pretrain` and `train_ppo.py --pretrain` take (`make pipeline`).

Run book
    python train_sft.py                                 # built-in tiny model and task, one CPU process
    torchrun --nproc_per_node 2 train_sft.py ...        # several processes (CPU: gloo, GPU: NCCL)
    deepspeed train_sft.py --pretrain meta-llama/Meta-Llama-3-8B --dataset Open-Orca/OpenOrca \
        --input_key question --output_key response --max_len 2048 --max_samples 500000 \
        --train_batch_size 256 --micro_train_batch_size 2 --max_epochs 1 --learning_rate 5e-6 \
        --zero_stage 2 --bf16 --flash_attn --gradient_checkpointing --packing_samples
    sbatch slurm/sft_8b.sh                              # Slurm, several nodes
    bash slurm/pipeline_8b.sh                           # Slurm: SFT -> reward model -> PPO, dependent jobs
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
@orl.openrlhf_flags("train_sft")  # OpenRLHF's other flags, and its defaults with --pretrain
def main(
    pretrain: o.Pretrain = None,
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
    eval_split: o.EvalSplit = "train",
    input_key: o.InputKey = "input",
    output_key: o.OutputKey = None,
    input_template: o.SFTInputTemplate = None,
    apply_chat_template: o.ApplyChatTemplate = False,
    tokenizer_chat_template: o.TokenizerChatTemplate = None,
    multiturn: o.Multiturn = False,
    pretrain_mode: o.PretrainMode = False,
    max_len: o.MaxLen = 128,
    max_samples: o.MaxSamples = None,
    max_epochs: o.MaxEpochs = 1,
    max_steps: o.MaxSteps = 800,
    train_batch_size: o.TrainBatchSize = 32,
    micro_train_batch_size: o.MicroTrainBatchSize = 32,
    learning_rate: o.LearningRate = 3e-3,
    lr_warmup_ratio: o.WarmupRatio = 0.05,
    lr_scheduler: o.LRScheduler = "cosine_with_min_lr",
    l2: o.WeightDecay = 0.0,
    adam_betas: o.AdamBetas = (0.9, 0.98),
    max_norm: o.MaxNorm = 1.0,
    seed: o.Seed = 42,
    skip_nonfinite_updates: o.SkipNonfiniteUpdates = False,
    packing_samples: o.PackingSamples = False,
    zero_stage: o.ZeroStage = 2,
    adam_offload: o.AdamOffload = False,
    adam_offload_ratio: o.AdamOffloadRatio = 1.0,
    local_rank: o.LocalRank = -1,
    save_path: o.SavePath = "./output/sft",
    save_steps: o.SaveSteps = -1,
    logging_steps: o.LoggingSteps = 1,
    eval_steps: o.EvalSteps = 100,
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
        # OpenRLHF's default template wraps plain-text prompts unless the user gives another ('' = none)
        template_notes(dict(options, input_template=input_template or None))
        require(not multiturn or apply_chat_template or dataset is None, "--multiturn trains on every assistant "
                "turn of a conversation: add --apply_chat_template (the conversations are message lists)")
        require(not (multiturn and pretrain_mode), "--multiturn and --pretrain_mode: pretraining mode trains on "
                "every token already; drop one")
        require(zero_stage in (0, 1, 2, 3), f"--zero_stage {zero_stage}: DeepSpeed ZeRO has stages 0, 1, 2 and 3")
        o.check_precision(options)
        require(train_batch_size % micro_train_batch_size == 0,
                f"--train_batch_size {train_batch_size} must be a multiple of --micro_train_batch_size {micro_train_batch_size}")
        train(o.typed(options, main, "SFTOptions"))  # a misspelt option is an AttributeError


def sft_loss(model, batch: dict, step_tokens: float, *, packing: bool = False, flash: bool = False):
    """This micro-batch's share of the step's token-mean NLL over its loss tokens, and the NLL sum.

    batch: input_ids, attention_mask, loss_mask [b, t] (common.data.sft.collate_sft). `step_tokens`:
    the step's loss tokens over all micro-batches and ranks, divided by the number of ranks, so the
    shares, backpropagated unscaled and averaged over the ranks, make the step's token mean."""
    from common.algo.losses import aggregate, masked_sum
    from common.algo.packing import next_token_logprobs

    token_lp = next_token_logprobs(model, batch["input_ids"], batch["attention_mask"], packing=packing, flash=flash)
    mask = batch["loss_mask"][:, 1:]  # [b, t-1]: a token's loss sits at the position that predicts it
    return aggregate(-token_lp, mask, "token_mean", step_tokens=step_tokens), masked_sum(-token_lp.detach(), mask)


def train(a: o.Options) -> None:
    from common import cpu_threads
    cpu_threads.configure()  # before torch: OpenMP reads its wait policy once, when it loads
    import torch

    from common.training import ds
    from common.training import updates
    from common.training.checkpoint import Preemption, latest_checkpoint, load_checkpoint, save_checkpoint
    from common.data.rows import iterate_batches
    from common.logger import MetricsLogger, git_commit, versions
    from common.training.lora import LoraSettings, apply_lora, quantization
    from common.training.models import attn_implementation, load_causal_lm, load_tokenizer, max_len_note, resolve_pretrain
    from common.data.prompts import set_chat_template
    from common.rollout.decode import hf_generate
    from common.data.sft import OPENRLHF_SFT_TEMPLATE, SFTKeys, collate_sft, load_sft_data

    dist = ds.setup_distributed()
    torch.manual_seed(a.seed)
    dtype, dtype_note = ds.resolve_dtype(a.bf16, dist.device)
    attn, attn_note = attn_implementation(a.flash_attn)
    flash = attn == "flash_attention_2"
    settings = ds.DSSettings.from_options(a, bf16=dtype == torch.bfloat16)
    accum = ds.grad_accumulation(settings, dist.world_size)

    # ---- data: the built-in copy task (chat messages) unless --dataset is given
    pretrain = resolve_pretrain(a.pretrain)
    tokenizer = load_tokenizer(pretrain)
    set_chat_template(tokenizer, a.tokenizer_chat_template)
    t = a.input_template
    keys = SFTKeys(input_key=a.input_key, output_key=a.output_key, apply_chat_template=a.apply_chat_template,
                   input_template=OPENRLHF_SFT_TEMPLATE if t is None else (t or None), multiturn=a.multiturn,
                   pretrain_mode=a.pretrain_mode, max_len=a.max_len)
    train_set, train_src, eval_set, eval_src, notes = load_sft_data(
        a.dataset, a.eval_dataset, tokenizer, keys, max_samples=a.max_samples, dataset_probs=a.dataset_probs,
        dataset_split=a.dataset_split, eval_split=a.eval_split, seed=a.seed)
    B = a.train_batch_size
    if len(train_set) < B:
        raise UserError(f"{train_src}: {len(train_set)} samples is fewer than one batch (--train_batch_size {B})")
    steps_per_epoch = len(train_set) // B
    total_steps = a.max_steps or steps_per_epoch * a.max_epochs

    # ---- model
    ds_cfg = ds.train_config(settings, dist.world_size, dtype)
    _keep = ds.zero3_loading(ds_cfg)  # noqa: F841  (must outlive from_pretrained)
    lora = LoraSettings.from_options(a)
    if a.pretrain is None and not lora.on:  # the built-in: an untrained model, so that learning the task shows
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pretrain), attn_implementation=attn,
                                                 dtype=torch.float32)
        model.config.use_cache = False
        notes.append("built-in: the tiny model's architecture and tokenizer, freshly initialised (--seed)")
    else:  # an adapter needs a trained base: with --lora_rank the built-in is the tiny model as built
        model = load_causal_lm(pretrain, dtype=torch.float32, attn_impl=attn, **quantization(lora, dist.device))
    lora_note = apply_lora(model, lora) if lora.on else None
    if a.use_liger_kernel:
        from common.training.liger import apply_liger

        notes.append(apply_liger(model, dist.device))
    notes.append(max_len_note(model.config, a.max_len))
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
                        tensorboard_dir=a.use_tensorboard, plot_keys=("train/loss", "eval/loss", "eval/exact_match"),
                        title="SFT", start_step=state["step"] + 1, append=bool(resume_from))
    mode = "all tokens (--pretrain_mode)" if a.pretrain_mode else "every assistant turn" if a.multiturn else "response"
    log.banner("hybridrl train_sft", {
        "run": {"model": pretrain if a.pretrain or lora.on else f"{pretrain} (untrained copy)", "loss on": mode,
                **({"LoRA": lora_note} if lora_note else {}),
                "data": f"{train_src} ({len(train_set)} samples)",
                "eval": f"{eval_src} ({len(eval_set)} samples)" if eval_set else "none",
                "world size": dist.world_size, "device": dist.device.type, "dtype": str(dtype).replace("torch.", ""),
                "zero stage": a.zero_stage, "batch": f"{B} = {a.micro_train_batch_size} x {accum} accum x {dist.world_size} ranks",
                "steps": total_steps, "resumed from": resume_from or "-", "output": a.save_path, "git": git_commit()},
        "versions": versions()})
    if a.packing_samples and not flash:
        notes.append("--packing_samples without flash-attention: SDPA with a block-diagonal mask, whose memory grows "
                     "with the square of the packed length (--flash_attn on a GPU needs none)")
    for note in (dtype_note, attn_note, ds.zero_note(a.zero_stage, dist.world_size, dist.device), *notes):
        if note:
            log.warn_once(note, note)

    def device_batch(examples) -> dict:
        return {k: v.to(dist.device) for k, v in collate_sft(examples, tokenizer.pad_token_id).items()}

    def all_sum(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if dist.world_size > 1:
            t = t.to(dist.device)
            torch.distributed.all_reduce(t)
        return t.cpu().tolist()

    def evaluate() -> dict:
        """Held-out token-mean loss and, on the built-in task, greedy exact-match of the response."""
        engine.eval()
        # whole shards: under ZeRO-3 every rank must run the same number of forward passes
        n = len(eval_set) // dist.world_size * dist.world_size
        mine, micro = eval_set[dist.rank:n:dist.world_size], a.micro_train_batch_size
        nll = tokens = hits = 0.0
        with torch.no_grad():
            for i in range(0, len(mine), micro):
                batch = device_batch(mine[i: i + micro])
                nll += sft_loss(engine, batch, 1.0, packing=a.packing_samples, flash=flash)[1].item()
                tokens += batch["loss_mask"][:, 1:].sum().item()
            if a.dataset is None:  # free-form answers of a user's data have no one right string
                module = ds.unwrap(engine)
                module.config.use_cache = True
                answers = [e.ids[e.prompt_len:] for e in mine]
                out = hf_generate(module, [e.ids[:e.prompt_len] for e in mine], n=1, temperature=1.0, top_p=1.0,
                                  max_new_tokens=max(len(x) for x in answers) + 2, eos_id=tokenizer.eos_token_id,
                                  pad_id=tokenizer.pad_token_id, micro_batch=64, greedy=True,
                                  synced_gpus=a.zero_stage == 3 and dist.world_size > 1)
                module.config.use_cache = False
                text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
                hits = sum(text(r) == text(x) for r, x in zip(out.response_ids, answers))
        nll, tokens, hits = all_sum([nll, tokens, hits])
        engine.train()
        out = {"eval/loss": nll / max(tokens, 1.0)}
        if a.dataset is None:
            out["eval/exact_match"] = hits / n
        return out

    # ---- train
    per_rank = B // dist.world_size
    micro = a.micro_train_batch_size
    gas = engine.gradient_accumulation_steps()
    step, skipped = state["step"], state.get("skipped_updates", 0)  # older checkpoints have no count
    batches = iterate_batches(len(train_set), B, a.seed, start_epoch=state["epoch"], start_step=state["step_in_epoch"])
    if eval_set and not resume_from:
        log.log(0, evaluate())  # the starting point of the eval curves
    preempt = Preemption()
    engine.train()
    while step < total_steps:
        epoch, step_in_epoch, idx = next(batches)
        t0 = time.perf_counter()
        mine = [train_set[i] for i in idx[dist.rank * per_rank: (dist.rank + 1) * per_rank]]
        # the step's loss tokens over all ranks, known before any forward pass: one all-reduce per step
        step_tokens = all_sum([sum(sum(e.loss_mask[1:]) for e in mine)])[0]
        nll_sum, seq_tokens = 0.0, 0
        for i in range(0, per_rank, micro):
            batch = device_batch(mine[i: i + micro])
            loss, nll = sft_loss(engine, batch, step_tokens / dist.world_size, packing=a.packing_samples, flash=flash)
            if not torch.isfinite(loss) and not a.skip_nonfinite_updates:  # stop before a NaN reaches the weights
                raise TrainingError(f"step {step + 1}: the SFT loss is {loss.item()}; lower the learning rate "
                                    "or check the data, or pass --skip_nonfinite_updates to skip such updates "
                                    "(nothing after the last checkpoint was saved)")
            # Every rank runs backward, a non-finite loss included (ZeRO's collectives need all ranks);
            # its NaN gradients make DeepSpeed skip the update on every rank.
            engine.backward(updates.poison_nonfinite(loss) * gas)  # DeepSpeed divides by gas; the shares add up
            engine.step()
            nll_sum += nll.item()
            seq_tokens += batch["attention_mask"].sum().item()
        skipped += updates.update_skipped(engine, allow=a.skip_nonfinite_updates, who=f"step {step + 1}: the model",
                                          fix="Lower the learning rate or check the data (nothing after the last "
                                          "checkpoint was saved)")
        nll_sum, seq_tokens = all_sum([nll_sum, seq_tokens])
        step += 1
        grad_norm = engine.get_global_grad_norm()
        dt = time.perf_counter() - t0
        metrics = {"train/loss": nll_sum / max(step_tokens, 1.0), "train/loss_tokens": step_tokens,
                   "train/lr": engine.get_lr()[0], "train/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                   "time/step_s": dt, "perf/tokens_per_s": seq_tokens / dt, "train/epoch": epoch}
        if a.skip_nonfinite_updates:
            metrics["train/skipped_updates"] = skipped
        if dist.device.type == "cuda":
            metrics["mem/peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        last = step == total_steps
        epoch_end = step_in_epoch + 1 == steps_per_epoch
        if eval_set and ((a.eval_steps > 0 and step % a.eval_steps == 0) or
                         (a.eval_steps <= 0 and epoch_end) or last):
            metrics.update(evaluate())
        if step % a.logging_steps == 0 or last or "eval/loss" in metrics:
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

    ds.save_hf(engine, tokenizer, a.save_path, dist.rank)
    log.end({"model": a.save_path})


if __name__ == "__main__":
    app()
