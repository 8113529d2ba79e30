"""Shared Typer option types: one `Annotated` alias per option, spelled as in OpenRLHF's commands.

Each script declares the options it uses with its own defaults, e.g.
`save_path: o.SavePath = "./output/rm"`. Every flag keeps the reference spelling
(`--micro_train_batch_size`) and takes the dashed spelling as an alias. This module must stay
light: `--help` imports it and must not import torch.
"""
from __future__ import annotations

from typing import Annotated, Optional

import typer

MODEL, DATA, ROLLOUT, ALGO = "Model", "Data", "Rollout (vLLM)", "Algorithm"
OPTIM, DS, CLUSTER, LOG = "Optimization", "DeepSpeed", "Cluster (Ray)", "Logging & checkpoints"


def opt(name: str, help: str, panel: str, **kw) -> typer.models.OptionInfo:
    """An option named `--name` with the dashed alias `--na-me` (when it differs)."""
    names = [f"--{name}"]
    if "_" in name:
        names.append(f"--{name.replace('_', '-')}")
    return typer.Option(*names, help=help, rich_help_panel=panel, **kw)


def flag(name: str, help: str, panel: str) -> typer.models.OptionInfo:
    return opt(name, help, panel)


# --- Model -------------------------------------------------------------------------------------
Pretrain = Annotated[Optional[str], opt("pretrain", "Model folder or hub id to start from (default: the built-in tiny model).", MODEL)]
RewardPretrain = Annotated[Optional[str], opt("reward_pretrain", "Reward model folder (train_rm.py's output) or hub id.", MODEL)]
CriticPretrain = Annotated[Optional[str], opt("critic_pretrain", "Critic initialisation (default: the reward model, else --pretrain).", MODEL)]
RefPretrain = Annotated[Optional[str], opt("ref_pretrain", "Reference model (default: --pretrain).", MODEL)]
BF16 = Annotated[bool, flag("bf16", "bf16 weights and compute with fp32 master weights (fp32 on a CPU without native bf16, said once).", MODEL)]
FlashAttn = Annotated[bool, flag("flash_attn", "Use flash-attention 2 where installed (otherwise PyTorch SDPA, said once).", MODEL)]
GradCkpt = Annotated[bool, flag("gradient_checkpointing", "Recompute activations in the backward pass to save memory.", MODEL)]

# --- Data --------------------------------------------------------------------------------------
Dataset = Annotated[Optional[str], opt("dataset", "Training data: .jsonl/.json/.parquet/.csv file, a datasets folder, or a hub id (default: the built-in task).", DATA)]
EvalDataset = Annotated[Optional[str], opt("eval_dataset", "Held-out data in the same format (default: the built-in task's held-out split, or none).", DATA)]
ChosenKey = Annotated[str, opt("chosen_key", "Column holding the preferred response.", DATA)]
RejectedKey = Annotated[str, opt("rejected_key", "Column holding the rejected response.", DATA)]
PromptKey = Annotated[Optional[str], opt("prompt_key", "Column holding the prompt (default: the conversation before the last message).", DATA)]
InputKey = Annotated[str, opt("input_key", "Column holding the prompt.", DATA)]
LabelKey = Annotated[Optional[str], opt("label_key", "Column holding the label passed to the reward function.", DATA)]
ApplyChatTemplate = Annotated[bool, flag("apply_chat_template", "Render prompts and message lists with the tokenizer's chat template.", DATA)]
MaxLen = Annotated[int, opt("max_len", "Maximum tokens per sequence (prompt + response).", DATA, min=4)]
MaxSamples = Annotated[Optional[int], opt("max_samples", "Use only the first N rows.", DATA, min=1)]
PromptData = Annotated[Optional[str], opt("prompt_data", "Prompt data for online RL (default: the built-in task).", DATA)]
PromptMaxLen = Annotated[int, opt("prompt_max_len", "Prompts longer than this (tokens) are dropped and counted.", DATA, min=1)]
GenerateMaxLen = Annotated[int, opt("generate_max_len", "Maximum new tokens per response.", DATA, min=1)]

