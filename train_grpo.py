"""GRPO (and REINFORCE++, RLOO, Dr. GRPO) on Ray actor groups: online RL without a critic.

Each step: sample n responses per prompt, score them (reward model, Python function, or HTTP
server), compute log-probs of the old policy and the reference, turn group-relative scores into
advantages, take clipped policy-gradient steps, and push the new weights to the rollout side.
`--advantage_estimator` picks how scores become advantages: group_norm (GRPO: (r - mean) / std
within the prompt's group), dr_grpo (no std, constant-length normaliser), rloo (leave-one-out
baseline), reinforce_baseline (group mean, then batch whitening), reinforce (REINFORCE++: token
returns with the KL in the reward, whitened over the batch). `--use_kl_loss` moves the KL from the
reward into the loss, as the GRPO paper does.

Run book
    python train_grpo.py                                  # built-in tiny model and copy task, CPU
    python train_grpo.py --pretrain Qwen/Qwen2.5-0.5B-Instruct --prompt_data prompts.jsonl \
        --input_key question --label_key answer --apply_chat_template --reward_func reward.py \
        --actor_num_gpus_per_node 1 --ref_num_gpus_per_node 1 --colocate_actor_ref --bf16
    ray job submit --address http://127.0.0.1:8265 -- python train_grpo.py ...   # a running cluster
    sbatch slurm/grpo_8b.sh                                # Slurm, several nodes
"""
from __future__ import annotations

import math
import os
import time

import typer

from common.cli import openrlhf_flags as orl
from common.cli import options as o
from common.rl import checks as rl_checks
from common.errors import exit_on_user_error, require
from common.cli.checks import check_lora, template_notes
from common.data.prompts import prompt_tail

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich")
GROUP_ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")


