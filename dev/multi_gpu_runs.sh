#!/usr/bin/env bash
# The reference commands at their real shape on one node of several GPUs, and async across GPUs.
# Each mode fits one 10-minute run on the machine it names (x8: 8 GPUs, x2: 2), from the repo root with
# the vllm extra installed (make install EXTRAS=vllm,test); figures land in $OUT for docs/performance.md.
#   bash dev/multi_gpu_runs.sh ppo8     # x8: the reference PPO command verbatim (critic, RM, reference, 4 engines x TP 2,
#                                         #     colocated, both sleep modes, ZeRO-3, bf16, packing), Llama-3-8B shape
#   bash dev/multi_gpu_runs.sh grpo8    # x8: the reference GRPO command, the same shape
#   bash dev/multi_gpu_runs.sh async8   # x8: GRPO, 4 GPUs training + 4 GPUs of engines: synchronous, then --async_train
#   bash dev/multi_gpu_runs.sh async2   # x2: GRPO, 1.5B shape, the engine on one GPU, training on the other: sync vs async
# DRY=1 runs each mode's commands with --dry_run on any machine (a CPU too): config-only models, the
# resource plan and the memory plan per GPU, no weights (tests/test_cli.py runs them so).
# Env: STEPS (default 6: the first, then 5 measured), ROLLOUT (prompts per step; default the reference's 1024),
#      GEN (--generate_max_len; default the reference's 1024), OUT, PY, WORK (scratch: models, runs, logs; /tmp).
set -uo pipefail
WORK=${WORK:-/tmp}; OUT=${OUT:-$WORK/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # Ray workers import common/ from here
export HF_HUB_OFFLINE=1 HYBRIDRL_CACHE=$WORK/hrl-cache TORCH_EXTENSIONS_DIR=$WORK/torch-ext PYTHONUNBUFFERED=1
export VLLM_ALLOW_INSECURE_SERIALIZATION=1
PY=${PY:-python3}; DRY=${DRY:-0}; STEPS=${STEPS:-6}; ROLLOUT=${ROLLOUT:-1024}; GEN=${GEN:-1024}
MODELS=${MODELS:-$WORK/models}

model() {  # shape, name, [--reward]: a random-weight model of that shape (config only for a dry run)
  local dir=$MODELS/$2
  [ -f "$dir/config.json" ] || $PY bench/make_model.py --shape "$1" --out "$dir" ${3:-} \
    $([ "$DRY" = 1 ] && echo --config-only) >&2 || exit 1
  echo "$dir"
}

run() {  # name, script, flags...: the run's metrics and log tail, or the dry run's plan
  local name=$1; shift
  rm -rf "$WORK/runs/$name"  # a mode run again in one session: the scripts refuse a folder holding a run
  local t0=$SECONDS extra=(--max_steps "$STEPS" --eval_steps -1 --save_path "$WORK/runs/$name")
  [ "$DRY" = 1 ] && extra+=(--dry_run)
  timeout "${LIMIT:-560}" $PY "$@" "${extra[@]}" > "$WORK/runs-$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  mkdir -p "$OUT/$name"
  cp "$WORK/runs/$name/metrics.jsonl" "$OUT/$name/" 2>/dev/null
  tail -c 20000 "$WORK/runs-$name.log" > "$OUT/$name/log.txt"
  [ "$DRY" = 1 ] && cat "$WORK/runs-$name.log"
  return $rc
}

# The reference commands' flags (README, docs/openrlhf.md), models swapped for random
# weights of the same shape; only --rollout_batch_size and --generate_max_len may be scaled (ROLLOUT, GEN).
reference() {  # actor model, reward model
  echo --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8 \
    --critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8 \
    --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5 \
    --pretrain "$1" --reward_pretrain "$2" --micro_train_batch_size 8 --train_batch_size 128 \
    --micro_rollout_batch_size 16 --rollout_batch_size "$ROLLOUT" --max_epochs 1 --prompt_max_len 1024 \
    --generate_max_len "$GEN" --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 \
    --init_kl_coef 0.01 --normalize_reward --gradient_checkpointing --packing_samples \
    --vllm_enable_sleep --deepspeed_enable_sleep
}

[ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
case "${1:-}" in
  ppo8)
    M=$(model 8b l8b) && RM=$(model 8b l8brm --reward) || exit 1
    # shellcheck disable=SC2046  # the flags are words
    run ppo8 train_ppo.py $(reference "$M" "$RM")
    ;;
  grpo8)
    M=$(model 8b l8b) && RM=$(model 8b l8brm --reward) || exit 1
    # shellcheck disable=SC2046
    run grpo8 train_grpo.py $(reference "$M" "$RM" | sed 's/--critic_num_nodes 1 --critic_num_gpus_per_node 8 //') \
      --advantage_estimator group_norm --use_kl_loss --kl_estimator k3 --no_advantage_std_norm
    ;;
  async8)
    # GRPO without colocation: the actor and its reference on 4 GPUs, 4 engines on the other 4; a reward
    # function in place of the reward model (its own 4 GPUs would make 12)
    M=$(model 8b l8b) || exit 1
    flags=(--actor_num_gpus_per_node 4 --ref_num_gpus_per_node 4 --colocate_actor_ref
           --vllm_num_engines 4 --vllm_tensor_parallel_size 1 --pretrain "$M" --reward_func bench/length_reward.py
           --micro_train_batch_size 8 --train_batch_size 128 --micro_rollout_batch_size 16 --rollout_batch_size "$ROLLOUT"
           --prompt_max_len 1024 --generate_max_len "$GEN" --zero_stage 3 --bf16 --actor_learning_rate 5e-7
           --init_kl_coef 0.01 --use_kl_loss --gradient_checkpointing --packing_samples)
    run async8_sync train_grpo.py "${flags[@]}"
    run async8_async train_grpo.py "${flags[@]}" --async_train
    ;;
  async2)
    M=$(model 1.5b q15) || exit 1
    flags=(--actor_num_gpus_per_node 1 --ref_num_gpus_per_node 1 --colocate_actor_ref --vllm_num_engines 1
           --pretrain "$M" --rollout_batch_size "${ROLLOUT_X2:-64}" --n_samples_per_prompt 8 --train_batch_size 512
           --micro_train_batch_size 16 --generate_max_len "${GEN_X2:-256}" --bf16 --zero_stage 2 --gradient_checkpointing)
    run async2_sync train_grpo.py "${flags[@]}"
    run async2_async train_grpo.py "${flags[@]}" --async_train
    ;;
  *) echo "usage: bash dev/multi_gpu_runs.sh ppo8|grpo8|async8|async2   (DRY=1 for the plans only)"; exit 2 ;;
esac
