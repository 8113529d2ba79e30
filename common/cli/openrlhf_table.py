"""What each of OpenRLHF's flat flags (commit 76351db1) becomes in our scripts: the data behind
`common.cli.openrlhf_flags`. docs/openrlhf.md explains every row; tests/*/test_openrlhf_cli.py checks
that every flag of OpenRLHF's four CLIs parses in the matching script.

EXTRA[script] holds the flags the script does not declare itself: name -> (type, OpenRLHF's default,
how, text). `type` is int | float | str | bool (store_true) | float2 (nargs=2) | list (nargs='*').
`how` is
  "refuse"  a value other than OpenRLHF's default stops with `error: --flag: <text>`, exit 2
            (the default value itself, e.g. `--lora_rank 0`, asks for nothing and is accepted);
  "accept"  parsed; <text> is said once in the banner when the flag is given;
  "impl"    handled by common.cli.openrlhf_flags (a translation) or read by the script from its options;
  "alias:X" the same meaning as our --X.
A flag the script declares always wins over its row here, so a row can stay while a script grows
the real option. DEFAULTS[script] holds OpenRLHF's defaults for the options the script declares with
another demo default: with --pretrain the OpenRLHF value is used. Pure data: no torch, no typer.
"""
from __future__ import annotations

INF = float("inf")
RING = "ring attention (sequence parallelism) is not supported yet; drop it (--gradient_checkpointing saves activation memory)"
VLM = "images / vision-language models are not supported yet; drop it (text prompts only)"
DYN = "dynamic batching by token budget is not supported yet; drop it and size batches with --micro_train_batch_size"
TP = "DeepSpeed tensor parallelism (AutoTP) is not supported yet; drop it and shard with --zero_stage 3"
EMA = "an EMA copy of the actor is not supported yet; drop it"
MS = "ModelScope downloads are not supported; drop it (models come from the Hugging Face hub or a local folder)"

# Flags all four (five, with SFT) CLIs share.
_COMMON = {
    "save_hf_ckpt": ("bool", False, "impl", "a Hugging Face copy of the model inside each checkpoint (<checkpoint>/<role>/hf)"),
    "disable_ds_ckpt": ("bool", False, "refuse", "our checkpoints are what --load_checkpoint resumes from and are always "
                        "written with --save_steps; drop it (--max_ckpt_num bounds the disk they take)"),
    "max_ckpt_mem": ("float", 1e8, "refuse", "checkpoints rotate by count here: use --max_ckpt_num N instead"),
    "use_ds_universal_ckpt": ("bool", False, "refuse", "DeepSpeed universal checkpoints (resuming at another world size) are "
                              "not supported; drop it and resume with the same number of ranks"),
    "deepcompile": ("bool", False, "refuse", "DeepSpeed's deepcompile is not supported; use --torch_compile instead"),
    "full_determinism": ("bool", False, "impl", "deterministic torch kernels (torch.use_deterministic_algorithms)"),
    "param_dtype": ("str", "bf16", "impl", "bf16 = our --bf16 (the default with --pretrain), fp32 = without (ours); fp16 is refused"),
    "zpg": ("int", 1, "impl", "ZeRO++ hierarchical partition size (DeepSpeed zero_hpz_partition_size)"),
    "attn_implementation": ("str", "flash_attention_2", "impl", "flash_attention_2 = our --flash_attn; sdpa; eager"),
    "grad_accum_dtype": ("str", None, "impl", "DeepSpeed data_types.grad_accum_dtype (fp32, bf16)"),
    "overlap_comm": ("bool", False, "impl", "DeepSpeed zero_optimization.overlap_comm (with contiguous_gradients)"),
    "gradient_checkpointing_use_reentrant": ("bool", False, "impl", "reentrant activation checkpointing"),
    "disable_fast_tokenizer": ("bool", False, "accept", "--disable_fast_tokenizer: the tokenizer loads as transformers "
                               "picks it (the fast one when the folder has it); the flag changes nothing here"),
    "dataloader_num_workers": ("int", 0, "accept", "--dataloader_num_workers: the data is tokenized in memory before "
                               "training, so there are no loader workers; the flag changes nothing here"),
    "ds_tensor_parallel_size": ("int", 1, "refuse", TP),
    "ring_attn_size": ("int", 1, "refuse", RING),
    "ring_head_stride": ("int", 1, "refuse", RING),
    "aux_loss_coef": ("float", 0.0, "refuse", "the MoE load-balancing loss is not supported (no MoE models here); drop it"),
    "wandb_org": ("str", None, "impl", "wandb entity"),
    "wandb_group": ("str", None, "impl", "wandb group"),
    "use_ms": ("bool", False, "refuse", MS),
    # Until the data engineer's options land in a script (a declared option wins over these rows).
    "dataset_probs": ("str", None, "refuse", "mixing several datasets is not supported yet; give one --dataset"),
    "dataset_split": ("str", "train", "refuse", "a split other than train is not supported yet; drop it"),
    "eval_split": ("str", "train", "refuse", "a split other than the default is not supported yet; drop it"),
    "input_template": ("str", None, "refuse", "prompt templates are not supported yet; use --apply_chat_template"),
    "tokenizer_chat_template": ("str", None, "refuse", "a custom chat template is not supported yet; drop it to use the tokenizer's"),
    "use_liger_kernel": ("bool", False, "refuse", "liger-kernel is not wired in yet; drop it"),
    "value_head_prefix": ("str", "score", "impl", "the value head's name (train_rm, train_ppo and train_grpo declare it; docs/openrlhf.md, Reward models and critics)"),
}