@app.command(help=__doc__.split("\n\n")[0], cls=orl.Command)
@orl.openrlhf_flags("train_grpo")  # OpenRLHF's other flags, and its defaults with --pretrain
def main(
    pretrain: o.Pretrain = None,
    reward_pretrain: o.RewardPretrain = None,
    value_head_prefix: o.ValueHeadPrefix = "score",
    reward_func: o.RewardFunc = None,
    remote_rm_url: o.RemoteRMURL = None,
    agent_func_path: o.AgentFuncPath = None,
    max_turns: o.MaxTurns = 0,
    max_tokens_per_turn: o.MaxTokensPerTurn = 0,
    agent_timeout: o.AgentTimeout = 300.0,
    agent_feedback_role: o.AgentFeedbackRole = None,
    skip_bad_rewards: o.SkipBadRewards = False,
    reward_timeout: o.RewardTimeout = 60.0,
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
    prompt_data: o.PromptData = None,
    prompt_data_probs: o.PromptDataProbs = None,
    prompt_split: o.PromptSplit = "train",
    input_template: o.InputTemplate = None,
    input_key: o.InputKey = "prompt",
    label_key: o.LabelKey = "label",
    apply_chat_template: o.ApplyChatTemplate = False,
    max_samples: o.MaxSamples = None,
    prompt_max_len: o.PromptMaxLen = 1024,
    generate_max_len: o.GenerateMaxLen = 12,
    advantage_estimator: o.AdvantageEstimator = "group_norm",
    n_samples_per_prompt: o.NSamples = None,
    init_kl_coef: o.InitKLCoef = 0.001,
    kl_estimator: o.KLEstimator = "k3",
    use_kl_loss: o.UseKLLoss = False,
    gamma: o.Gamma = 1.0,
    eps_clip: o.EpsClip = 0.2,
    eps_clip_low_high: o.EpsClipLowHigh = None,
    dual_clip: o.DualClip = None,
    normalize_reward: o.NormalizeReward = False,
    no_advantage_std_norm: o.NoAdvStdNorm = False,
    entropy_loss_coef: o.EntropyLossCoef = 0.0,
    loss_agg_mode: o.LossAgg = None,
    policy_loss_type: o.PolicyLossType = "ppo",
    reward_clip_range: o.RewardClipRange = (-10.0, 10.0),
    overlong_buffer_len: o.OverlongBufferLen = None,
    overlong_penalty_factor: o.OverlongPenaltyFactor = 1.0,
    stop_properly_penalty_coef: o.StopProperlyPenalty = None,
    kl_target: o.KLTarget = None,
    kl_horizon: o.KLHorizon = 10000,
    ptx_coef: o.PtxCoef = 0.05,
    aux_loss_coef: o.AuxLossCoef = 0.0,
    dynamic_filtering: o.DynamicFiltering = False,
    dynamic_filtering_reward_range: o.DynamicFilteringRange = (0.0, 1.0),
    temperature: o.Temperature = 1.0,
    top_p: o.TopP = 1.0,
    rollout_batch_size: o.RolloutBatchSize = 16,
    micro_rollout_batch_size: o.MicroRolloutBatchSize = 64,
    train_batch_size: o.TrainBatchSize = 64,
    micro_train_batch_size: o.MicroTrainBatchSize = 64,
    max_epochs: o.MaxEpochs = 1,
    num_episodes: o.NumEpisodes = 1,
    max_steps: o.MaxSteps = 40,
    actor_learning_rate: o.ActorLR = 3e-4,
    lr_warmup_ratio: o.WarmupRatio = 0.0,
    lr_scheduler: o.LRScheduler = "constant_with_warmup",
    l2: o.WeightDecay = 0.0,
    adam_betas: o.AdamBetas = (0.9, 0.95),
    max_norm: o.MaxNorm = 1.0,
    seed: o.Seed = 42,
    skip_nonfinite_updates: o.SkipNonfiniteUpdates = False,
    packing_samples: o.PackingSamples = False,
    share_prompt_prefix: o.SharePromptPrefix = False,
    zero_stage: o.ZeroStage = 2,
    adam_offload: o.AdamOffload = False,
    adam_offload_ratio: o.AdamOffloadRatio = 1.0,
    ref_reward_offload: o.RefRewardOffload = False,
    deepspeed_enable_sleep: o.DeepSpeedSleep = False,
    actor_num_nodes: o.ActorNodes = 1,
    actor_num_gpus_per_node: o.ActorGPUs = 1,
    ref_num_nodes: o.RefNodes = 1,
    ref_num_gpus_per_node: o.RefGPUs = 1,
    reward_num_nodes: o.RewardNodes = 1,
    reward_num_gpus_per_node: o.RewardGPUs = 1,
    colocate_actor_ref: o.ColocateActorRef = False,
    colocate_all_models: o.ColocateAll = False,
    vllm_num_engines: o.VllmNumEngines = 0,
    vllm_tensor_parallel_size: o.VllmTP = 1,
    vllm_gpu_memory_utilization: o.VllmGpuMemUtil = 0.5,
    vllm_sync_backend: o.VllmSyncBackend = "auto",
    vllm_enable_sleep: o.VllmEnableSleep = False,
    enable_prefix_caching: o.EnablePrefixCaching = False,
    enforce_eager: o.EnforceEager = False,
    static_kv_cache: o.StaticKVCache = False,
    vllm_sync_bucket_mb: o.VllmSyncBucketMB = 256.0,
    vllm_sync_timeout: o.VllmSyncTimeout = 300.0,
    vllm_sleep_level: o.VllmSleepLevel = 2,
    logprob_diff_steps: o.LogprobDiffSteps = 10,
    logprob_diff_warn: o.LogprobWarn = 0.05,
    enable_vllm_is_correction: o.VllmISCorrection = False,
    vllm_is_truncated_threshold: o.VllmISThreshold = (0.5, 5.0),
    vllm_is_correction_type: o.VllmISType = "tis",
    async_train: o.AsyncTrain = False,
    async_queue_size: o.AsyncQueueSize = 1,
    partial_rollout: o.PartialRollout = False,
    partial_rollout_chunk: o.PartialRolloutChunk = 64,
    dry_run: o.DryRun = False,
    save_path: o.SavePath = "./output/grpo",
    save_steps: o.SaveSteps = -1,
    logging_steps: o.LoggingSteps = 1,
    eval_steps: o.EvalSteps = 10,
    eval_dataset: o.EvalDataset = None,
    eval_split: o.EvalSplit = "train",
    eval_temperature: o.EvalTemperature = 1.0,
    eval_n_samples_per_prompt: o.EvalNSamples = 4,
    eval_correct_threshold: o.EvalCorrectThreshold = 1.0,
    best_metric_key: o.BestMetricKey = "",
    ckpt_path: o.CkptPath = None,
    max_ckpt_num: o.MaxCkptNum = 3,
    load_checkpoint: o.LoadCheckpoint = False,
    use_wandb: o.UseWandb = None,
    wandb_project: o.WandbProject = "hybridrl",
    wandb_run_name: o.WandbRunName = None,
    use_tensorboard: o.UseTensorboard = None,
):
    a = orl.options(locals())
    with exit_on_user_error():
        check_lora(a)
        derived = rl_checks.derived_defaults(a, GROUP_ESTIMATORS)  # defaults that follow from other flags
        a = o.typed(a, main, "GRPOOptions")  # a misspelt option is an AttributeError, not a silent None
        check_options(a)
        plan = resource_plan(a)
        if dry_run:
            from common.logger import MetricsLogger

            from common.cluster import memory_plan
            from common.cluster.resources import plan_rows, plan_summary

            show = MetricsLogger(save_path, 0, files=False)  # a dry run writes nothing
            show.table("resource plan", plan_rows(plan))
            show.info(plan_summary(plan))
            memory_plan.preflight(memory_plan.from_options(a, "grpo", plan), log=show)  # each process's GPU memory per phase
            return
        train(a, plan, derived)


