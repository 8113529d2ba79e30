#!/usr/bin/env bash
# GPU figures for docs/: run on the H200 machine from the repo root, after the bundles are installed
# (../shared/gpu/README.md). Each part fits one device call; figures land in $OUT.
#   bash bench/gpu_runs.sh dpo_rm     # RM and DPO, bf16, ZeRO-2 and ZeRO-3, 0.5B shape
#   bash bench/gpu_runs.sh grpo       # vLLM sleep/wake check, then GRPO with the hybrid engine, 20 steps
#   bash bench/gpu_runs.sh ppo        # PPO with the hybrid engine, 20 steps
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # Ray workers import common/ from here
export HF_HUB_OFFLINE=1 HYBRIDRL_CACHE=/tmp/hrl-cache TORCH_EXTENSIONS_DIR=/tmp/torch-ext PYTHONUNBUFFERED=1
PY=${PY:-python3}
M=/tmp/q05; RM=/tmp/q05rm
[ -d $M ] || $PY bench/make_model.py --shape 0.5b --out $M
[ -d $RM ] || $PY bench/make_model.py --shape 0.5b --out $RM --reward
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

run() {  # name, script, flags...: keep the metrics and the log tail
  local name=$1; shift
  local t0=$SECONDS
  timeout "${LIMIT:-400}" $PY "$@" --save_path "/tmp/runs/$name" > "/tmp/runs-$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  mkdir -p "$OUT/$name"
  cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name/" 2>/dev/null
  tail -c 20000 "/tmp/runs-$name.log" > "$OUT/$name/log.txt"
}

case "${1:-}" in
dpo_rm)
  common=(--pretrain $M --bf16 --max_steps 20 --train_batch_size 64 --micro_train_batch_size 16 --eval_steps -1)
  run rm_z2 train_rm.py "${common[@]}" --zero_stage 2
  run rm_z3 train_rm.py "${common[@]}" --zero_stage 3
  run dpo_z2 train_dpo.py "${common[@]}" --zero_stage 2
  run dpo_z3 train_dpo.py "${common[@]}" --zero_stage 3
  ;;
grpo)
  [ -n "${SKIP_SLEEP_CHECK:-}" ] || { $PY bench/sleep_check.py --model $M > "$OUT/sleep_check.txt" 2>&1; tail -5 "$OUT/sleep_check.txt"; }
  run grpo_hybrid train_grpo.py --pretrain $M --reward_pretrain $RM --bf16 --zero_stage 3 --colocate_all_models \
    --vllm_num_engines 1 --vllm_gpu_memory_utilization 0.3 --vllm_enable_sleep --deepspeed_enable_sleep \
    --rollout_batch_size 8 --n_samples_per_prompt 8 --generate_max_len 256 --train_batch_size 64 \
    --micro_train_batch_size 8 --micro_rollout_batch_size 32 --max_steps 20 --eval_steps -1 --actor_learning_rate 1e-6
  ;;
ppo)
  run ppo_hybrid train_ppo.py --pretrain $M --reward_pretrain $RM --bf16 --zero_stage 3 --colocate_all_models \
    --vllm_num_engines 1 --vllm_gpu_memory_utilization 0.3 --vllm_enable_sleep --deepspeed_enable_sleep \
    --rollout_batch_size 64 --generate_max_len 256 --train_batch_size 64 --micro_train_batch_size 8 \
    --micro_rollout_batch_size 32 --max_steps 20 --eval_steps -1 --actor_learning_rate 1e-6 --critic_learning_rate 1e-6
  ;;
*) echo "usage: $0 dpo_rm|grpo|ppo" >&2; exit 2 ;;
esac
