"""The set-up and the mechanics that train_ppo.py and train_grpo.py share, as one object: prompts and
rewards, Ray and the role groups, vLLM engines and the weight sync, sleep, resume, evaluation,
checkpoints and the logger.

The script keeps the algorithm: which models exist (their `ModelSpec`s), the loop and its phase order,
the advantages and the losses, the metrics. `a` is the script's parsed options.
"""
from __future__ import annotations

import math
import os
import random

from common import cpu_threads
from common.cluster import memory_plan
from common.errors import require

# The reference of a LoRA run: the actor's own model with its adapter switched off (common.rl.guests.Host.host_base)
ADAPTER_OFF = "the actor's base (LoRA adapter off)"


def split_note(actor, engines: list) -> list[str]:
    """The banner's line of the cores each side holds, as its processes report them (SPLIT runs only)."""
    if os.environ.get(cpu_threads.SPLIT) != "1" or not engines:
        return []
    from common.cluster.ray_groups import get

    trainer = get(actor.async_call("cores"), 60, "cores")
    engine = get([e.cores.remote() for e in engines], 60, "cores")
    mine = lambda lists: ",".join(str(c) for c in sorted({c for cs in lists for c in cs}))  # noqa: E731
    return [f"--async_train on CPU: the trainer's workers on cores {mine(trainer)}, the vLLM engines on cores {mine(engine)}"]


def run_metrics(groups: dict, engines: list, plan, metrics: dict, asked: list, deferred: bool) -> list:
    """An RL run's `mem/` metrics into `metrics`: each role's process (rank 0's; a role hosted in another's
    process is counted there) and the engines' (the largest) beside the memory plan's `plan`. With
    `deferred` (--async_train) an engine is generating the next rollout now and runs its calls in order:
    the figures `asked` for at the last step are read instead, and this step's are asked for (returned)."""
    from common.rl.guests import GuestGroup
    from common.cluster.gpu_memory import combine, mem_metrics
    from common.cluster.ray_groups import get

    for g in groups.values():
        if not isinstance(g, GuestGroup):
            metrics.update(mem_metrics(g.role, g.call("gpu_memory")[0], plan))
    now = [e.gpu_memory.remote() for e in engines]
    read, later = (asked, now) if deferred else (now, [])
    if read:
        metrics.update(mem_metrics("vllm", combine(get(read, 120, "vLLM memory")), plan))
    return later


