"""Shared Typer option types: one `Annotated` alias per option, spelled as in OpenRLHF's commands.

Each script declares the options it uses with its own defaults, e.g.
`save_path: o.SavePath = "./output/rm"`. Every flag keeps the reference spelling
(`--micro_train_batch_size`). This module must stay
light: `--help` imports it and must not import torch.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, Literal, Optional

import typer


# `--help` that reads at any width (a pipe, a Slurm log, an 80-column terminal). Typer's rich help lays the
# options out as a table that squeezes every column to fit, so at 80 columns the flag names themselves were
# cut (`--micro_train_batch_s…`), and boolean flags showed a `<bool>` value they do not take. Here the name
# column never wraps or shrinks; the type and help columns take what width is left and wrap.
_help_done = False


def _one_line(e) -> None:
    """A bad value or an unknown flag: `error: ...`, as the scripts' own checks print (exit 2 stays click's)."""
    import sys

    if type(e).__name__ != "NoArgsIsHelpError":
        print(f"error: {e.format_message()} (--help lists the flags)", file=sys.stderr)


def _install_help() -> None:
    """Patch typer's help rendering once per process (only our scripts' apps live in it)."""
    global _help_done
    if _help_done:
        return
    _help_done = True
    try:
        from rich.table import Table
        from rich.text import Text
        from typer import core, rich_utils
    except ImportError:  # a typer without rich help: nothing to mend
        return
    if not hasattr(rich_utils, "Table"):
        return

    class WholeNames(Table):
        def add_row(self, *cells, **kw):
            for cell in cells:
                for part in getattr(cell, "renderables", [cell]):  # typer's help cell: Columns of Texts
                    if isinstance(part, Text):
                        part.overflow = "fold"
            super().add_row(*cells, **kw)
            self.columns[0].no_wrap = True  # the flag name: never cut
            for column in self.columns[1:]:
                column.overflow = "fold"  # a long word (a flag named in the help) breaks rather than ends in "…"

    rich_utils.Table = WholeNames
    if hasattr(rich_utils, "rich_format_error"):
        rich_utils.rich_format_error = _one_line
    shown = getattr(core.TyperOption, "display_type_rich", None)

    def display_type_rich(self, ctx):
        if self.is_flag and not self.count:
            return None  # a flag takes no value
        if self.nargs > 1:
            one = shown(self, ctx).removesuffix("...").strip("<>").split(",")
            return " ".join(f"<{t}>" for t in one) if len(one) == self.nargs else f"<{one[0]}> x{self.nargs}"
        return shown(self, ctx)

    if shown is not None:  # older typers (the GPU image's) show no type for flags anyway
        core.TyperOption.display_type_rich = display_type_rich


_install_help()  # every script's --help: whole flag names at any width

MODEL, DATA, ROLLOUT, ALGO = "Model", "Data", "Rollout (vLLM)", "Algorithm"
OPTIM, DS, CLUSTER, LOG = "Optimization", "DeepSpeed", "Cluster (Ray)", "Logging & checkpoints"
LORA = "LoRA"


def opt(name: str, help: str, panel: str, **kw) -> typer.models.OptionInfo:
    """An option spelled `--name` exactly (no dashed alias: it would double the width of --help)."""
    return typer.Option(f"--{name}", help=help, rich_help_panel=panel, **kw)


def flag(name: str, help: str, panel: str) -> typer.models.OptionInfo:
    return opt(name, help, panel)


# --- Model -------------------------------------------------------------------------------------
Pretrain = Annotated[Optional[str], opt("pretrain", "Model folder or hub id to start from (default: the built-in tiny model).", MODEL)]
RewardPretrain = Annotated[Optional[str], opt("reward_pretrain", "Reward model folder (train_rm.py's or OpenRLHF's output) or hub id.", MODEL)]
CriticPretrain = Annotated[Optional[str], opt("critic_pretrain", "Critic initialisation (default: the reward model, else --pretrain).", MODEL)]
ValueHeadPrefix = Annotated[str, opt("value_head_prefix", "Attribute name of the reward model's / critic's value head, as in OpenRLHF; a folder's config.json value_head_prefix wins over it, and a new head (train_rm.py from an LM) is saved under it.", MODEL)]
RefPretrain = Annotated[Optional[str], opt("ref_pretrain", "Reference model (default: --pretrain).", MODEL)]
BF16 = Annotated[bool, flag("bf16", "bf16 weights and compute with fp32 master weights (fp32 on a CPU without native bf16, said once).", MODEL)]
TorchAutocast = Annotated[bool, flag("torch_autocast", "With --bf16: fp32 weights, forward under torch.autocast (DeepSpeed's torch_autocast, as HF Trainer does) instead of bf16 weights plus an fp32 master copy; less memory, faster on one GPU.", MODEL)]
TorchCompile = Annotated[bool, flag("torch_compile", "torch.compile each transformer block of the trained and frozen models (compiled once, seconds); not with --zero_stage 3.", MODEL)]
FlashAttn = Annotated[bool, flag("flash_attn", "Use flash-attention 2 where installed (otherwise PyTorch SDPA, said once).", MODEL)]
GradCkpt = Annotated[bool, flag("gradient_checkpointing", "Recompute activations in the backward pass to save memory.", MODEL)]
UseLigerKernel = Annotated[bool, flag("use_liger_kernel", "On a GPU with liger-kernel installed (the gpu extra): its fused Triton kernels (RMSNorm, RoPE, SwiGLU) in the trained policy; elsewhere not used, said once.", MODEL)]

# --- LoRA --------------------------------------------------------------------------------------
LoraRank = Annotated[int, opt("lora_rank", "LoRA adapter rank; 0 trains every weight. With a rank the base model is frozen (no Adam state for it), the reference is the policy with its adapter off (no second copy), and the saved model is the adapter in peft's format (python -m common.training.lora merges it).", LORA, min=0)]
LoraAlpha = Annotated[int, opt("lora_alpha", "LoRA scale numerator: the adapter's update is scaled by lora_alpha / lora_rank.", LORA, min=1)]
TargetModules = Annotated[Optional[list[str]], opt("target_modules", "Layers that get an adapter, by name, several after one flag as in OpenRLHF (--target_modules q_proj v_proj); default all-linear: every linear layer but the output head.", LORA, show_default="all-linear")]
LoraDropout = Annotated[float, opt("lora_dropout", "Dropout on the adapter's input.", LORA, min=0.0, max=1.0)]
LoadIn4bit = Annotated[bool, flag("load_in_4bit", "QLoRA: the frozen base in 4-bit NF4 (double quantisation, bf16 compute) through bitsandbytes, on CUDA GPUs; needs --lora_rank.", LORA)]


# --- Data --------------------------------------------------------------------------------------
Dataset = Annotated[Optional[str], opt("dataset", "Training data: .jsonl/.json/.parquet/.csv file, a datasets folder, or a hub id (name@data_dir for a subfolder); several comma-separated are concatenated, or mixed with --dataset_probs (default: the built-in task).", DATA)]
EvalDataset = Annotated[Optional[str], opt("eval_dataset", "Held-out data in the same format, several comma-separated concatenated (default: the built-in task's held-out split, or none).", DATA)]
DatasetProbs = Annotated[Optional[str], opt("dataset_probs", "Mix the comma-separated --dataset sources with these probabilities (0.7,0.3; sum 1), OpenRLHF's way: rows drawn at random by --seed until every source is used up once, the smaller ones repeating (docs/openrlhf.md).", DATA)]
DatasetSplit = Annotated[str, opt("dataset_split", "Split of a hub dataset or datasets folder to train on (a single file is one split).", DATA)]
EvalSplit = Annotated[str, opt("eval_split", "Split of --eval_dataset to evaluate on (a single file is one split).", DATA)]
InputTemplate = Annotated[Optional[str], opt("input_template", "Without --apply_chat_template: wrap each plain-text prompt, '{}' standing for it (str.format: 'Q: {}\\nA: ').", DATA)]
TokenizerChatTemplate = Annotated[Optional[str], opt("tokenizer_chat_template", "A Jinja chat template that replaces the tokenizer's for --apply_chat_template (saved with the model).", DATA)]
ChosenKey = Annotated[str, opt("chosen_key", "Column holding the preferred response.", DATA)]
RejectedKey = Annotated[str, opt("rejected_key", "Column holding the rejected response.", DATA)]
PromptKey = Annotated[Optional[str], opt("prompt_key", "Column holding the prompt (default: the conversation before the last message).", DATA)]
InputKey = Annotated[str, opt("input_key", "Column holding the prompt.", DATA)]
LabelKey = Annotated[Optional[str], opt("label_key", "Column holding the label passed to the reward function.", DATA)]
OutputKey = Annotated[Optional[str], opt("output_key", "SFT: column holding the response (default: none; the --input_key column holds the whole conversation, whose last message is the response).", DATA)]
SFTInputTemplate = Annotated[Optional[str], opt("input_template", "Without --apply_chat_template: wrap each plain-text prompt, '{}' standing for it (str.format). Default: OpenRLHF's 'User: {}\\nAssistant: '; '' for none.", DATA)]
Multiturn = Annotated[bool, flag("multiturn", "SFT on whole conversations (with --apply_chat_template): the loss covers every assistant turn, not only the last.", DATA)]
PretrainMode = Annotated[bool, flag("pretrain_mode", "Continued pretraining: the loss covers every token of the text (no prompt masking, no --input_template).", ALGO)]
ApplyChatTemplate = Annotated[bool, flag("apply_chat_template", "Render prompts and message lists with the tokenizer's chat template.", DATA)]
MaxLen = Annotated[int, opt("max_len", "Maximum tokens per sequence (prompt + response).", DATA, min=4)]
MaxSamples = Annotated[Optional[int], opt("max_samples", "Use only the first N rows.", DATA, min=1)]
PromptData = Annotated[Optional[str], opt("prompt_data", "Prompt data for online RL, in --dataset's formats; several comma-separated are concatenated, or mixed with --prompt_data_probs (default: the built-in task).", DATA)]
PromptDataProbs = Annotated[Optional[str], opt("prompt_data_probs", "Mix the comma-separated --prompt_data sources with these probabilities, as --dataset_probs does.", DATA)]
PromptSplit = Annotated[str, opt("prompt_split", "Split of a hub dataset or datasets folder to take prompts from.", DATA)]
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
LRScheduler = Annotated[Literal["cosine_with_min_lr", "linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt", "warmup_stable_decay", "cosine_warmup_with_min_lr"],
                        opt("lr_scheduler", "Learning-rate schedule (transformers' get_scheduler names).", OPTIM)]
WeightDecay = Annotated[float, opt("l2", "AdamW weight decay.", OPTIM, min=0.0)]
AdamBetas = Annotated[tuple[float, float], opt("adam_betas", "AdamW betas.", OPTIM)]
MaxNorm = Annotated[float, opt("max_norm", "Gradient clipping norm (0 = off).", OPTIM, min=0.0)]
Seed = Annotated[int, opt("seed", "Random seed (data order, sampling, init of new heads).", OPTIM)]
MinLRRatio = Annotated[float, opt("min_lr_ratio", "cosine_with_min_lr decays to --learning_rate x this.", OPTIM, min=0.0, max=1.0)]
SkipNonfiniteUpdates = Annotated[bool, flag("skip_nonfinite_updates", "Skip an optimizer update whose loss or gradients are not finite and count it in train/skipped_updates, instead of stopping.", OPTIM)]

# --- DeepSpeed ---------------------------------------------------------------------------------
ZeroStage = Annotated[int, opt("zero_stage", "DeepSpeed ZeRO stage 0-3.", DS)]
AdamOffload = Annotated[bool, flag("adam_offload", "Keep Adam states in CPU memory (DeepSpeedCPUAdam).", DS)]
AdamOffloadRatio = Annotated[float, opt("adam_offload_ratio", "With --adam_offload under --zero_stage 3: the share of the optimizer's sub-groups kept in CPU memory (DeepSpeed's offload_optimizer.ratio); the rest step on the GPU. 1 = all, as OpenRLHF's --adam_offload (it has no such flag). A 7B model's full offload needs ~137 GB of host memory; 0.5 ran on one H200 with a 125 GiB host (docs/performance.md).", DS, min=0.0, max=1.0)]
LocalRank = Annotated[int, typer.Option("--local_rank", hidden=True, help="Set by the deepspeed launcher.")]
DeepSpeedSleep = Annotated[bool, flag(
    "deepspeed_enable_sleep", "Offload DeepSpeed states while vLLM generates (hybrid engine): Adam moments, fp32 master "
    "weights and gradients, as OpenRLHF (the bf16 weights stay). With --adam_offload, where OpenRLHF does not sleep, "
    "ours moves what DeepSpeed keeps on the GPU, weights included.", DS)]
RefOffload = Annotated[bool, flag("ref_offload", "Keep the reference model's weights in CPU memory: ZeRO-3 streams them to the GPU layer by layer, other stages copy the model over for each of its forward passes.", DS)]
RefRewardOffload = Annotated[bool, flag("ref_reward_offload", "Keep the reference and reward models' weights in CPU memory: ZeRO-3 streams them to the GPU layer by layer, other stages copy each model over for its forward passes of a step.", DS)]

# --- Logging & checkpoints ---------------------------------------------------------------------
SavePath = Annotated[str, opt("save_path", "Output folder: final model (Hugging Face format), metrics.jsonl, config.json, curves.png.", LOG)]
SaveSteps = Annotated[int, opt("save_steps", "Save a resumable checkpoint every N steps (-1 = never).", LOG)]
LoggingSteps = Annotated[int, opt("logging_steps", "Log metrics every N steps.", LOG, min=1)]
EvalSteps = Annotated[int, opt("eval_steps", "Evaluate every N steps (the RL scripts from step 0, the starting policy; -1 = at the end of each epoch: in the RL scripts each pass over the prompts, where OpenRLHF's -1 means never; the last step always).", LOG)]
EvalTemperature = Annotated[float, opt("eval_temperature", "Sampling temperature of the RL evaluations.", LOG, min=0.0)]
EvalNSamples = Annotated[int, opt("eval_n_samples_per_prompt", "Answers sampled per held-out prompt: eval/pass@k for k up to this (Chen et al.'s unbiased estimator).", LOG, min=1)]
EvalCorrectThreshold = Annotated[float, opt("eval_correct_threshold", "A sampled answer counts as correct in eval/pass@k when its reward is >= this (1.0: full marks of a 0-1 rule such as the built-in task's exact copy); a reward function that returns {\"rewards\", \"pass\"} decides itself.", LOG)]
BestMetricKey = Annotated[str, opt("best_metric_key", "Keep the checkpoint of the best evaluation by this metric in <ckpt_path>/best (empty: eval/pass@1; none: keep none).", LOG)]
CkptPath = Annotated[Optional[str], opt("ckpt_path", "Folder for resumable checkpoints (default: <save_path>/checkpoints).", LOG)]
MaxCkptNum = Annotated[int, opt("max_ckpt_num", "Keep at most this many checkpoints (the newest good one is never deleted).", LOG, min=1)]
LoadCheckpoint = Annotated[bool, flag("load_checkpoint", "Resume from the latest checkpoint in --ckpt_path if there is one.", LOG)]
UseWandb = Annotated[Optional[str], opt("use_wandb", "Log to Weights & Biases: --use_wandb KEY (OpenRLHF's form: the key goes to WANDB_API_KEY for this run and is never written down) or --use_wandb env (the key already in WANDB_API_KEY).", LOG)]
WandbProject = Annotated[str, opt("wandb_project", "wandb project.", LOG)]
WandbRunName = Annotated[Optional[str], opt("wandb_run_name", "wandb run name.", LOG)]
UseTensorboard = Annotated[Optional[str], opt("use_tensorboard", "Write TensorBoard logs to this folder.", LOG)]

# --- Algorithm (reward model / DPO) ------------------------------------------------------------
RMLoss = Annotated[Literal["sigmoid", "logexp"], opt("loss", "Reward-model loss: sigmoid (Bradley-Terry, optional margin) or logexp.", ALGO)]
MarginKey = Annotated[str, opt("margin_key", "Column with a per-pair margin for the Bradley-Terry loss (used when present).", DATA)]
Beta = Annotated[float, opt("beta", "DPO temperature: strength of the implicit KL to the reference.", ALGO, min=0.0)]
LabelSmoothing = Annotated[float, opt("label_smoothing", "Conservative DPO: assumed fraction of flipped labels.", ALGO, min=0.0, max=0.5)]
IPO = Annotated[bool, flag("ipo", "Use the IPO loss instead of DPO's log-sigmoid.", ALGO)]
MarginLoss = Annotated[bool, flag("margin_loss", "Bradley-Terry loss with each pair's margin column (--margin_key): -log sigmoid(r_c - r_r - margin); without it margins are not used.", ALGO)]
ComputeFP32Loss = Annotated[bool, flag("compute_fp32_loss", "Compute the loss in fp32: always so here (the scores are fp32 whatever --bf16), so accepted for OpenRLHF's commands.", ALGO)]
NLLLossCoef = Annotated[float, opt("nll_loss_coef", "Weight of an NLL term on the chosen responses (RPO).", ALGO, min=0.0)]

# --- Algorithm (online RL) ---------------------------------------------------------------------
AdvantageEstimator = Annotated[Literal["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"], opt("advantage_estimator", "gae (PPO) | reinforce (REINFORCE++) | reinforce_baseline | rloo | group_norm (GRPO) | dr_grpo.", ALGO)]
NSamples = Annotated[Optional[int], opt("n_samples_per_prompt", "Responses sampled per prompt, a group (default: 8 for group estimators, else 1).", ALGO, min=1)]
InitKLCoef = Annotated[float, opt("init_kl_coef", "KL penalty coefficient (0: no reference model at all).", ALGO, min=0.0)]
KLEstimator = Annotated[Literal["k1", "k2", "k3"], opt("kl_estimator", "k1 | k2 | k3 (Schulman's estimators of KL(pi || ref)).", ALGO)]
UseKLLoss = Annotated[bool, flag("use_kl_loss", "Put the KL term in the loss (GRPO) instead of in the reward.", ALGO)]
Gamma = Annotated[float, opt("gamma", "Discount factor.", ALGO, min=0.0, max=1.0)]
Lambd = Annotated[float, opt("lambd", "GAE lambda.", ALGO, min=0.0, max=1.0)]
EpsClip = Annotated[float, opt("eps_clip", "PPO ratio clip (both sides unless --eps_clip_low_high).", ALGO, min=0.0)]
EpsClipLowHigh = Annotated[Optional[tuple[float, float]], opt("eps_clip_low_high", "Asymmetric clip: low high (DAPO's clip-higher).", ALGO)]
DualClip = Annotated[Optional[float], opt("dual_clip", "Dual-clip bound c > 1 for negative advantages.", ALGO)]
ValueClip = Annotated[Optional[float], opt("value_clip", "Clip the value update to this range around the old values.", ALGO)]
NormalizeReward = Annotated[bool, flag("normalize_reward", "OpenRLHF's: the reward model's scores and the critic's values become (r - mean) / std with the mean and std recorded in their config.json (train_rm.py records them; none: 0 and 1). Rule-based and remote rewards are not changed.", ALGO)]
NoAdvStdNorm = Annotated[bool, flag("no_advantage_std_norm", "Do not divide advantages by a std: group_norm's advantages stay r - group mean (no division by the group std; OpenRLHF's code ignores the flag there), and gae, reinforce and reinforce_baseline are only mean-centred over the batch, as in OpenRLHF. Refused with dr_grpo and rloo, which never divide by a std.", ALGO)]
EntropyLossCoef = Annotated[Optional[float], opt("entropy_loss_coef", "Entropy bonus coefficient; unset: entropy is not computed (0: computed and logged only).", ALGO)]
LossAgg = Annotated[Optional[Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]], opt("loss_agg_mode", "How per-token losses make a step's loss, over all its micro-batches and ranks: token_mean (every token alike, DAPO) | seq_mean_token_mean (each sequence's mean, then over sequences) | seq_mean_token_sum_norm (each sequence's sum / --generate_max_len, Dr. GRPO). Default: seq_mean_token_sum_norm with --advantage_estimator dr_grpo, seq_mean_token_mean with --policy_loss_type gspo, else token_mean (OpenRLHF has no such flag: its loss is each micro-batch's token mean).", ALGO)]
DynamicFiltering = Annotated[bool, flag("dynamic_filtering", "DAPO's dynamic sampling: drop prompt groups whose mean score is outside --dynamic_filtering_reward_range (the step trains on the groups left; OpenRLHF samples replacements).", ALGO)]
DynamicFilteringRange = Annotated[tuple[float, float], opt("dynamic_filtering_reward_range", "LOW HIGH: with --dynamic_filtering keep groups whose mean score is strictly between them.", ALGO)]
PolicyLossType = Annotated[Literal["ppo", "gspo"], opt("policy_loss_type", "ppo (per-token ratio) | gspo (one ratio per sequence: the geometric mean of its token ratios, Zheng et al. 2025).", ALGO)]
RewardClipRange = Annotated[tuple[float, float], opt("reward_clip_range", "LOW HIGH: clip each sequence's (baseline-shaped) reward before the KL penalty is added.", ALGO)]
OverlongBufferLen = Annotated[Optional[float], opt("overlong_buffer_len", "DAPO's overlong penalty: responses longer than --generate_max_len minus this lose up to --overlong_penalty_factor, linearly over the buffer.", ALGO)]
OverlongPenaltyFactor = Annotated[float, opt("overlong_penalty_factor", "The largest overlong penalty.", ALGO)]
StopProperlyPenalty = Annotated[Optional[float], opt("stop_properly_penalty_coef", "Truncated responses (hit --generate_max_len): a coefficient in [0, 1] multiplies their score, a negative value replaces it (ProRL).", ALGO)]
KLTarget = Annotated[Optional[float], opt("kl_target", "Adaptive KL: move the KL coefficient towards this KL (Ziegler et al. 2019); unset: fixed --init_kl_coef.", ALGO)]
KLHorizon = Annotated[int, opt("kl_horizon", "Adaptive KL horizon in samples.", ALGO, min=1)]
FreezingActorSteps = Annotated[int, opt("freezing_actor_steps", "Train only the critic for the first N steps (the actor stays as it is).", ALGO)]
PtxCoef = Annotated[float, opt("ptx_coef", "PPO-ptx pretraining loss weight: accepted at its default only (OpenRLHF's last flat CLI has no pretraining data flag to feed it either).", ALGO)]
AuxLossCoef = Annotated[float, opt("aux_loss_coef", "Mixture-of-experts load-balancing loss weight (0 only: MoE auxiliary losses are not supported yet).", ALGO)]
RewardFunc = Annotated[Optional[str], opt("reward_func", "Python file defining reward_func(prompts, completions, labels) -> list[float].", ALGO)]
AgentFuncPath = Annotated[Optional[str], opt("agent_func_path", "Multi-turn agent: a Python file defining AgentExecutor, OpenRLHF's contract (from openrlhf.utils.agent import MultiTurnAgentExecutor, AgentInstanceBase; OpenRLHF need not be installed). The reward comes from the environment's step(); needs --vllm_num_engines (docs/agents.md).", ALGO)]
MaxTurns = Annotated[int, opt("max_turns", "With --agent_func_path: end an episode after this many model turns (0: when the environment says done or the --generate_max_len budget runs out); an episode cut so is truncated.", ALGO, min=0)]
MaxTokensPerTurn = Annotated[int, opt("max_tokens_per_turn", "With --agent_func_path: new tokens per model turn at most (0: the episode's remaining budget).", ALGO, min=0)]
AgentTimeout = Annotated[float, opt("agent_timeout", "With --agent_func_path: seconds an environment's reset() or step() may take before the run stops naming it.", ALGO, min=0.0)]
AgentFeedbackRole = Annotated[Optional[str], opt("agent_feedback_role", "With --agent_func_path: wrap each environment feedback in the chat template's tokens for this role (user, tool, ...), so the file returns plain text; default: the feedback's text as it is (OpenRLHF's).", ALGO)]
RemoteRMURL = Annotated[Optional[str], opt("remote_rm_url", "HTTP reward server (POST JSON prompts/completions/labels -> rewards).", ALGO)]
SkipBadRewards = Annotated[bool, flag("skip_bad_rewards", "Drop samples whose reward failed (error, NaN, timeout) instead of stopping.", ALGO)]
RewardTimeout = Annotated[float, opt("reward_timeout", "Seconds a reward function or server may take per batch.", ALGO, min=0.1)]
Temperature = Annotated[float, opt("temperature", "Sampling temperature.", ROLLOUT, min=0.0)]
TopP = Annotated[float, opt("top_p", "Nucleus sampling.", ROLLOUT, min=0.0, max=1.0)]
RolloutBatchSize = Annotated[int, opt("rollout_batch_size", "Prompts per RL step.", ROLLOUT, min=1)]
MicroRolloutBatchSize = Annotated[int, opt("micro_rollout_batch_size", "Sequences per forward pass while generating and scoring.", ROLLOUT, min=1)]
PackingSamples = Annotated[bool, flag("packing_samples", "Pack sequences into one row without padding.", OPTIM)]
SharePromptPrefix = Annotated[bool, flag("share_prompt_prefix", "Run each prompt once per group of its samples in the actor's and the reference's forward passes, the responses attending to its keys and values: the same log-probs and gradients, fewer FLOPs when prompts are long next to responses and groups large; slower otherwise, e.g. 256-token responses to short prompts on a GPU (the critic and reward model still run whole rows). Not with --packing_samples, --gradient_checkpointing or --flash_attn.", OPTIM)]
DryRun = Annotated[bool, flag("dry_run", "Check the options, print the resource plan and exit without loading a model.", CLUSTER)]


def role_nodes(role: str):
    return Annotated[int, opt(f"{role}_num_nodes", f"Nodes for the {role} model.", CLUSTER, min=1)]


def role_gpus(role: str):
    return Annotated[int, opt(f"{role}_num_gpus_per_node", f"GPUs per node for the {role} model (CPU: 0 or 1 = one worker per node).", CLUSTER, min=0)]


ActorNodes, ActorGPUs = role_nodes("actor"), role_gpus("actor")
CriticNodes, CriticGPUs = role_nodes("critic"), role_gpus("critic")
RefNodes, RefGPUs = role_nodes("ref"), role_gpus("ref")
RewardNodes, RewardGPUs = role_nodes("reward"), role_gpus("reward")
ColocateActorRef = Annotated[bool, flag("colocate_actor_ref", "Actor and reference share GPUs.", CLUSTER)]
ColocateCriticReward = Annotated[bool, flag("colocate_critic_reward", "Critic and reward model share GPUs.", CLUSTER)]
ColocateAll = Annotated[bool, flag("colocate_all_models", "All models (and vLLM engines) share the actor's GPUs (hybrid engine).", CLUSTER)]

# --- vLLM --------------------------------------------------------------------------------------
VllmNumEngines = Annotated[int, opt("vllm_num_engines", "vLLM engines for rollouts (0: the policy generates itself).", ROLLOUT, min=0)]
VllmTP = Annotated[int, opt("vllm_tensor_parallel_size", "GPUs per vLLM engine.", ROLLOUT, min=1)]
VllmGpuMemUtil = Annotated[float, opt("vllm_gpu_memory_utilization", "Fraction of GPU memory vLLM may take.", ROLLOUT, min=0.0, max=1.0)]
VllmSyncBackend = Annotated[Literal["auto", "cuda_ipc", "nccl", "gloo", "ray"], opt("vllm_sync_backend", "Weight sync transport: auto | cuda_ipc | nccl | gloo | ray (auto: CUDA IPC on a shared GPU, NCCL between GPUs, gloo on CPU).", ROLLOUT)]
VllmEnableSleep = Annotated[bool, flag("vllm_enable_sleep", "Put vLLM to sleep while training (hybrid engine; needs --colocate_all_models).", ROLLOUT)]
EnablePrefixCaching = Annotated[bool, flag("enable_prefix_caching", "vLLM prefix caching.", ROLLOUT)]
StaticKVCache = Annotated[bool, flag("static_kv_cache", "Without vLLM: generate with a preallocated KV cache; on GPU each decode step is compiled and replayed as one CUDA graph (the first rollout compiles, ~30-45 s for a 0.5B model; not with ZeRO-3).", ROLLOUT)]
EnforceEager = Annotated[bool, flag("enforce_eager", "Disable CUDA graphs in vLLM.", ROLLOUT)]
VllmSyncBucketMB = Annotated[float, opt("vllm_sync_bucket_mb", "Weight sync bucket size (MB): one transfer per bucket, not per tensor.", ROLLOUT, min=0.001)]
VllmSyncTimeout = Annotated[float, opt("vllm_sync_timeout", "Seconds a weight sync may take before the run stops naming the engine.", ROLLOUT, min=1.0)]
LogprobDiffSteps = Annotated[int, opt("logprob_diff_steps", "Every N steps vLLM also returns each sampled token's log-prob for rollout/logprob_diff (do the engines hold the trainer's weights?); 1 = every step. Always with --enable_vllm_is_correction, which needs them. They cost ~25% of vLLM's decode time on a 0.5B model.", ROLLOUT, min=1)]
LogprobWarn = Annotated[float, opt("logprob_diff_warn", "Warn when the mean |trainer - vLLM| log-prob of sampled tokens exceeds this.", ROLLOUT, min=0.0)]
VllmISCorrection = Annotated[bool, flag("enable_vllm_is_correction", "Importance-sampling correction for the gap between the engines' and the trainer's log-probs (--vllm_is_correction_type).", ALGO)]
VllmISThreshold = Annotated[tuple[float, float], opt("vllm_is_truncated_threshold", "LOW HIGH bounds of the importance weights (tis clamps to them; icepop and seq-mask-tis zero what falls outside).", ALGO)]
VllmISType = Annotated[Literal["tis", "icepop", "seq-mask-tis"], opt("vllm_is_correction_type", "tis (token weights clamped: truncated IS) | icepop (token weights outside the bounds masked) | seq-mask-tis (whole sequences masked by their geometric-mean weight).", ALGO)]
AsyncTrain = Annotated[bool, flag("async_train", "The engines generate the next rollout(s) while the trainer trains on this one (needs --vllm_num_engines; best on GPUs of their own: with --colocate_all_models, which OpenRLHF refuses here, both sides stay resident on the shared GPUs, without the sleep flags, and compete for them); samples are then up to --async_queue_size policy versions old (rollout/staleness_*), which --enable_vllm_is_correction corrects for.", ROLLOUT)]
AsyncQueueSize = Annotated[int, opt("async_queue_size", "With --async_train: rollouts generated ahead of training, so no sample is trained more than N policy versions after the weights that generated it (0: generate, then train, as without --async_train).", ROLLOUT, min=0)]
PartialRollout = Annotated[bool, flag("partial_rollout", "With --async_train: the engines generate each rollout in chunks of --partial_rollout_chunk new tokens and take a weight sync between two chunks instead of after whole rollouts, so a sample's later tokens may come from newer weights; each token carries its version, a sample's staleness is its oldest token's (rollout/partial_frac: samples of several versions). The engines' log-prob of each token is its own weights', which --enable_vllm_is_correction corrects per token. PPO's old log-probs stay the trainer's weights before the update. Token versions depend on timing, so a resumed run (--load_checkpoint) need not repeat the uninterrupted one exactly; a checkpoint is still a barrier (the rollouts in flight then are regenerated from its weights). With --agent_func_path a sync lands between two turns of an episode (each turn is one engine call), and each turn's tokens carry its version.", ROLLOUT)]
PartialRolloutChunk = Annotated[int, opt("partial_rollout_chunk", "With --partial_rollout: new tokens per sample and engine call; a weight sync waits for at most one such chunk. Each chunk re-reads the sample's tokens so far: --enable_prefix_caching makes that cheap.", ROLLOUT, min=1)]
VllmSleepLevel = Annotated[int, opt("vllm_sleep_level", "vLLM sleep level: 1 keeps weights in CPU memory, 2 drops them (they are re-synced anyway).", ROLLOUT, min=1, max=2)]


def check_precision(a: dict) -> None:
    """The DeepSpeed precision, compile and offload flags that cannot go together (a script's parsed options)."""
    from common.errors import require

    require(a["bf16"] or not a["torch_autocast"], "--torch_autocast is a way to run --bf16: add --bf16 or drop it")
    require(a["gradient_checkpointing"] or not a.get("gradient_checkpointing_use_reentrant"),
            "--gradient_checkpointing_use_reentrant picks how --gradient_checkpointing recomputes activations: "
            "add --gradient_checkpointing or drop it")
    require(not (a["torch_autocast"] and a.get("deepspeed_enable_sleep")),
            "--deepspeed_enable_sleep offloads the states of DeepSpeed's bf16 mode; with --torch_autocast it is not "
            "supported yet: drop one of them")
    require(not (a["torch_compile"] and a["zero_stage"] == 3), "--torch_compile: ZeRO-3 gathers each layer's weights "
            "inside the compiled blocks; use --zero_stage 0, 1 or 2, or drop --torch_compile")
    ratio = a.get("adam_offload_ratio", 1.0)
    require(ratio > 0, "--adam_offload_ratio 0 keeps no optimizer state in CPU memory: drop --adam_offload instead")
    require(ratio == 1.0 or (a["adam_offload"] and a["zero_stage"] == 3), f"--adam_offload_ratio {ratio:g} is "
            "DeepSpeed's partial offload, which only ZeRO-3 has: add --adam_offload --zero_stage 3 or drop it")


class Options(Mapping):
    """Read-only mapping view of a typed options object, for common/ functions that take the options
    by key (`a["seed"]`) as well as by attribute (`a.seed`)."""

    def __getitem__(self, key):
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __iter__(self):
        return iter(f.name for f in dataclasses.fields(self))

    def __len__(self) -> int:
        return len(dataclasses.fields(self))


def typed(values: dict, main, name: str):
    """A script's resolved options as a frozen dataclass `name`, one field per option, typed as the
    script's parameters are (the OpenRLHF flags it does not declare, and the banner's notes, as Any):
    what `train` receives, so a misspelt option is an AttributeError, not a silent None."""
    import typing

    hints = typing.get_type_hints(main)
    fields = [(k, hints.get(k, typing.Any)) for k in values]
    cls = dataclasses.make_dataclass(name, fields, bases=(Options,), frozen=True, eq=False)
    return cls(**values)