def _without(rows: dict, *names: str) -> dict:
    return {k: v for k, v in rows.items() if k not in names}


_PREFS = {  # RM and DPO
    "packing_samples": ("bool", False, "refuse", "packing preference pairs is not supported yet; drop it (pairs are padded per micro-batch)"),
    "compute_fp32_loss": ("bool", False, "refuse", "not supported yet; drop it (our losses already run in fp32)"),
    "min_lr_ratio": ("float", 0.1, "refuse", "not supported yet; cosine_with_min_lr decays to 0.1 x the peak here, OpenRLHF's default"),
}

_RL = {  # train_ppo.py and train_grpo.py
    "local_rank": ("int", -1, "accept", "--local_rank: a Ray driver has no launcher rank; the flag changes nothing here"),
    "max_len": ("int", 2048, "impl", "prompt + response tokens: sets --prompt_max_len / --generate_max_len (docs/openrlhf.md)"),
    "max_new_tokens": ("int", None, "impl", "= --generate_max_len"),
    "vllm_sync_with_ray": ("bool", False, "alias:vllm_sync_backend", "= --vllm_sync_backend ray"),
    "vllm_generate_batch_size": ("int", None, "impl", "prompts per vLLM call; above --rollout_batch_size refused (async)"),
    "image_key": ("str", "images", "refuse", VLM),
    "max_images_per_prompt": ("int", 0, "refuse", VLM),
    "freeze_visual_encoder": ("bool", False, "refuse", VLM),
    "enable_ema": ("bool", False, "refuse", EMA),
    "ema_beta": ("float", 0.992, "refuse", EMA),
    "actor_init_on_gpu": ("bool", False, "accept", "--actor_init_on_gpu: models load where DeepSpeed places them; the flag "
                          "changes nothing here"),
    "use_dynamic_batch": ("bool", False, "refuse", DYN),
    "rollout_max_tokens_per_gpu": ("int", None, "refuse", DYN),
    "train_max_tokens_per_gpu": ("int", 16192, "refuse", DYN),
    "perf": ("bool", False, "accept", "--perf: time/* and perf/tokens_per_s are always logged; nothing to switch on"),
    "prompt_data_probs": ("str", None, "refuse", "mixing several prompt sets is not supported yet; give one --prompt_data"),
    "prompt_split": ("str", "train", "refuse", "a split other than train is not supported yet; drop it"),
    "ref_reward_offload": ("bool", False, "impl", "reference and reward weights in CPU memory (train_ppo and train_grpo declare it)"),
}
# Not in train_ppo_ray.py's CLI, or (aux_loss_coef) added to the RL scripts as a real option by the lead.
_RL_COMMON = _without(_COMMON, "dataset_probs", "dataset_split", "tokenizer_chat_template", "aux_loss_coef")

