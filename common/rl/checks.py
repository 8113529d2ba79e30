"""The option checks and derived defaults train_ppo.py and train_grpo.py share.

`a` is a script's parsed options (a dict); each check raises UserError with the change to make.
Light: no torch (the checks run before anything heavy loads).
"""
from __future__ import annotations

from common.cli import options as o
from common.errors import require


def derived_defaults(a: dict, group_estimators: tuple) -> list[str]:
    """Fill the options whose default follows from another flag; returns one banner line for each."""
    notes = []
    if a["n_samples_per_prompt"] is None:
        a["n_samples_per_prompt"] = 8 if a["advantage_estimator"] in group_estimators else 1
        notes.append(f"--n_samples_per_prompt {a['n_samples_per_prompt']} (from --advantage_estimator "
                     f"{a['advantage_estimator']})")
    if a["loss_agg_mode"] is None:
        if a["advantage_estimator"] == "dr_grpo":
            a["loss_agg_mode"] = "seq_mean_token_sum_norm"
            why = "--advantage_estimator dr_grpo: each sequence's token sum over --generate_max_len"
        elif a["policy_loss_type"] == "gspo":
            a["loss_agg_mode"], why = "seq_mean_token_mean", "--policy_loss_type gspo: a sequence-level loss"
        else:
            a["loss_agg_mode"], why = "token_mean", "every token of the step weighs the same"
        notes.append(f"--loss_agg_mode {a['loss_agg_mode']} ({why})")
    return notes


def check_rl_algorithm(a: dict, group_estimators: tuple) -> None:
    """Estimator, loss and reward-shaping flags that cannot go together."""
    est = a["advantage_estimator"]
    require(a["kl_estimator"] in ("k1", "k2", "k3"), f"--kl_estimator {a['kl_estimator']}: choose k1, k2 or k3")
    require(est not in group_estimators or a["gamma"] == 1.0,
            f"--gamma {a['gamma']}: --advantage_estimator {est} gives each sequence one advantage, which gamma "
            "would discount along the tokens; use --gamma 1 (OpenRLHF resets it to 1 with a warning)")
    require(a["policy_loss_type"] != "gspo" or a["loss_agg_mode"] == "seq_mean_token_mean",
            f"--policy_loss_type gspo is a sequence-level objective: use --loss_agg_mode seq_mean_token_mean "
            f"(its default with gspo), not {a['loss_agg_mode']}")
    low, high = a["vllm_is_truncated_threshold"]
    require(0 <= low < high, f"--vllm_is_truncated_threshold {low} {high}: give LOW HIGH with 0 <= LOW < HIGH")
    lo, hi = a["reward_clip_range"]
    require(lo < hi, f"--reward_clip_range {lo} {hi}: give LOW HIGH with LOW < HIGH")
    lo, hi = a["dynamic_filtering_reward_range"]
    require(not a["dynamic_filtering"] or lo < hi,
            f"--dynamic_filtering_reward_range {lo} {hi}: give LOW HIGH with LOW < HIGH")
    require(not a["dynamic_filtering"] or a["n_samples_per_prompt"] > 1,
            "--dynamic_filtering compares the samples of a prompt: set --n_samples_per_prompt 2 or more")
    buf = a["overlong_buffer_len"]
    require(buf is None or 0 < buf <= a["generate_max_len"],
            f"--overlong_buffer_len {buf}: must be in (0, --generate_max_len {a['generate_max_len']}]")
    c = a["stop_properly_penalty_coef"]
    require(c is None or c < 0 or c <= 1,
            f"--stop_properly_penalty_coef {c}: a factor in [0, 1], or a negative score that replaces a truncated one's")
    require(a["ptx_coef"] == 0.05, "--ptx_coef: the PPO-ptx pretraining loss is not supported (OpenRLHF's last flat "
            "CLI has no pretraining data flag either); drop --ptx_coef")
    require(a["aux_loss_coef"] == 0, "--aux_loss_coef: mixture-of-experts auxiliary losses are not supported yet; "
            "drop --aux_loss_coef")