# --- Optimization ------------------------------------------------------------------------------
LearningRate = Annotated[float, opt("learning_rate", "Peak learning rate.", OPTIM, min=0.0)]
ActorLR = Annotated[float, opt("actor_learning_rate", "Actor peak learning rate.", OPTIM, min=0.0)]
CriticLR = Annotated[float, opt("critic_learning_rate", "Critic peak learning rate.", OPTIM, min=0.0)]
MaxEpochs = Annotated[int, opt("max_epochs", "Passes over the data (RL: PPO epochs per rollout batch).", OPTIM, min=1)]
NumEpisodes = Annotated[int, opt("num_episodes", "Passes over the prompt data.", OPTIM, min=1)]
MaxSteps = Annotated[Optional[int], opt("max_steps", "Stop after this many optimizer steps (default: run out the epochs).", OPTIM, min=1)]
TrainBatchSize = Annotated[int, opt("train_batch_size", "Global batch per optimizer step (all ranks, all accumulation steps).", OPTIM, min=1)]
MicroTrainBatchSize = Annotated[int, opt("micro_train_batch_size", "Batch per rank per forward/backward.", OPTIM, min=1)]
WarmupRatio = Annotated[float, opt("lr_warmup_ratio", "Fraction of steps with linear warm-up.", OPTIM, min=0.0, max=1.0)]
LRScheduler = Annotated[str, opt("lr_scheduler", "cosine_with_min_lr | linear | constant_with_warmup | cosine.", OPTIM)]
WeightDecay = Annotated[float, opt("l2", "AdamW weight decay.", OPTIM, min=0.0)]
AdamBetas = Annotated[tuple[float, float], opt("adam_betas", "AdamW betas.", OPTIM)]
MaxNorm = Annotated[float, opt("max_norm", "Gradient clipping norm (0 = off).", OPTIM, min=0.0)]
Seed = Annotated[int, opt("seed", "Random seed (data order, sampling, init of new heads).", OPTIM)]

# --- DeepSpeed ---------------------------------------------------------------------------------
ZeroStage = Annotated[int, opt("zero_stage", "DeepSpeed ZeRO stage 0-3.", DS)]
AdamOffload = Annotated[bool, flag("adam_offload", "Keep Adam states in CPU memory (DeepSpeedCPUAdam).", DS)]
LocalRank = Annotated[int, typer.Option("--local_rank", "--local-rank", hidden=True, help="Set by the deepspeed launcher.")]
DeepSpeedSleep = Annotated[bool, flag("deepspeed_enable_sleep", "Offload DeepSpeed states between phases (hybrid engine).", DS)]

# --- Logging & checkpoints ---------------------------------------------------------------------
SavePath = Annotated[str, opt("save_path", "Output folder: final model (Hugging Face format), metrics.jsonl, config.json, curves.png.", LOG)]
SaveSteps = Annotated[int, opt("save_steps", "Save a resumable checkpoint every N steps (-1 = never).", LOG)]
LoggingSteps = Annotated[int, opt("logging_steps", "Log metrics every N steps.", LOG, min=1)]
EvalSteps = Annotated[int, opt("eval_steps", "Evaluate every N steps (-1 = at the end of each epoch).", LOG)]
CkptPath = Annotated[Optional[str], opt("ckpt_path", "Folder for resumable checkpoints (default: <save_path>/checkpoints).", LOG)]
MaxCkptNum = Annotated[int, opt("max_ckpt_num", "Keep at most this many checkpoints (the newest good one is never deleted).", LOG, min=1)]
LoadCheckpoint = Annotated[bool, flag("load_checkpoint", "Resume from the latest checkpoint in --ckpt_path if there is one.", LOG)]
UseWandb = Annotated[bool, flag("use_wandb", "Log to Weights & Biases (key from WANDB_API_KEY).", LOG)]
WandbProject = Annotated[str, opt("wandb_project", "wandb project.", LOG)]
WandbRunName = Annotated[Optional[str], opt("wandb_run_name", "wandb run name.", LOG)]
UseTensorboard = Annotated[Optional[str], opt("use_tensorboard", "Write TensorBoard logs to this folder.", LOG)]

# --- Algorithm (reward model / DPO) ------------------------------------------------------------
RMLoss = Annotated[str, opt("loss", "Reward-model loss: sigmoid (Bradley-Terry, optional margin) or logexp.", ALGO)]
MarginKey = Annotated[str, opt("margin_key", "Column with a per-pair margin for the Bradley-Terry loss (used when present).", DATA)]
Beta = Annotated[float, opt("beta", "DPO temperature: strength of the implicit KL to the reference.", ALGO, min=0.0)]
LabelSmoothing = Annotated[float, opt("label_smoothing", "Conservative DPO: assumed fraction of flipped labels.", ALGO, min=0.0, max=0.5)]
IPO = Annotated[bool, flag("ipo", "Use the IPO loss instead of DPO's log-sigmoid.", ALGO)]
NLLLossCoef = Annotated[float, opt("nll_loss_coef", "Weight of an NLL term on the chosen responses (RPO).", ALGO, min=0.0)]