def check_options(a: o.Options) -> None:
    est = a.advantage_estimator
    require(est in GROUP_ESTIMATORS + ("reinforce",),
            f"--advantage_estimator {est}: train_grpo.py takes {', '.join(GROUP_ESTIMATORS)} or reinforce; "
            "for gae (a critic) use train_ppo.py")
    no_std = {"dr_grpo": "r - the group mean", "rloo": "r - the mean of the other samples"}
    require(not (a.no_advantage_std_norm and est in no_std),
            f"--no_advantage_std_norm with --advantage_estimator {est}: its advantage ({no_std.get(est)}) is never "
            "divided by a std, so the flag would change nothing; drop it (it removes group_norm's division by the "
            "group std, and the batch whitening's of gae, reinforce and reinforce_baseline)")
    rl_checks.check_rl(a, GROUP_ESTIMATORS)
    template_notes(a)  # --input_template: errors here, notes in the banner


def resource_plan(a: o.Options):
    import shutil

    from common.cluster.resources import plan_resources

    # A dry run shows the layout the flags ask for (GPUs), wherever it runs.
    use_gpu = a.dry_run or bool(os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "" and shutil.which("nvidia-smi"))
    return plan_resources(
        actor=(a.actor_num_nodes, a.actor_num_gpus_per_node), critic=None,
        # with --lora_rank the reference is the actor's base model (its adapter off), in the actor's processes
        ref=(a.ref_num_nodes, a.ref_num_gpus_per_node) if a.init_kl_coef > 0 and not a.lora_rank else None,
        reward=(a.reward_num_nodes, a.reward_num_gpus_per_node) if a.reward_pretrain else None,
        vllm_num_engines=a.vllm_num_engines, vllm_tp=a.vllm_tensor_parallel_size,
        colocate_actor_ref=a.colocate_actor_ref, colocate_critic_reward=False,
        colocate_all_models=a.colocate_all_models, use_gpu=use_gpu)