def check_rl(a: dict, group_estimators: tuple) -> None:
    """The option checks train_ppo.py and train_grpo.py share (each checks its own estimators first)."""

    est, n = a["advantage_estimator"], a["n_samples_per_prompt"]
    require(est not in group_estimators or n > 1,
            f"--advantage_estimator {est} compares samples of the same prompt: set --n_samples_per_prompt 2 or more")
    require(a["zero_stage"] in (0, 1, 2, 3), f"--zero_stage {a['zero_stage']}: DeepSpeed ZeRO has stages 0, 1, 2 and 3")
    sources = [k for k in ("reward_pretrain", "reward_func", "remote_rm_url", "agent_func_path") if a[k]]
    require(len(sources) <= 1, f"rewards come from one source: drop all but one of {', '.join('--' + s for s in sources)}")
    require(sources or a["prompt_data"] is None,
            "--prompt_data needs a reward: give --reward_pretrain, --reward_func, --remote_rm_url or --agent_func_path")
    if a["agent_func_path"]:  # the environment rewards; its episodes run on the engines (common.rl.agent)
        require(a["vllm_num_engines"] > 0, "--agent_func_path runs its episodes on vLLM engines: add --vllm_num_engines N")
        # --partial_rollout: a sync lands between two turns of an episode (each turn one engine call), not inside one
        require(not a["partial_rollout"] or a["partial_rollout_chunk"] == 64,
                "--partial_rollout_chunk does not apply with --agent_func_path: a weight sync lands between two turns "
                "of an episode (cap a turn with --max_tokens_per_turn instead); drop --partial_rollout_chunk")
    else:
        for flag, default in (("max_turns", 0), ("max_tokens_per_turn", 0), ("agent_feedback_role", None)):
            require(a[flag] == default, f"--{flag} shapes a multi-turn agent's episodes: add --agent_func_path or drop it")
    samples = a["rollout_batch_size"] * n
    require(samples % a["train_batch_size"] == 0,
            f"--rollout_batch_size {a['rollout_batch_size']} x --n_samples_per_prompt {n} = {samples} samples must be "
            f"a multiple of --train_batch_size {a['train_batch_size']}")
    require(a["train_batch_size"] % a["micro_train_batch_size"] == 0,
            f"--train_batch_size {a['train_batch_size']} must be a multiple of --micro_train_batch_size {a['micro_train_batch_size']}")
    require(a["dual_clip"] is None or a["dual_clip"] > 1, f"--dual_clip {a['dual_clip']}: must be > 1")
    require(not (a["static_kv_cache"] and a["vllm_num_engines"]),
            "--static_kv_cache is for the policy's own generation; with --vllm_num_engines vLLM generates: drop one")
    require(not (a["static_kv_cache"] and a["zero_stage"] == 3),
            "--static_kv_cache needs the whole policy on each rank: use --zero_stage 0, 1 or 2, or drop --static_kv_cache")
    o.check_precision(a)
    check_rl_algorithm(a, group_estimators)
    if a["share_prompt_prefix"]:
        require(n > 1, "--share_prompt_prefix runs a prompt once for its samples: with --n_samples_per_prompt 1 there "
                "is nothing to share; sample 2 or more per prompt or drop --share_prompt_prefix")
        require(not a["packing_samples"], "--share_prompt_prefix and --packing_samples are two ways to cut the "
                "forward passes' padded work and do not combine: drop one of them")
        require(not a["gradient_checkpointing"], "--share_prompt_prefix runs the responses on the prompts' key/value "
                "cache, which transformers turns off under --gradient_checkpointing: drop one of them")
        # flash-attention's padded path with a left-padded cache was not available to check against the plain forward
        require(a["flash_attn"] is not True, "--share_prompt_prefix is checked with PyTorch's SDPA and eager attention only, "
                "not with flash-attention: drop --flash_attn or --share_prompt_prefix")
    if a.get("lora_rank"):  # the engines keep the base they loaded and take only adapters (AdapterSync)
        require(not (a["vllm_enable_sleep"] and a["vllm_sleep_level"] == 2), "--vllm_sleep_level 2 drops the engines' "
                "weights, and a LoRA run sends only its adapter, never the base again: use --vllm_sleep_level 1")
    need = [f"--{k}" for k in ("vllm_enable_sleep", "enable_vllm_is_correction") if a[k]]
    require(a["vllm_num_engines"] > 0 or not need,
            f"{' and '.join(need)} {'needs' if len(need) == 1 else 'need'} vLLM engines: add --vllm_num_engines N or drop it")
    require(not a["vllm_enable_sleep"] or a["colocate_all_models"],
            "--vllm_enable_sleep frees GPU memory for models sharing the GPUs: add --colocate_all_models or drop it")
    require(a["async_train"] or not a["partial_rollout"], "--partial_rollout syncs weights into the generation that "
            "--async_train overlaps with training: add --async_train or drop --partial_rollout")
    if a["async_train"]:  # the engines generate while the trainer trains
        require(a["vllm_num_engines"] > 0, "--async_train overlaps the vLLM engines' generation with training: add "
                "--vllm_num_engines N or drop --async_train")
        # OpenRLHF refuses --colocate_all_models outright; without sleep both sides stay resident and may
        # share the GPUs (the one-GPU case), so only the sleep flags, which assume turns, are refused.
        sleeps = [f"--{k}" for k in ("vllm_enable_sleep", "deepspeed_enable_sleep") if a[k]]
        require(not (a["colocate_all_models"] and sleeps), f"--async_train --colocate_all_models: the engines generate "
                f"while the trainer trains on the same GPUs, so neither side can sleep: drop {' and '.join(sleeps)}, "
                "or give the engines GPUs of their own (drop --colocate_all_models)")


def cpu_refused(a: dict, use_gpu: bool) -> list[tuple[str, str]]:
    """(flag, why) for the flags a CPU run cannot take; `init_ray` names them in the same message as a
    layout that does not fit the cluster, so one attempt gets every change."""
    if use_gpu:
        return []
    why = {"vllm_enable_sleep": "vLLM cannot sleep on CPU",  # vLLM-CPU rejects sleep mode
           "deepspeed_enable_sleep": "on CPU there is no GPU memory to free"}  # it would offload CPU to CPU
    return [(f"--{k}", w) for k, w in why.items() if a[k]]