class RLRun:
    """Built in two calls: `RLRun(a, plan)` (seeds, tokenizer, prompts, reward source, Ray, placement
    groups), then `start(specs, ...)` (role groups, engines, weight sync, resume, logger and banner)."""

    def __init__(self, a: dict, plan):
        import torch

        from common.training import ds
        from common.training.checkpoint import Preemption
        from common.training.models import load_tokenizer, resolve_pretrain
        from common.cluster.ray_groups import create_placement_groups, init_ray
        from common.cluster.resources import check_fits
        from common.rl.checks import cpu_refused
        from common.rl.eval import load_prompts, text_scorer
        from common.rollout.weight_sync import choose_transport

        self.a, self.plan = a, plan
        random.seed(a["seed"])
        torch.manual_seed(a["seed"])
        self.pretrain = resolve_pretrain(a["pretrain"])
        from common.training.lora import adapter_base

        require(not (a["vllm_num_engines"] and adapter_base(self.pretrain)), f"--pretrain {self.pretrain} is a LoRA "
                "adapter, and the vLLM engines load whole models: merge it into its base first (python -m "
                f"common.training.lora --lora_path {self.pretrain} --output_path DIR) and give DIR")
        self.tokenizer = load_tokenizer(self.pretrain)
        self.prompts, self.eval_prompts, self.src, self.dropped = load_prompts(a, self.tokenizer)
        # the built-in task's prompts: its rule says which answers are right, whatever the reward source
        builtin = a["prompt_data"] is None and not a["agent_func_path"]  # an agent's episodes hold its feedback too
        self.task_rule = {"rollout": builtin, "eval": builtin and not a["eval_dataset"]}
        self.history: list[dict] = []  # each step's health metrics, for the summary at the end (common.rl.eval)
        self.health: tuple = ({}, [], [])
        self.steps_per_episode = len(self.prompts) // a["rollout_batch_size"]
        require(self.steps_per_episode > 0,
                f"{self.src}: {len(self.prompts)} prompts is fewer than --rollout_batch_size {a['rollout_batch_size']}")
        self.total_steps = min(a["max_steps"] or math.inf, self.steps_per_episode * a["num_episodes"])
        self.score_text = text_scorer(a)  # None: the reward model's workers score
        self.agent, self.agent_limits = None, None
        if a["agent_func_path"]:  # OpenRLHF's agent file: its environment rewards each episode
            from common.rl.agent import Limits, load_executor, role_tokens

            self.agent = load_executor(a["agent_func_path"])
            role = a["agent_feedback_role"]
            prefix, suffix = role_tokens(self.tokenizer, role) if role else ([], [])
            self.agent_limits = Limits(max_turns=a["max_turns"], max_tokens_per_turn=a["max_tokens_per_turn"],
                                       feedback_prefix=prefix, feedback_suffix=suffix, feedback_role=role,
                                       step_timeout=a["agent_timeout"])
        # a layout that cannot fit the GPU stops here, before Ray and the models (common/cluster/memory_plan.py)
        self.longest_prompt = max(len(p.prompt_ids) for p in self.prompts)
        longest = self.longest_prompt + a["generate_max_len"]
        self.memory = memory_plan.preflight(memory_plan.from_options(a, "rl", plan, seq=longest))

        self.roles = {r.role: r for r in plan.roles}
        # --vllm_sync_backend against the placement: refused here, before Ray and the models load
        self.transport = choose_transport(a["vllm_sync_backend"], use_gpu=plan.use_gpu,
                                          colocated=plan.vllm_group == self.roles["actor"].group) \
            if a["vllm_num_engines"] else None
        self.settings = ds.DSSettings.from_options(a, bf16=a["bf16"], fused_adam=a["deepspeed_enable_sleep"])
        from common.training.lora import LoraSettings

        self.lora = LoraSettings.from_options(a)
        for role in ("actor", "critic"):  # refused here, not after the models have loaded
            if role in self.roles:
                ds.grad_accumulation(self.settings, self.roles[role].workers)
        if a["async_train"] and not plan.use_gpu and plan.vllm_group != self.roles["actor"].group:
            os.environ[cpu_threads.SPLIT] = "1"  # before Ray: each worker then pins itself (common.cpu_threads)
        # the layout against the cluster and the flags a CPU run refuses (the sleep flags): one message for all
        resources = init_ray(num_cpus=max(os.cpu_count() or 1, int(plan.total().get("CPU", 0)) + 2), plan=plan,
                             drop=cpu_refused(a, plan.use_gpu))
        # Right after Ray, whose init installs its own SIGTERM handler in this process: a SIGTERM (Slurm's
        # time-limit warning) while the models load still ends in a checkpoint after the first step.
        self.preempt = Preemption()
        check_fits(plan, resources)
        self.pgs = create_placement_groups(plan)
        n = a["n_samples_per_prompt"]
        self.optim_steps = a["rollout_batch_size"] * n // a["train_batch_size"] * a["max_epochs"]
        self.ckpt_root = a["ckpt_path"] or os.path.join(a["save_path"], "checkpoints")
        self.groups, self.engines, self.sync = {}, [], None
        self._vllm_memory: list = []  # --async_train: the engines' memory figures asked for, not yet read

    def optim(self, lr: float) -> dict:
        """The optimizer and schedule of a trained role (common.training.ds.initialize's keywords)."""
        a = self.a
        return dict(lr=lr, total_steps=int(self.total_steps * self.optim_steps), warmup_ratio=a["lr_warmup_ratio"],
                    scheduler=a["lr_scheduler"], betas=a["adam_betas"], weight_decay=a["l2"])

    def spec(self, path: str, kind: str, lr: float | None = None, **kw):
        """A role's ModelSpec from the shared flags: trained when given a learning rate; value models
        (reward, critic) with the value-head flags, causal LMs with --share_prompt_prefix."""
        from common.rl.workers import ModelSpec

        a = self.a
        extra = (dict(value_head_prefix=a["value_head_prefix"], normalize_reward=a["normalize_reward"]) if kind == "value"
                 else dict(share_prefix=a["share_prompt_prefix"]))  # value models run whole rows
        return ModelSpec(path, kind, lr is not None, self.settings, optim=self.optim(lr) if lr is not None else {},
                         lora=self.lora if lr is not None else None,
                         bf16=a["bf16"], flash_attn=a["flash_attn"], seed=a["seed"], temperature=a["temperature"],
                         packing=a["packing_samples"], **extra, **kw)

    def policy_specs(self) -> dict:
        """The actor (which also samples without vLLM engines), and the reference and reward model when the
        resource plan has them."""
        a = self.a
        specs = {"actor": self.spec(self.pretrain, "causal_lm", a["actor_learning_rate"],
                                    static_cache=a["static_kv_cache"], liger=a["use_liger_kernel"])}
        if "ref" in self.roles:
            specs["ref"] = self.spec(self.pretrain, "causal_lm", offload=a["ref_reward_offload"])
        elif self.lora.on and a["init_kl_coef"] > 0:  # the plan gave it no model: the actor's base is the reference
            specs["ref"] = ADAPTER_OFF
        if "reward" in self.roles:
            specs["reward"] = self.spec(a["reward_pretrain"], "value", offload=a["ref_reward_offload"])
        return specs

    def start(self, specs: dict, *, title: str, plot_keys: tuple, derived: list[str], notes: list[str]) -> dict:
        """Start a worker group per role ({role: ModelSpec}, the actor first), the engines, the weight sync;
        resume when asked; open the logger and print the banner. Returns the resumed loop state."""
        from common.training.checkpoint import latest_checkpoint
        from common.rl.guests import GuestGroup
        from common.cluster.resources import hosts
        from common.logger import MetricsLogger, git_commit, versions
        from common.cluster.ray_groups import RoleGroup, get
        from common.cluster.resources import plan_rows, plan_summary
        from common.rl.eval import BestCheckpoint
        from common.rollout.samples import generation_note, positions_note
        from common.rollout.vllm_engine import EngineSpec, start_placed
        from common.rollout.weight_sync import AdapterSync, WeightSync
        from common.rl.workers import ModelWorker

        a, plan = self.a, self.plan
        calls = []
        hosted = hosts(plan)  # frozen roles loaded into a trained role's processes on the same GPUs
        # a host's own model loads first
        for role, spec in sorted(specs.items(), key=lambda kv: kv[0] in hosted or kv[1] == ADAPTER_OFF):
            if spec == ADAPTER_OFF:  # LoRA: the actor's workers serve it with the adapter switched off
                self.groups[role] = GuestGroup(role, self.groups["actor"])
                calls.append((self.groups["actor"], "host_base", role))
                continue
            if role in hosted:
                self.groups[role] = GuestGroup(role, self.groups[hosted[role]])
                calls.append((self.groups[hosted[role]], "host", role, spec))
                continue
            self.groups[role] = RoleGroup(role, ModelWorker, self.roles[role], self.pgs[self.roles[role].group])
            calls.append((self.groups[role], "setup", spec))
        self.actor = self.groups["actor"]
        # vLLM sizes its KV cache from the device's free memory before and after its profiling pass, so a model
        # loading on the same GPU meanwhile shrinks it (3B, reference flags: 21 of the planned 41.9 GiB on
        # 2026-12-03). On a shared GPU the engines start first, asleep under --vllm_enable_sleep while the
        # models load (OpenRLHF's order); on their own GPUs, or on CPU, they start while the models load.
        first = plan.use_gpu and plan.vllm_group in {self.roles[r].group for r in specs if r in self.roles}
        n_engines = a["vllm_num_engines"]
        engine_spec = EngineSpec.from_options(a, plan, self.pretrain) if n_engines else None
        self.engine_max_len = engine_spec.max_model_len if engine_spec else 0  # an agent episode's ceiling
        if first:
            self.engines = start_placed(n_engines, engine_spec, plan, self.pgs, self.actor)
            self.vllm_sleep("sleep", a["vllm_sleep_level"])
        pending = [group.async_call(*args) for group, *args in calls]
        if not first:
            self.engines = start_placed(n_engines, engine_spec, plan, self.pgs, self.actor)
        infos = [get(p, 1800, "model setup") for p in pending]
        if self.engines and self.lora.on:  # the engines keep their base: only the adapter travels
            self.sync = AdapterSync(self.actor, self.engines, timeout_s=a["vllm_sync_timeout"])
        elif self.engines:
            self.sync = WeightSync(self.actor, self.engines, transport=self.transport, bucket_mb=a["vllm_sync_bucket_mb"],
                                   timeout_s=a["vllm_sync_timeout"], tp=a["vllm_tensor_parallel_size"],
                                   overlap_load=a["async_train"])
        self.trained = [self.groups[r] for r in ("actor", "critic") if r in self.groups]
        asleep = first and a["vllm_enable_sleep"]

        state = {"step": 0, "episode": 0, "step_in_episode": 0, "skipped_updates": {g.role: 0 for g in self.trained}}
        self.resumed = latest_checkpoint(os.path.join(self.ckpt_root, "actor")) if a["load_checkpoint"] else None
        if self.resumed:  # every trained role saved the same step under its own folder
            for g in self.trained:
                state = g.call("load_checkpoint", self.resumed.replace(
                    os.path.join(self.ckpt_root, "actor"), os.path.join(self.ckpt_root, g.role)))[0]
            if self.engines and not asleep:  # the engines start from --pretrain; give them the resumed weights
                self.sync(state["step"])
        state.setdefault("skipped_updates", {g.role: 0 for g in self.trained})  # older checkpoints have none
        if asleep:  # rollouts come first: wake the engines with the actor's (perhaps resumed) weights
            self.to_rollout({}, state["step"])
        else:
            self.ds_sleep("offload_states")  # rollouts come first: give vLLM the memory

        n = a["n_samples_per_prompt"]
        self.log = log = MetricsLogger(
            a["save_path"], self.total_steps, enabled=True, config=dict(a, pretrain=self.pretrain), use_wandb=a["use_wandb"],
            wandb_project=a["wandb_project"], wandb_run_name=a["wandb_run_name"], tensorboard_dir=a["use_tensorboard"],
            title=title, plot_keys=plot_keys, start_step=state["step"] + 1, append=bool(self.resumed))
        log.banner(f"hybridrl {title}", {
            "run": {"model": self.pretrain, **self._lora_lines(specs), "estimator": a["advantage_estimator"],
                    "prompts": f"{self.src} ({len(self.prompts)}, {self.dropped} dropped as too long)",
                    "eval": f"{len(self.eval_prompts)} prompts x {a['eval_n_samples_per_prompt']} samples"
                            if self.eval_prompts else "-",
                    "reward": a["reward_pretrain"] or a["reward_func"] or a["remote_rm_url"] or "built-in copy rule",
                    "step": f"{a['rollout_batch_size']} prompts x {n} samples, {self.optim_steps} optimizer step(s)",
                    "steps": self.total_steps, "resumed from": self.resumed or "-", "output": a["save_path"],
                    "git": git_commit()},
            "versions": versions()})
        log.table("resource plan", plan_rows(plan))
        log.info(plan_summary(plan))
        memory_plan.show(log, self.memory)
        for note in derived:
            log.info(f"default: {note}")
        gen_note = generation_note(plan.use_gpu, a["vllm_num_engines"], a["static_kv_cache"], a["zero_stage"])
        for line in split_note(self.actor, self.engines):
            log.info(line)
        notes = notes + [n for n in [positions_note(self.pretrain, self.longest_prompt, a["generate_max_len"])] if n]
        for note in [m for info in infos for m in info[0]["notes"]] + ([gen_note] if gen_note else []) + notes:
            log.warn_once(note, note)
        self.best = BestCheckpoint(a["best_metric_key"], state.get("best"))
        return state

    def _lora_lines(self, specs: dict) -> dict:
        """The banner's LoRA lines: the adapter, where the reference comes from, what the sync sends."""
        if not self.lora.on:
            return {}
        out = {"LoRA": f"{self.lora.describe()}; trained roles: {', '.join(r for r in ('actor', 'critic') if r in specs)}"}
        if specs.get("ref") == ADAPTER_OFF:
            out["reference"] = ("the actor's base, its adapter off, in the actor's processes (no reference model; "
                                "--ref_num_nodes, --ref_num_gpus_per_node and --colocate_actor_ref place nothing)")
        if self.engines:
            out["weight sync"] = "the adapter only, through Ray's object store (the engines keep the base they loaded)"
        return out

    # ---------------------------------------------------------------- phases
    def generate(self, batch_prompts: list, sampling: dict, seed: int, logprobs: bool = False):
        """Rollouts (common.rollout.samples.Samples) from the vLLM engines (their log-probs if asked) or the actor's ranks."""
        return self.submit(batch_prompts, sampling, seed, logprobs)()

    def submit(self, batch_prompts: list, sampling: dict, seed: int, logprobs: bool = False, chunk: int = 0):
        """`generate` started now (by the engines, in chunks of `chunk` new tokens if > 0: common.rollout.partial;
        the actor's ranks generate when asked for the result): returns `collect() -> Samples`."""
        from common.rollout.partial import submit_chunked
        from common.rollout.samples import generate_on_ranks
        from common.rollout.vllm_engine import submit_balanced

        ids = [p.prompt_ids for p in batch_prompts]
        if self.agent is not None:  # multi-turn episodes on the engines, in a thread: collect() waits for them
            return self._submit_episodes(batch_prompts, sampling, seed, logprobs, per_token_versions=chunk > 0)
        if self.engines and chunk:
            return submit_chunked(self.engines, ids, dict(sampling, logprobs=logprobs), seed, chunk)
        if self.engines:
            collect = submit_balanced(self.engines, ids, dict(sampling, logprobs=logprobs), seed)
            return lambda: collect(1800)
        return lambda: generate_on_ranks(self.actor, ids, sampling, seed)

    def _submit_episodes(self, batch_prompts: list, sampling: dict, seed: int, logprobs: bool,
                         per_token_versions: bool = False):
        import concurrent.futures

        from common.rl.agent import run_episodes

        a = self.a
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        job = pool.submit(run_episodes, self.agent, a["agent_func_path"], batch_prompts,
                          [p.label for p in batch_prompts], self.engines, self.tokenizer, n=sampling["n"],
                          temperature=sampling["temperature"], top_p=sampling["top_p"],
                          # OpenRLHF's budget: the prompt and every turn and feedback of the episode, within
                          # the engines' context (the model's positions)
                          max_length=min(a["prompt_max_len"] + a["generate_max_len"], self.engine_max_len),
                          seed=seed, logprobs=logprobs,
                          limits=self.agent_limits, timeout_s=1800, per_token_versions=per_token_versions)
        pool.shutdown(wait=False)
        return job.result

    def score(self, batch_prompts: list, samples, batch: dict, passed: list | None = None):
        """Scores [N] and the indices of samples whose reward is usable (`passed`, if given, gets each
        sample's pass flag for pass@k); an agent's episodes score by their environment's rewards."""
        from common.rl.rewards import score_rollout

        if samples.agent is not None:
            import torch

            if passed is not None:  # right by --eval_correct_threshold (common.rl.eval.pass_metrics)
                passed[:] = [None] * len(samples)
            return torch.tensor(samples.agent["rewards"], dtype=torch.float32), list(range(len(samples)))

        return score_rollout(batch_prompts, samples, batch, reward_group=self.groups.get("reward"),
                             score_text=self.score_text, tokenizer=self.tokenizer,
                             micro_batch=self.a["micro_rollout_batch_size"], passed=passed)

    def task_metrics(self, batch_prompts: list, samples, prefix: str = "rollout") -> dict:
        """<prefix>/exact_match on the built-in task's prompts (common.rl.eval.task_metrics), else nothing."""
        from common.rl.eval import task_metrics

        if samples.agent is not None:  # an agent's episodes: their turns and the environment's own logs
            ag, n = samples.agent, len(samples)
            out = {f"{prefix}/agent_turns_mean": sum(ag["turns"]) / n, f"{prefix}/agent_scores_mean": sum(ag["scores"]) / n}
            checked = [d for d in ag["drift"] if d is not None]
            if checked:  # the share of episodes a trainer re-rendering the messages would train differently on
                out[f"{prefix}/agent_drift_frac"] = sum(checked) / len(checked)
            for key in sorted({k for logs in ag["extra_logs"] for k in logs}):
                vals = [float(logs[key]) for logs in ag["extra_logs"] if isinstance(logs.get(key), (int, float))]
                if vals:
                    out[f"{prefix}/agent_{key}"] = sum(vals) / len(vals)
            return out
        if not self.task_rule[prefix]:
            return {}
        texts = self.tokenizer.batch_decode(samples.response_ids, skip_special_tokens=True)
        return task_metrics(texts, [batch_prompts[i].label for i in samples.prompt_index], prefix)

    def per_rank(self, group, method: str, batch: dict, *args):
        """A group method over the batch, each rank its equal share; the results concatenated."""
        import torch

        from common.rollout.samples import split_batch

        return torch.cat(group.call_per_rank(method, [(b, *args) for b in split_batch(batch, len(group))]))

    def evaluate(self, step: int, sampling: dict, end_of_episode: bool, metrics: dict) -> None:
        """Every --eval_steps steps, step 0 included (-1: at the end of each pass over the prompts), and at the
        last step: sample the held-out prompts and log eval/reward_mean and eval/pass@k (common.rl.eval)."""
        from common.rl.eval import pass_metrics
        from common.rollout.samples import make_batch

        a, every = self.a, self.a["eval_steps"]
        due = step == self.total_steps or (every > 0 and step % every == 0) or (every == -1 and end_of_episode)
        if not self.eval_prompts or not due:
            return
        k = a["eval_n_samples_per_prompt"]
        ev = self.generate(self.eval_prompts, dict(sampling, n=k, temperature=a["eval_temperature"]), seed=0)
        passed: list = []
        scores, ok = self.score(self.eval_prompts, ev, make_batch(ev, self.tokenizer.pad_token_id), passed)
        metrics.update(pass_metrics(scores, ok, passed, ev.prompt_index, k, a["eval_correct_threshold"]))
        metrics.update(self.task_metrics(self.eval_prompts, ev, "eval"))

    def evaluate_start(self, step: int, sampling: dict) -> None:
        """Step 0 of a run that is not resumed, with --eval_steps N > 0: evaluate the starting policy, logged as
        step 0, so the curve shows the improvement and a best checkpoint has to match it. Not saved: its
        weights are --pretrain's."""
        metrics: dict = {}
        if step == 0:
            self.evaluate(0, sampling, False, metrics)
        if metrics:
            self.best.improved(metrics, 0)
            self.log.log(0, metrics)

    # ---------------------------------------------------------------- checkpoints and the end
    def end_step(self, step: int, episode: int, step_in_episode: int, skipped: dict, metrics: dict) -> bool:
        """Log the step, keep the best checkpoint by --best_metric_key, save every --save_steps, and stop
        after a SIGTERM or Ctrl-C with a checkpoint. True when the run stops here."""
        from common.rl.eval import run_health

        a = self.a
        stop = step < self.total_steps and self.preempt.requested()
        self.history.append({k: metrics[k] for k in ("rollout/reward_mean", "rollout/exact_match",
                                                      "rollout/truncated_frac", "train/kl") if k in metrics})
        if step == self.total_steps or stop:  # the run's verdict goes in its last line too
            self.health = run_health(self.history, a["generate_max_len"])
            metrics.update(self.health[0])
        if step % a["logging_steps"] == 0 or step == self.total_steps or stop:
            self.log.log(step, metrics)
        pos = (episode + 1, 0) if step_in_episode + 1 == self.steps_per_episode else (episode, step_in_episode + 1)
        state = {"step": step, "episode": pos[0], "step_in_episode": pos[1], "skipped_updates": skipped}
        if self.best.improved(metrics, step):
            state["best"] = self.best.state()
            self._save(os.path.join(self.ckpt_root, "best"), step, state, 1)
            self.log.info(f"best {self.best.key} so far ({self.best.value:.4f}): saved to {self.ckpt_root}/best")
        if (a["save_steps"] > 0 and step % a["save_steps"] == 0 and step < self.total_steps) or stop:
            state["best"] = self.best.state()
            self.log.info(f"checkpoint saved: {self._save(self.ckpt_root, step, state, a['max_ckpt_num'])}")
        if stop:
            self.log.info(f"{self.preempt.reason()}: stopped after step {step}; --load_checkpoint resumes from {self.ckpt_root}")
            self.preempt.mark_stopped()
        return stop

    def _save(self, root: str, step: int, state: dict, keep: int) -> str:
        # the critic first: a checkpoint counts once the actor's is complete (resume looks there)
        for g in reversed(self.trained):
            path = g.call("save_checkpoint", os.path.join(root, g.role), step, state, keep, self.a["save_hf_ckpt"])[0]
        return path

    def finish(self, stopped: bool, extra_saves: dict | None = None) -> None:
        """Save the policy (and {role: folder} of `extra_saves`) unless stopped early; print the run's summary
        (common.rl.eval.run_health), its warnings last, and where its files went; close everything. A run
        stopped early then raises common.errors.Stopped (exit 143 or 130)."""
        import ray

        _, lines, warnings = self.health
        for line in lines:
            self.log.info(line)
        if self.best.step is not None:
            where = "the starting policy (--pretrain), not saved again" if self.best.step == 0 else f"{self.ckpt_root}/best"
            self.log.info(f"best {self.best.key} {self.best.value:.4f} at step {self.best.step}: {where}")
        for w in warnings:
            self.log.warn_once(w, f"run summary: {w}")
        if not stopped:
            self.actor.call("save_hf", self.a["save_path"])
            for role, path in (extra_saves or {}).items():
                self.groups[role].call("save_hf", path)
        if self.sync:  # after the saves: an engine's failed last load (--async_train) still ends the run, losing nothing
            self.sync.wait_loaded()
        saved = {} if stopped else {"policy": self.a["save_path"], **(extra_saves or {})}
        self.log.end(saved, resume_from=self.ckpt_root)  # where the files went: the run's last lines
        for g in self.groups.values():
            g.shutdown()
        for e in self.engines:
            ray.kill(e)
        ray.shutdown()  # now rather than at exit, where the interpreter first waits on Ray's threads (~0.5 s)
        if stopped:
            raise self.preempt.stopped()  # exit 143 / 130: training did not finish

    # The hybrid engine (vLLM and the trained models on the same GPUs), the driver's side: the order in which
    # each phase's memory is given back and taken (OpenRLHF's), and each process's measured peak beside the
    # plan. The trained workers' side is common/training/ds_sleep.py.
    def ds_sleep(self, method: str) -> float:
        """Hybrid engine: DeepSpeed states of the trained models leave the GPU (offload) or return."""
        if not self.a["deepspeed_enable_sleep"]:
            return 0.0
        return max(max(g.call(method)) for g in self.trained)

    def vllm_sleep(self, method: str, *args) -> None:
        from common.cluster.ray_groups import get

        if self.a["vllm_enable_sleep"]:
            get([getattr(e, method).remote(*args) for e in self.engines], 600, f"vLLM {method}")

    def to_training(self) -> float:
        """After generation: vLLM sleeps, the training states come back (the hybrid engine's order frees
        memory for each phase). Returns the reload's seconds."""
        self.vllm_sleep("sleep", self.a["vllm_sleep_level"])
        return self.ds_sleep("reload_states")

    def to_rollout(self, metrics: dict, version: int) -> None:
        """After training: new weights (policy `version`) to the engines, training states off the GPU, then the KV cache.

        vLLM's weights wake and are overwritten from the trainer's (which must still be on the GPU:
        offloading first made the engines load stale shards), then the training states leave, and only
        then does vLLM's KV cache, the largest piece, wake. Nothing to push when the policy generates itself."""
        if self.plan.use_gpu:  # each process's measured peak beside the plan's (the trainers' before they sleep)
            self.memory_metrics(metrics)
        if self.engines:
            self.vllm_sleep("wake_up", ["weights"])
            metrics.update(self.sync(version))
        metrics["time/offload_s"] = self.ds_sleep("offload_states")
        if self.engines:
            self.vllm_sleep("wake_up", ["kv_cache"])

    def memory_metrics(self, metrics: dict) -> None:
        """mem/{role}_... of every model's process and mem/vllm_... since the last call (common.cluster.gpu_memory)."""
        self._vllm_memory = run_metrics(self.groups, self.engines, self.memory, metrics, self._vllm_memory,
                                        deferred=self.a["async_train"])