EXTRA = {
    "train_rm": {**_without(_COMMON, "use_liger_kernel"), **_without(_PREFS, "min_lr_ratio"),
                 "margin_loss": ("bool", False, "refuse", "use a margin column (--margin_key) instead")},
    "train_dpo": {**_without(_COMMON, "value_head_prefix"), **_without(_PREFS, "compute_fp32_loss"),
                  "ref_offload": ("bool", False, "refuse", "offloading the reference is not supported yet; drop it")},
    "train_ppo": {**_RL_COMMON, **_RL,
                  "save_value_network": ("bool", False, "impl", "also save the critic to <save_path>_critic")},
    "train_grpo": {**_RL_COMMON, **_RL,
                   "save_value_network": ("bool", False, "accept", "--save_value_network: GRPO trains no critic; "
                                          "the flag changes nothing here"),
                   "critic_num_nodes": ("int", 1, "accept", "--critic_num_nodes: GRPO trains no critic (train_ppo.py does)"),
                   "critic_num_gpus_per_node": ("int", 8, "accept", "--critic_num_gpus_per_node: GRPO trains no critic "
                                                "(train_ppo.py does)"),
                   "colocate_critic_reward": ("bool", False, "accept", "--colocate_critic_reward: GRPO trains no critic"),
                   "critic_pretrain": ("str", None, "accept", "--critic_pretrain: GRPO trains no critic"),
                   "critic_learning_rate": ("float", 9e-6, "accept", "--critic_learning_rate: GRPO trains no critic"),
                   "value_clip": ("float", 0.5, "accept", "--value_clip: GRPO trains no critic"),
                   "lambd": ("float", 1.0, "accept", "--lambd: GAE's lambda; GRPO has no critic (train_ppo.py does)"),
                   "freezing_actor_steps": ("int", -1, "refuse", "it holds the actor while a critic warms up; GRPO has "
                                            "no critic, so nothing would train: drop it (train_ppo.py takes it)")},
    "train_sft": {**_without(_COMMON, "value_head_prefix"),
                  "train_split": ("str", "train", "accept", "--train_split: OpenRLHF's train_sft parses it and trains on "
                                  "--dataset_split, as this script does; the flag changes nothing here")},
}

# OpenRLHF's defaults for options our scripts declare with a demo value (used with --pretrain).
_RL_DEFAULTS = {
    "bf16": True, "input_key": "input", "label_key": None, "max_samples": 100_000_000,
    "init_kl_coef": 0.01, "kl_estimator": "k1", "rollout_batch_size": 1024, "micro_rollout_batch_size": 1,
    "train_batch_size": 128, "micro_train_batch_size": 1, "actor_learning_rate": 1e-6, "lr_warmup_ratio": 0.03,
    "lr_scheduler": "cosine_with_min_lr", "vllm_gpu_memory_utilization": 0.95, "eval_steps": -1,
    "eval_temperature": 0.6, "eval_n_samples_per_prompt": 4, "eval_split": "train",
    "max_steps": None,  # OpenRLHF has no --max_steps: it runs out --num_episodes
}
DEFAULTS = {
    "train_ppo": {**_RL_DEFAULTS, "critic_learning_rate": 9e-6, "lambd": 1.0, "value_clip": 0.5},
    "train_grpo": dict(_RL_DEFAULTS),
    "train_rm": {"bf16": True, "max_epochs": 1, "train_batch_size": 128, "micro_train_batch_size": 1,
                 "learning_rate": 9e-6, "max_samples": 1_000_000},
    "train_dpo": {"bf16": True, "train_batch_size": 128, "micro_train_batch_size": 8, "learning_rate": 1e-5,
                  "max_samples": 1_000_000},
    "train_sft": {"bf16": True, "max_epochs": 2, "train_batch_size": 128, "micro_train_batch_size": 8,
                  "learning_rate": 5e-6, "max_samples": 1_000_000, "max_len": 2048, "lr_warmup_ratio": 0.03,
                  "eval_steps": -1, "adam_betas": (0.9, 0.95),
                  "max_steps": None},  # OpenRLHF has no --max_steps: it runs out the epochs
}