def train(a: o.Options, plan, derived: list[str]) -> None:
    from common import cpu_threads
    cpu_threads.configure()  # before torch: OpenMP reads its wait policy once, when it loads
    import torch

    from common.algo.advantages import KLController, group_all_equal, kl_estimate, length_penalties, rl_advantages
    from common.data.rows import iterate_batches
    from common.algo.losses import aggregate, masked_mean, policy_loss, sampler_gap
    from common.rl.eval import KL_WARN, TRUNCATED_WARN
    from common.rl.run import RLRun
    from common.rollout.samples import make_batch, split_batch
    from common.rollout.queue import RolloutQueue, staleness

    run = RLRun(a, plan)  # prompts, rewards, Ray and its placement groups (common/rl/run.py)
    n = a.n_samples_per_prompt

    # ---- the models: the actor (it also samples when there are no vLLM engines), the reference, a reward model
    specs = run.policy_specs()
    state = run.start(specs, title="train_grpo", plot_keys=("rollout/reward_mean", "train/kl", "train/policy_loss", "eval/reward_mean"),
                      derived=derived, notes=template_notes(a))
    actor, log, tokenizer = run.actor, run.log, run.tokenizer
    sampling = dict(n=n, temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.generate_max_len,
                    micro_batch=max(1, a.micro_rollout_batch_size // n))

    # The loss the actor's workers run; it travels to them by value, so an edited copy of this script
    # trains with its own loss. out["logprobs"]: [b, t-1]; micro: this micro-batch's tensors.
    eps_low, eps_high = a.eps_clip_low_high or (a.eps_clip, a.eps_clip)
    kl_in_loss = a.use_kl_loss and a.init_kl_coef > 0
    kl_ctl = KLController(a.init_kl_coef, a.kl_target, a.kl_horizon)
    correction = (a.vllm_is_correction_type, *a.vllm_is_truncated_threshold) if a.enable_vllm_is_correction else None
    gspo_vs_sampler = a.policy_loss_type == "gspo" and correction is not None  # GSPO's ratio against vLLM's log-probs

    def actor_loss(out, micro):
        # Each term is this micro-batch's share of the step's mean (common.algo.losses.aggregate): the
        # counts span every micro-batch and rank of the optimizer step.
        mask, counts = micro["action_mask"], dict(step_tokens=micro["step_tokens"], step_seqs=micro["step_seqs"])
        old = micro["old_logprobs"] if "old_logprobs" in micro else out["logprobs"].detach()  # see phase 3
        is_weights, stats = micro.get("is_weights"), {}
        if "gen_logprobs" in micro:  # the engine's log-probs meet this very forward's (see phase 3; rank 0's share)
            gap, is_weights = sampler_gap(out["logprobs"], micro["gen_logprobs"], mask, correction)
            stats = {f"rollout/{k}": v for k, v in gap.items()}
        loss, clip_frac, approx_kl = policy_loss(
            out["logprobs"], old, micro["advantages"], mask, eps_low, eps_high, a.dual_clip, a.loss_agg_mode,
            is_weights=is_weights, loss_type=a.policy_loss_type,
            gen_logp=micro["gen_logprobs"] if gspo_vs_sampler else None, norm_len=a.generate_max_len, **counts)
        stats.update(policy_loss=loss.item(), clip_frac=clip_frac.item(), approx_kl=approx_kl.item())
        if kl_in_loss:  # a token mean over the step, whatever --loss_agg_mode (as OpenRLHF's KL loss)
            kl = aggregate(kl_estimate(out["logprobs"], micro["ref_logprobs"], a.kl_estimator), mask, "token_mean", **counts)
            loss = loss + kl_ctl.value * kl
            stats["kl_loss"] = kl.item()
        if out["entropy"] is not None:
            if a.entropy_loss_coef:  # else logged only: no backward through a full-vocabulary softmax
                loss = loss - a.entropy_loss_coef * aggregate(out["entropy"], mask, "token_mean", **counts)
            stats["entropy"] = masked_mean(out["entropy"], mask).item()
        return loss, stats

    # ---- the RL loop: generate, score, reference and old log-probs, advantages, train, sync
    batches = iterate_batches(len(run.prompts), a.rollout_batch_size, a.seed, start_epoch=state["episode"],
                              start_step=state["step_in_episode"])
    step, skipped, stopped = state["step"], state["skipped_updates"], False
    # With --async_train the engines generate the next rollout(s) while the trainer trains on this one:
    # up to `depth` rollouts ahead, from weights that many versions old (common/rollout/queue.py).
    # depth 0: generate, then train. Stale samples need the engines' log-probs at every step (phase 3).
    depth = a.async_queue_size if a.async_train else 0
    # --partial_rollout: the engines generate in chunks and take each weight sync between two, so a
    # sample's later tokens may come from newer weights (common/rollout/partial.py)
    chunk = a.partial_rollout_chunk if a.partial_rollout else 0
    # sampled, not greedy: the base model's most likely word is already right, its sampling is not
    run.evaluate_start(step, sampling)  # step 0, before any rollout is in flight: the starting point
    rollouts = RolloutQueue(
        lambda prompts, seed, lp: run.submit(prompts, sampling, seed, lp, chunk), batches, run.prompts, depth=depth,
        save_steps=a.save_steps, start=step, total=run.total_steps, seed=lambda j: a.seed * 100_003 + j * 1009,
        logprobs=lambda j: depth > 0 or a.enable_vllm_is_correction or j % a.logprob_diff_steps == 0, partial=chunk > 0)
    while step < run.total_steps and not stopped:
        t_step = time.perf_counter()
        metrics = {}

        # 1. generate (or take the rollout the engines generated during the last step)
        r = rollouts.take(step)  # first submits the later rollouts this step's weights generate
        episode, step_in_episode, batch_prompts, samples = r.episode, r.step_in_episode, r.prompts, r.samples
        metrics["time/generate_s"] = r.wait_s
        # inside vLLM (the rest is Ray moving prompts and samples): wall, CPU and garbage-collector seconds
        metrics.update({f"time/{k}": v for k, v in samples.extra.items()})

        metrics["time/reload_s"] = run.to_training()  # vLLM sleeps, the training states come back

        # 2. score; drop samples without a usable reward (with --skip_bad_rewards), then whole groups
        batch = make_batch(samples, tokenizer.pad_token_id)
        scores, ok = run.score(batch_prompts, samples, batch)
        metrics["rollout/reward_mean"] = scores[ok].mean().item()
        metrics["rollout/reward_std"] = scores[ok].std().item() if len(ok) > 1 else 0.0
        metrics["rollout/skipped_rewards"] = len(samples) - len(ok)
        metrics.update(run.task_metrics(batch_prompts, samples))  # which answers are right by the task's rule
        usable = set(ok)
        groups_ok = [g for g in range(len(batch_prompts)) if all(g * n + j in usable for j in range(n))]
        if a.dynamic_filtering:  # DAPO: a group whose samples all pass (or all fail) teaches nothing
            low, high = a.dynamic_filtering_reward_range
            # an agent's episodes filter by their environment's scores (OpenRLHF's), others by the reward
            filt = torch.tensor(samples.agent["scores"]) if samples.agent is not None else scores
            means = filt.view(-1, n).mean(-1)
            inside = ((means > low) & (means < high)).tolist()
            metrics["rollout/filtered_groups"] = sum(not inside[g] for g in groups_ok)
            groups_ok = [g for g in groups_ok if inside[g]]
        keep_groups = _round_down(groups_ok, n, len(actor))
        if not keep_groups:
            log.warn_once("empty", f"step {step + 1}: no prompt group left after filtering; skipping the update")
            step += 1
            stopped = run.end_step(step, episode, step_in_episode, skipped, metrics | {"rollout/no_groups_left": 1.0})
            continue
        keep = [g * n + j for g in keep_groups for j in range(n)]
        if len(keep) < len(samples):
            samples, scores = samples.select(keep), scores[keep]
            batch = make_batch(samples, tokenizer.pad_token_id)
        mask = batch["action_mask"]
        metrics["rollout/response_len_mean"] = sum(samples.model_tokens()) / len(samples)  # an agent's feedback not counted
        metrics["rollout/truncated_frac"] = sum(samples.truncated) / len(samples)
        lag = step - min(samples.versions)  # versions between the weights that sampled and the trainer's
        if a.async_train:
            metrics.update(staleness(samples.versions, step, samples.token_versions))

        # 3. old and reference log-probs. With one optimizer step per rollout, PPO's old policy is the
        # trainer's weights before this update: its log-probs come free from the training forward (unless
        # the KL enters the reward, which needs them before the update). The engines' log-probs are then
        # checked, and the IS weights taken, in that forward too (actor_loss); for a stale rollout
        # (--async_train) those weights correct for the older weights that sampled it.
        t0 = time.perf_counter()
        steps_per_pass = max(1, len(samples) // a.train_batch_size)
        fresh = a.max_epochs == 1 and steps_per_pass == 1 and (a.init_kl_coef == 0 or kl_in_loss)
        if not fresh:
            batch["old_logprobs"] = run.per_rank(actor, "logprobs", batch, a.micro_rollout_batch_size)
        if "ref" in run.groups:
            batch["ref_logprobs"] = run.per_rank(run.groups["ref"], "logprobs", batch, a.micro_rollout_batch_size)
        if "old_logprobs" in batch and "ref_logprobs" in batch:
            kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], a.kl_estimator) * mask
        else:
            kl = torch.zeros_like(mask)
        metrics["train/kl"] = masked_mean(kl, mask).item()
        if "gen_logprobs" in batch and not fresh:  # does the engine sample from the policy the trainer holds?
            gen = batch["gen_logprobs"] if gspo_vs_sampler else batch.pop("gen_logprobs")
            gap, is_weights = sampler_gap(batch["old_logprobs"], gen, mask, correction)
            metrics.update({f"rollout/{k}": v for k, v in gap.items()})
            if is_weights is not None:
                batch["is_weights"] = is_weights
        metrics["time/logprobs_s"] = time.perf_counter() - t0

        # 4. advantages
        # --normalize_reward (OpenRLHF's) is applied by the reward model and the critic themselves (common.training.models)
        scores, penalized = length_penalties(
            scores, mask.sum(-1), torch.tensor(samples.truncated), max_new_tokens=a.generate_max_len,
            overlong_buffer_len=a.overlong_buffer_len, overlong_penalty_factor=a.overlong_penalty_factor,
            stop_properly_penalty_coef=a.stop_properly_penalty_coef)
        metrics.update({f"rollout/{k}": v for k, v in penalized.items()})
        if n > 1:  # groups whose samples all scored the same: the group estimators give them advantage 0
            metrics["rollout/tied_group_frac"] = group_all_equal(scores, n).float().mean().item()
        # group baseline, reward clip, the KL penalty in the token rewards, reward-to-go, whitening
        batch["advantages"], _ = rl_advantages(
            scores, kl, mask, estimator=a.advantage_estimator, n=n, kl_coef=0.0 if kl_in_loss else kl_ctl.value,
            gamma=a.gamma, std_norm=not a.no_advantage_std_norm, reward_clip=tuple(a.reward_clip_range))

        # 5. train the actor: max_epochs passes, train_batch_size samples per optimizer step
        t0 = time.perf_counter()
        world = len(actor)
        history = []
        for _ in range(a.max_epochs):
            parts = actor.call_per_rank("train", [(b, actor_loss) for b in split_batch(batch, world)],
                                        output="logprobs", micro_batch=a.micro_train_batch_size,
                                        steps=steps_per_pass, entropy=a.entropy_loss_coef is not None,
                                        skip_nonfinite=a.skip_nonfinite_updates, step=step + 1)
            history += parts[0]
        metrics["time/train_s"] = time.perf_counter() - t0
        skipped["actor"] += int(sum(h.pop("skipped") for h in history))  # a count, not averaged below
        for k in history[0]:
            name = k if "/" in k else f"time/actor_{k}" if k.endswith("_s") else f"train/{k}"
            metrics[name] = sum(h[k] for h in history) / len(history)
        if "old_logprobs" not in batch and "train/kl_loss" in metrics:  # the KL was measured in the loss
            metrics["train/kl"] = metrics["train/kl_loss"]
        kl_ctl.update(metrics["train/kl"], len(samples))
        metrics["train/kl_coef"] = kl_ctl.value
        if lag == 0 and metrics.get("rollout/logprob_diff", 0.0) > a.logprob_diff_warn:  # stale: a gap is expected
            log.warn_once(f"lp{step}", f"step {step + 1}: trainer and vLLM log-probs differ by "
                          f"{metrics['rollout/logprob_diff']:.4f} on average (> --logprob_diff_warn {a.logprob_diff_warn})")
        if a.skip_nonfinite_updates:
            metrics["train/skipped_updates"] = skipped["actor"]

        # 6. the new weights to the rollout side, the training states off the GPU (common.rl.run); an
        # engine takes them after the rollouts it is generating (--partial_rollout: after its current chunk)
        metrics.update(rollouts.settle())
        run.to_rollout(metrics, step + 1)
        metrics["time/step_s"] = time.perf_counter() - t_step
        tokens = int(batch["attention_mask"].sum())
        metrics["perf/tokens_per_s"] = tokens / metrics["time/step_s"]
        step += 1

        run.evaluate(step, sampling, step_in_episode + 1 == run.steps_per_episode, metrics)
        # training health: say early what usually shows up late as a collapsed run (the summary judges the end)
        if metrics["train/kl"] > KL_WARN:
            log.warn_once(f"kl{step // 50}", f"step {step}: KL to the reference is {metrics['train/kl']:.2f} (> {KL_WARN:g}): "
                          "the policy is drifting fast; consider a larger --init_kl_coef or a smaller learning rate")
        if metrics.get("train/entropy", 1.0) < 0.05:
            log.warn_once(f"ent{step // 50}", f"step {step}: entropy {metrics['train/entropy']:.3f}: sampling has "
                          "collapsed to near-greedy; rewards may stop improving")
        if metrics["rollout/truncated_frac"] > TRUNCATED_WARN:
            log.warn_once("trunc", f"step {step}: {metrics['rollout/truncated_frac']:.0%} of responses hit "
                          f"--generate_max_len {a.generate_max_len}")
        stopped = run.end_step(step, episode, step_in_episode, skipped, metrics)  # log, checkpoints, SIGTERM/Ctrl-C
        if step % 10 == 1:
            i = 0
            log.info(f"sample: {prompt_tail(tokenizer, batch_prompts[samples.prompt_index[i]].prompt_ids)} -> "
                     f"{tokenizer.decode(samples.response_ids[i], skip_special_tokens=True)!r} (reward {scores[i].item():.2f})")
    run.finish(stopped)


def _round_down(groups_ok: list[int], n: int, world: int) -> list[int]:
    """Keep a number of prompt groups whose samples split evenly over the actor's ranks."""
    unit = math.lcm(world, n) // n
    k = len(groups_ok) // unit * unit
    return groups_ok[:k]


if __name__ == "__main__":
    app()
