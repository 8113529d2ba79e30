#!/usr/bin/env bash
# GPU figures for docs/: run on the H200 machine from the repo root, after the bundles are installed
# (../shared/gpu/README.md). Each part fits one device call; figures land in $OUT.
#   bash bench/gpu_runs.sh dpo_rm     # RM and DPO, bf16, ZeRO-2 and ZeRO-3, 0.5B shape
#   bash bench/gpu_runs.sh grpo       # vLLM sleep/wake check, then GRPO with the hybrid engine, 20 steps
#   bash bench/gpu_runs.sh ppo        # PPO with the hybrid engine, 20 steps
#   bash bench/gpu_runs.sh check      # vLLM sampling-option costs; DeepSpeed sleep memory per state (ZeRO-2, 3)
#   bash bench/gpu_runs.sh x2         # two GPUs: actor (+ reference) on one, vLLM on the other, NCCL sync, 20 steps
#   bash bench/gpu_runs.sh tp2        # two GPUs: the reference PPO command's shape, 1 engine x TP 2, hybrid engine
#   bash bench/gpu_runs.sh tp2_grpo   # two GPUs: GRPO, hybrid engine, 1 engine x TP 2, 20 steps
#   bash bench/gpu_runs.sh diag       # vLLM generation: bare, through our engine class, in a Ray actor
#   bash bench/gpu_runs.sh bench      # bench/grpo_step.py, 0.5B, ours vs TRL, with vLLM colocated
#   bash bench/gpu_runs.sh train      # bench/train_step.py: the training phase per ZeRO stage, micro-batch, shape
#   bash bench/gpu_runs.sh bench_hf   # the same without vLLM
#   bash bench/gpu_runs.sh mfu        # the 1.5B shape, ours only: training-phase MFU
#   bash bench/gpu_runs.sh kernels    # fused log-prob kernels vs eager; training phase per bf16 mode
#   bash bench/gpu_runs.sh compile    # the training phase with --torch_compile (0.5B); mfu15: the 1.5B shape
#   bash bench/gpu_runs.sh diag2      # vLLM sampling options, GC, async scheduling, reload; training phase per bf16 mode
#   bash bench/gpu_runs.sh runner     # vLLM's model runner v1 vs v2: generation, weight pushes; ours on v2 (no TRL)
#   bash bench/gpu_runs.sh round2     # one engine vs two on one GPU; sleep/wake on runner v2; the bench, ours on v2
#   bash bench/gpu_runs.sh round3     # engine core in-process vs its own process (runner v2); the bench twice
#   bash bench/gpu_runs.sh round4     # Triton compiles in timed steps: ours without the engine's warm-up, then with it vs TRL
#   bash bench/gpu_runs.sh final      # the same-run bench twice in a row (LOGS=0: tables and logs stay there)
#   bash bench/gpu_runs.sh static     # ours generating for itself (common.decode, no vLLM) vs TRL with vLLM colocated
#   bash bench/gpu_runs.sh decode     # bench/decode_bench.py: the policy's own decoding vs transformers' and vLLM's
#   bash bench/gpu_runs.sh decode15   # the same on the 1.5B shape (no vLLM row)
#   bash bench/gpu_runs.sh three      # one bench run, three rows: ours with vLLM colocated, ours decoding itself, TRL with vLLM
#   bash bench/gpu_runs.sh memplan    # the memory plan's prediction next to each process's measured peak (0.5B, 1.5B, 3B)
#   bash bench/gpu_runs.sh i19prep    # issue 19: the 3B and 7B models, CUDA IPC from expandable segments (no vLLM needed)
#   bash bench/gpu_runs.sh i19gap     # issue 19: log-prob gap per way at 3B, then the equal-work bench at 3B, ours memory-cut
#   bash bench/gpu_runs.sh i19ref7    # issue 19: the reference flags at 7B with --adam_offload (5 steps after 1)
#   bash bench/gpu_runs.sh i19ref3    # issue 19: the reference flags at 3B (5 steps after 1)
#   bash bench/gpu_runs.sh i20        # issue 20: 0.5B bench, ours synchronous and --async_train on the one GPU, TRL
#   bash bench/gpu_runs.sh i19b       # issue 19: equal work at 1.5B, ours memory-cut against TRL
#   bash bench/gpu_runs.sh i19c       # issue 19: equal work at 0.5B, ours on its defaults, against TRL
#   bash bench/gpu_runs.sh i19e       # issue 19: equal work at 3B, ours memory-cut against TRL
#   bash bench/gpu_runs.sh i21b       # issue 19: equal work at 0.5B and 1.5B (the reference in the actor's process)
#   bash bench/gpu_runs.sh i21c       # issue 19: equal work at 3B, then the reference flags at 3B
#   bash bench/gpu_runs.sh i21d       # issue 19: the reference flags at 7B, each process's peak against the plan
#   bash bench/gpu_runs.sh i22a       # issue 19 (next): equal work at 0.5B and 1.5B, ZeRO-0 autocast + compiled blocks
#   bash bench/gpu_runs.sh i22mem     # issue 19 (next): what the 1.5B actor's process holds at its peak
#   bash bench/gpu_runs.sh i23a       # issue 19: equal work at 0.5B (ZeRO-0 autocast, compiled blocks) and 1.5B (not compiled)
# Env: Z (ZeRO stage of the hybrid runs, default 3), SYNC (--vllm_sync_backend, default auto),
#      OURS (more train_grpo.py flags for the bench modes), WARMUP (bench steps not timed, default 2).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # Ray workers import common/ from here
export HF_HUB_OFFLINE=1 HYBRIDRL_CACHE=/tmp/hrl-cache TORCH_EXTENSIONS_DIR=/tmp/torch-ext PYTHONUNBUFFERED=1
export VLLM_ALLOW_INSECURE_SERIALIZATION=1
PY=${PY:-python3}
M=/tmp/q05; RM=/tmp/q05rm; Z=${Z:-3}; SYNC=${SYNC:-auto}
[ -d $M ] || $PY bench/make_model.py --shape 0.5b --out $M
[ -d $RM ] || [ "${1:-}" != grpo -a "${1:-}" != ppo ] || $PY bench/make_model.py --shape 0.5b --out $RM --reward
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

run() {  # name, script, flags...: keep the metrics and the log tail
  local name=$1; shift
  local t0=$SECONDS
  timeout "${LIMIT:-400}" $PY "$@" --save_path "/tmp/runs/$name" > "/tmp/runs-$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  mkdir -p "$OUT/$name"
  cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name/" 2>/dev/null
  tail -c 20000 "/tmp/runs-$name.log" > "$OUT/$name/log.txt"
  return $rc
}
bench() {  # name, grpo_step.py flags...
  local name=$1; shift
  local t0=$SECONDS
  timeout "${LIMIT:-500}" $PY bench/grpo_step.py --work_dir /tmp/bench --out "$OUT/$name.json" "$@" > "/tmp/$name.txt" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  tail -20 "/tmp/$name.txt"
  # the device returns only a few files: with LOGS=0 the run's table and logs stay on the machine
  [ "${LOGS:-1}" = 0 ] || { cp "/tmp/$name.txt" "$OUT/"
    for f in /tmp/bench/*.log; do [ -f "$f" ] && tail -c 4000 "$f" > "$OUT/$name-$(basename "$f")"; done; }
  local m; m=$(ls -t /tmp/bench/ours-*/metrics.jsonl 2>/dev/null | head -1)  # this run's (vLLM or HF), per step
  [ -n "$m" ] && cp "$m" "$OUT/${name}_ours_metrics.jsonl"
}
plan_lines() {  # shape, name: the memory plan our run printed before it loaded a model
  grep -h "memory plan" -A12 "/tmp/bench/ours-$1-vllm.log" > "$OUT/$2_plan.txt" 2>/dev/null; cut -c1-200 "$OUT/$2_plan.txt"
}
prompts() {  # /tmp/prompts.jsonl: the bench's copy-task prompts (random-weight models: the length reward scores them)
  $PY -c "from bench.grpo_step import _prompt_file; _prompt_file('/tmp')"
}
REF="--colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep --zero_stage 3 --bf16 --gradient_checkpointing --packing_samples"
TASK=(--prompt_data /tmp/prompts.jsonl --input_key prompt --label_key label --apply_chat_template
      --reward_func bench/length_reward.py)
GRPO=(--rollout_batch_size 8 --n_samples_per_prompt 8 --generate_max_len 256 --train_batch_size 64
      --micro_rollout_batch_size 64 --max_steps 20 --eval_steps -1 --actor_learning_rate 1e-6 --bf16)

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
  run grpo_hybrid train_grpo.py --pretrain $M --reward_pretrain $RM --bf16 --zero_stage $Z --colocate_all_models \
    --vllm_num_engines 1 --vllm_gpu_memory_utilization 0.3 --vllm_enable_sleep --deepspeed_enable_sleep \
    --vllm_sync_backend $SYNC --rollout_batch_size 8 --n_samples_per_prompt 8 --generate_max_len 256 --train_batch_size 64 \
    --micro_train_batch_size 16 --micro_rollout_batch_size 64 --max_steps 20 --eval_steps -1 --actor_learning_rate 1e-6
  ;;
ppo)
  run ppo_hybrid train_ppo.py --pretrain $M --reward_pretrain $RM --bf16 --zero_stage $Z --colocate_all_models \
    --vllm_num_engines 1 --vllm_gpu_memory_utilization 0.3 --vllm_enable_sleep --deepspeed_enable_sleep \
    --vllm_sync_backend $SYNC --rollout_batch_size 64 --generate_max_len 256 --train_batch_size 64 --micro_train_batch_size 16 \
    --micro_rollout_batch_size 64 --max_steps 20 --eval_steps -1 --actor_learning_rate 1e-6 --critic_learning_rate 1e-6
  ;;
check)
  timeout 200 $PY bench/vllm_gen.py --model $M > "$OUT/vllm_gen.txt" 2>&1; tail -5 "$OUT/vllm_gen.txt"
  for z in 2 3; do
    timeout 200 $PY bench/ds_sleep_memory.py --model $M --zero-stage $z --out "$OUT/ds_sleep_z$z.json" > "$OUT/ds_sleep_z$z.txt" 2>&1
    echo "ds_sleep z$z: exit $?"; tail -c 1500 "$OUT/ds_sleep_z$z.txt"
  done
  ;;
x2)  # needs 2 GPUs: the plan puts actor + reference on GPU 0 and the engine alone on GPU 1
  prompts
  run grpo_x2 train_grpo.py --pretrain $M "${TASK[@]}" "${GRPO[@]}" --colocate_actor_ref --vllm_num_engines 1 \
    --vllm_sync_backend ${SYNC/auto/nccl} --vllm_gpu_memory_utilization 0.5 --micro_train_batch_size 16 --zero_stage 2
  ;;
tp2)  # needs 2 GPUs: every role on both, one vLLM engine of tensor parallel 2 on the same GPUs
  [ -d $RM ] || $PY bench/make_model.py --shape 0.5b --out $RM --reward
  run ppo_tp2 train_ppo.py --pretrain $M --reward_pretrain $RM --bf16 --zero_stage 3 \
    --actor_num_gpus_per_node 2 --ref_num_gpus_per_node 2 --critic_num_gpus_per_node 2 --reward_num_gpus_per_node 2 \
    --vllm_num_engines 1 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep \
    --vllm_gpu_memory_utilization 0.3 --gradient_checkpointing --packing_samples --vllm_sync_backend $SYNC \
    --rollout_batch_size 64 --generate_max_len 256 --train_batch_size 64 --micro_train_batch_size 8 \
    --micro_rollout_batch_size 32 --max_steps ${STEPS:-20} --eval_steps -1 --actor_learning_rate 1e-6 --critic_learning_rate 1e-6
  ;;
tp2_grpo)  # needs 2 GPUs: GRPO with the hybrid engine, actor and reference on both, one engine x TP 2
  prompts
  run grpo_tp2 train_grpo.py --pretrain $M "${TASK[@]}" "${GRPO[@]}" --zero_stage 3 --actor_num_gpus_per_node 2 \
    --ref_num_gpus_per_node 2 --vllm_num_engines 1 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_enable_sleep \
    --deepspeed_enable_sleep --vllm_gpu_memory_utilization 0.3 --vllm_sync_backend $SYNC --micro_train_batch_size 16
  ;;
diag)
  timeout 300 $PY bench/vllm_gen.py --model $M ${DIAG_FLAGS:-} > "$OUT/vllm_gen_ours.txt" 2>&1; echo "diag: exit $?"
  grep -E "tok/s|Error" "$OUT/vllm_gen_ours.txt"
  ;;
diag2)
  timeout 280 $PY bench/vllm_gen.py --model $M --no-ours --sync-sched --profile > "$OUT/vllm_gen2.txt" 2>&1; echo "vllm_gen: exit $?"
  grep -E "tok/s|reload|^--|Error" "$OUT/vllm_gen2.txt"
  timeout 250 $PY bench/train_step.py --model $M --stages 0,2 --micros 64 --modes master,autocast --profile \
    --out "$OUT/train_modes_0.5b.json" > "$OUT/train_modes_0.5b.txt" 2>&1; echo "train_step: exit $?"
  grep -E '^\{' "$OUT/train_modes_0.5b.txt"
  ;;
kernels)  # the fused log-prob kernels, then the training phase per bf16 mode with them
  timeout 200 $PY bench/logprob_kernel.py > "$OUT/logprob_kernel.txt" 2>&1; echo "logprob_kernel: exit $?"
  grep -E "ms|max" "$OUT/logprob_kernel.txt"
  timeout 200 $PY bench/train_step.py --model $M --stages 0,2 --micros 64 --modes master,autocast \
    --out "$OUT/train_fused_0.5b.json" > "$OUT/train_fused_0.5b.txt" 2>&1; echo "train_step: exit $?"
  grep -E '^\{' "$OUT/train_fused_0.5b.txt"
  ;;
compile)  # the training phase with compiled blocks (0.5B), then the 1.5B shape's training-phase MFU
  timeout ${T05:-150} $PY bench/train_step.py --model $M --stages 2 --micros 64 --modes ${MODES:-autocast,master+compile,autocast+compile} \
    --out "$OUT/train_compile_0.5b.json" > "$OUT/train_compile_0.5b.txt" 2>&1; echo "train_step 0.5b: exit $?"
  grep -E '^\{' "$OUT/train_compile_0.5b.txt" | cut -c1-220
  ;;
mfu15)
  [ -d /tmp/q15 ] || $PY bench/make_model.py --shape 1.5b --out /tmp/q15 > /dev/null 2>&1
  timeout ${T15:-200} $PY bench/train_step.py --model /tmp/q15 --stages ${STAGES15:-1} --micros ${MICROS15:-32} \
    --modes ${MODES15:-master,master+compile} --out "$OUT/train_1.5b.json" > "$OUT/train_1.5b.txt" 2>&1; echo "train_step 1.5b: exit $?"
  grep -E '^\{' "$OUT/train_1.5b.txt" | cut -c1-220
  ;;
loadpath)  # generation after weight pushes through each load path
  timeout ${TL:-150} $PY bench/vllm_gen.py --model $M --load-paths > "$OUT/vllm_load_paths.txt" 2>&1; echo "load paths: exit $?"
  grep -E " s " "$OUT/vllm_load_paths.txt"
  ;;
runner)  # vLLM's model runner v1 against v2 (VLLM_USE_V2_MODEL_RUNNER), then ours on v2 with frequent log-prob checks
  for r in 0 1; do
    VLLM_USE_V2_MODEL_RUNNER=$r timeout 200 $PY bench/vllm_gen.py --model $M --no-ours --seeds --no-reload --profile \
      > "$OUT/vllm_gen_runner_v$((r + 1)).txt" 2>&1; echo "vllm_gen runner v$((r + 1)): exit $?"
    grep -E "tok/s|Error" "$OUT/vllm_gen_runner_v$((r + 1)).txt"
  done
  VLLM_USE_V2_MODEL_RUNNER=1 timeout 150 $PY bench/vllm_gen.py --model $M --load-paths > "$OUT/vllm_load_v2.txt" 2>&1
  echo "load paths v2: exit $?"; grep -E " s |Error" "$OUT/vllm_load_v2.txt"
  VLLM_USE_V2_MODEL_RUNNER=1 TORCHINDUCTOR_COMPILE_THREADS=1 bench ours_v2 --shape 0.5b --vllm --micro_batch 64 --no-trl \
    --warmup 2 --ours_flags "--vllm_sync_backend $SYNC --zero_stage 2 --torch_compile --torch_autocast --logprob_diff_steps 2"
  ;;
round2)  # one engine against two on the GPU (runner v2), sleep/wake on runner v2, then the bench with ours on runner v2
  VLLM_USE_V2_MODEL_RUNNER=1 timeout 220 $PY bench/vllm_gen.py --model $M --no-bare --no-core-process --engines 2 --rounds 8 \
    > "$OUT/vllm_gen_engines.txt" 2>&1; echo "vllm_gen engines: exit $?"; grep -E "tok/s|rounds|Error" "$OUT/vllm_gen_engines.txt"
  VLLM_USE_V2_MODEL_RUNNER=1 timeout 120 $PY bench/sleep_check.py --model $M > "$OUT/sleep_check_v2.txt" 2>&1
  echo "sleep_check v2: exit $?"; tail -4 "$OUT/sleep_check_v2.txt"
  bench bench_vllm_v2 --shape 0.5b --vllm --micro_batch 64 --warmup ${WARMUP:-2} \
    --ours_env "VLLM_USE_V2_MODEL_RUNNER=1 TORCHINDUCTOR_COMPILE_THREADS=1" \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage ${BZ:-2} --torch_compile --torch_autocast ${OURS:-}"
  ;;
round3)  # runner v2 (now the scripts' default on GPU): engine core in-process or its own process; then the bench twice
  VLLM_USE_V2_MODEL_RUNNER=1 timeout 200 $PY bench/vllm_gen.py --model $M --no-bare --rounds 6 \
    > "$OUT/vllm_gen_core.txt" 2>&1; echo "vllm_gen core process: exit $?"; grep -E "tok/s|rounds|Error" "$OUT/vllm_gen_core.txt"
  CORE=$(awk '/in a Ray actor \(as the scripts\)/ {a=$(NF-5)} /engine core in its own process/ {c=$(NF-5)}
              END {print (c != "" && c < 0.95 * a) ? 1 : 0}' "$OUT/vllm_gen_core.txt")
  echo "engine core in its own process for the first bench: $CORE" | tee -a "$OUT/summary.txt"
  for i in 1 2; do
    [ $i = 2 ] && CORE=0
    bench bench_vllm_r3_$i --shape 0.5b --vllm --micro_batch 64 --warmup ${WARMUP:-2} --ours_env "VLLM_ENABLE_V1_MULTIPROCESSING=$CORE" \
      --ours_flags "--vllm_sync_backend $SYNC --zero_stage ${BZ:-2} --torch_compile --torch_autocast ${OURS:-}"
    grep -h "JIT compilation during inference" /tmp/ray/session_latest/logs/*.err 2>/dev/null | sed 's/.*inference: //' \
      | sort | uniq -c > "$OUT/bench_vllm_r3_${i}_jit.txt"
  done
  ;;
round4)  # Triton compiles inside timed steps? ours with the engine's warm-up declined (each run with a cold
  # Triton cache), then ours with it against TRL; LOGS=0 so that jit.txt fits in what the device returns
  flags="--vllm_sync_backend $SYNC --zero_stage ${BZ:-2} --torch_compile --torch_autocast ${OURS:-}"
  LOGS=0 bench bench_vllm_nowarm --shape 0.5b --vllm --no-trl --micro_batch 64 --warmup ${WARMUP:-2} \
    --ours_env "HYBRIDRL_VLLM_WARMUP=0 TRITON_CACHE_DIR=/tmp/triton-a" --ours_flags "$flags"
  grep -h "compiled Triton kernels" /tmp/ray/session_latest/logs/*.err 2>/dev/null | cut -c1-400 > "$OUT/jit.txt"
  LOGS=0 bench bench_vllm_warm --shape 0.5b --vllm --micro_batch 64 --warmup ${WARMUP:-2} \
    --ours_env "TRITON_CACHE_DIR=/tmp/triton-b" --ours_flags "$flags"
  echo "-- warm-up on" >> "$OUT/jit.txt"
  grep -h "compiled Triton kernels" /tmp/ray/session_latest/logs/*.err 2>/dev/null | cut -c1-400 >> "$OUT/jit.txt"
  ;;
final)  # the same-run bench twice in a row (ours, TRL, ours, TRL), with the scripts' defaults
  for i in 1 2; do
    LOGS=0 bench bench_vllm_final_$i --shape 0.5b --vllm --micro_batch 64 --warmup ${WARMUP:-2} \
      --ours_flags "--vllm_sync_backend $SYNC --zero_stage ${BZ:-2} --torch_compile --torch_autocast ${OURS:-}"
  done
  ;;
bench)  # BZ: our ZeRO stage (default 2), MB: our micro-batch (default 64, TRL's one pass)
  bench bench_vllm --shape 0.5b --vllm --micro_batch ${MB:-64} --warmup ${WARMUP:-2} \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage ${BZ:-2} ${OURS:-}"
  ;;
train)  # the training phase alone, per ZeRO stage and micro-batch, 0.5B and 1.5B shapes
  timeout 200 $PY bench/train_step.py --model $M --stages 0,1,2 --micros 16,64 --out "$OUT/train_0.5b.json" \
    > "$OUT/train_0.5b.txt" 2>&1; tail -7 "$OUT/train_0.5b.txt"
  [ -d /tmp/q15 ] || $PY bench/make_model.py --shape 1.5b --out /tmp/q15 > /dev/null 2>&1
  timeout 200 $PY bench/train_step.py --model /tmp/q15 --stages ${STAGES15:-1,2} --micros 16,32 --out "$OUT/train_1.5b.json" \
    > "$OUT/train_1.5b.txt" 2>&1; tail -5 "$OUT/train_1.5b.txt"
  ;;
bench_hf)  # ours generates with --static_kv_cache (common.decode; before 2026-12-01 transformers' compiled static cache), TRL with its default generate
  bench bench_hf --shape 0.5b --no-vllm --micro_batch ${MB:-64} --ours_flags "--static_kv_cache --zero_stage ${BZ:-2}"
  ;;
static)  # the same-run bench: ours with --static_kv_cache (no engine, no weight sync), TRL with vLLM colocated
  bench bench_static --shape 0.5b --vllm --ours-no-vllm --micro_batch ${MB:-64} --warmup ${WARMUP:-2} \
    --ours_flags "--static_kv_cache --torch_compile --zero_stage ${BZ:-2} ${OURS:-}"
  ;;
decode)
  timeout 400 $PY bench/decode_bench.py --model $M --no-hf-dynamic --out "$OUT/decode.json" > "$OUT/decode.txt" 2>&1
  tail -8 "$OUT/decode.txt"
  ;;
decode15)
  [ -d /tmp/q15 ] || $PY bench/make_model.py --shape 1.5b --out /tmp/q15
  timeout 400 $PY bench/decode_bench.py --model /tmp/q15 --no-hf-dynamic --no-vllm --out "$OUT/decode15.json" > "$OUT/decode15.txt" 2>&1
  tail -8 "$OUT/decode15.txt"
  ;;
three)  # the scripts' fastest flags for each way of generating
  LOGS=0 bench bench_three --shape 0.5b --vllm --micro_batch ${MB:-64} --warmup ${WARMUP:-2} \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage ${BZ:-2} --torch_compile --torch_autocast ${OURS:-}" \
    --ours_alt "--static_kv_cache --torch_compile --zero_stage ${BZ:-2} ${OURS:-}"
  cp /tmp/bench_three.txt "$OUT/" 2>/dev/null
  cp /tmp/bench/ours-0.5b-vllm/metrics.jsonl "$OUT/bench_three_ours_metrics.jsonl" 2>/dev/null
  cp /tmp/bench/ours-0.5b-alt/metrics.jsonl "$OUT/bench_three_alt_metrics.jsonl" 2>/dev/null
  ;;
mfu)
  bench mfu_1.5b --shape 1.5b --vllm --no-trl --micro_batch ${MB:-16} --ours_flags "--vllm_sync_backend $SYNC"
  ;;
memplan)  # the memory plan against measured peaks: ours only, vLLM colocated at 0.3, SHAPES (default 0.5b 1.5b 3b)
  for sh in ${SHAPES:-0.5b 1.5b 3b}; do
    ck=; [ "$sh" = 0.5b ] || ck=--gradient_checkpointing
    LOGS=0 bench mem_$sh --shape $sh --vllm --no-trl $ck --warmup 1 --steps ${STEPS:-2} \
      --ours_flags "--vllm_sync_backend $SYNC --zero_stage ${BZ:-2} ${OURS:-}"
    cp /tmp/bench/ours-$sh-vllm/metrics.jsonl "$OUT/mem_${sh}_metrics.jsonl" 2>/dev/null
    grep -h "memory plan" -A14 /tmp/bench/ours-$sh-vllm.log > "$OUT/mem_${sh}_plan.txt" 2>/dev/null
  done
  ;;
i19prep)  # before vLLM is installed: the bench's 3B and 7B models (built on the GPU), and the IPC check
  for sh in 3b 7b; do [ -d /tmp/bench/model-$sh ] || $PY bench/make_model.py --shape $sh --out /tmp/bench/model-$sh; done
  $PY bench/ipc_check.py 2>&1 | tail -3 | tee "$OUT/ipc_check.txt"
  ;;
i19gap)  # where logprob_diff comes from (3B), then equal work at 3B: ours with the memory cut (ZeRO-0 with fp32
  # weights under autocast, micro-batches of 16, expandable segments) against TRL, IS correction on both sides
  timeout 150 $PY bench/logprob_gap.py --model /tmp/bench/model-3b --out "$OUT/logprob_gap_3b.json" > /tmp/gap.txt 2>&1
  echo "logprob_gap: exit $?" | tee -a "$OUT/summary.txt"; tail -8 /tmp/gap.txt; tail -c 3000 /tmp/gap.txt > "$OUT/logprob_gap_3b.txt"
  LOGS=0 LIMIT=${LIMIT:-420} bench eq_3b --shape 3b --vllm --gradient_checkpointing --micro_batch 16 --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --micro_rollout_batch_size 16 ${OURS:-}"
  ;;
i19ref7)  # the reference command's flags on one GPU at 7B, with --adam_offload (half the optimizer's sub-groups in
  # CPU memory: --adam_offload_ratio; all of them do not fit a 125 GiB host) and micro-batches of 16
  LOGS=0 LIMIT=${LIMIT7:-480} bench ref_7b --shape 7b --vllm --no-trl --gradient_checkpointing --micro_batch 16 --warmup 1 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC $REF --adam_offload --adam_offload_ratio ${RATIO:-0.5} --micro_rollout_batch_size 16"
  grep -h "memory plan" -A6 /tmp/bench/ours-7b-vllm.log > "$OUT/ref_7b_plan.txt" 2>/dev/null
  tail -c 3000 /tmp/bench/ours-7b-vllm.log > "$OUT/ref_7b_log_tail.txt" 2>/dev/null
  free -g | tee -a "$OUT/summary.txt"
  ;;
i19ref3)  # the reference command's flags at 3B, micro-batches of 64 as in the issue
  LOGS=0 LIMIT=${LIMIT3:-360} bench ref_3b --shape 3b --vllm --no-trl --gradient_checkpointing --warmup 1 --steps ${STEPS3:-5} \
    --ours_flags "--vllm_sync_backend $SYNC $REF"
  plan_lines 3b ref_3b
  ;;
i20)  # issue 20 on one GPU: the 0.5B equal-work bench, ours synchronous (vLLM colocated at 0.3, the hybrid engine
  # without sleep) and with --async_train on the same placement (engine and trainer resident on the one GPU), then TRL
  LOGS=0 LIMIT=${LIMIT:-480} bench i20_05b --shape 0.5b --vllm --async --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC ${OURS:-}"
  ;;
i19b)  # issue 19: equal work at 1.5B, ours with the 3B memory cut (ZeRO-0 fp32 weights under autocast, micro 16)
  LOGS=0 LIMIT=${LIMIT:-540} bench eq_15b --shape 1.5b --vllm --gradient_checkpointing --micro_batch 16 --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --micro_rollout_batch_size 16 ${OURS:-}"
  ;;
i19c)  # issue 19: equal work at 0.5B, ours on its defaults (ZeRO-2, bf16, micro-batch 64) against TRL
  LOGS=0 LIMIT=${LIMIT:-480} bench eq_05b --shape 0.5b --vllm --warmup 2 --steps 5 --ours_flags "--vllm_sync_backend $SYNC ${OURS:-}"
  ;;
i19e)  # issue 19: equal work at 3B, ours with the memory cut (as i19gap, without the log-prob gap study)
  LOGS=0 LIMIT=${LIMIT:-540} bench eq_3b --shape 3b --vllm --gradient_checkpointing --micro_batch 16 --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --micro_rollout_batch_size 16 ${OURS:-}"
  ;;
i21b)  # issue 19: equal work at 0.5B (ours ZeRO-2 bf16, micro-batches of 32) and 1.5B (ZeRO-0 autocast, micro 32), vs TRL
  LOGS=0 LIMIT=${LIMIT05:-220} bench eq_05b --shape 0.5b --vllm --micro_batch 32 --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC ${OURS:-}"
  LOGS=0 LIMIT=${LIMIT15:-320} bench eq_15b --shape 1.5b --vllm --gradient_checkpointing --micro_batch ${MB15:-32} --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --micro_rollout_batch_size 16 ${OURS:-}"
  ;;
i21c)  # issue 19: equal work at 3B (ours ZeRO-0 autocast, micro 16) vs TRL, then the reference flags at 3B (ours only)
  LOGS=0 LIMIT=${LIMIT3:-300} bench eq_3b --shape 3b --vllm --gradient_checkpointing --micro_batch ${MB3:-16} --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --micro_rollout_batch_size 16 ${OURS:-}"
  LOGS=0 LIMIT=${LIMITR:-270} bench ref_3b --shape 3b --vllm --no-trl --gradient_checkpointing --warmup 1 --steps 4 \
    --ours_flags "--vllm_sync_backend $SYNC $REF"
  ;;
i21d)  # issue 19: the reference flags at 7B with partial Adam offload, a few steps: each process's peak against the plan
  [ -d /tmp/bench/model-7b ] || $PY bench/make_model.py --shape 7b --out /tmp/bench/model-7b > /dev/null 2>&1
  LOGS=0 LIMIT=${LIMIT7:-420} bench ref_7b --shape 7b --vllm --no-trl --gradient_checkpointing --micro_batch 16 --warmup 1 \
    --steps ${STEPS7:-2} --ours_flags "--vllm_sync_backend $SYNC $REF --adam_offload --adam_offload_ratio ${RATIO:-0.5} --micro_rollout_batch_size 16"
  plan_lines 7b ref_7b
  free -g | tee -a "$OUT/summary.txt"
  ;;
i22a)  # issue 19, next: equal work at 0.5B and 1.5B with compiled blocks and fp32 weights under autocast (micro 32)
  for sh in ${SHAPES:-0.5b 1.5b}; do
    ck=; [ "$sh" = 0.5b ] || ck=--gradient_checkpointing
    LOGS=0 LIMIT=${LIMIT:-300} bench eq_${sh}_c --shape $sh --vllm $ck --micro_batch 32 --warmup 2 --steps 5 \
      --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --torch_compile --micro_rollout_batch_size 16 ${OURS:-}"
  done
  ;;
i22mem)  # issue 19, next: where the 1.5B actor's peak goes (a memory history of its process, read by bench/mem_peak.py)
  rm -rf /tmp/snap
  LOGS=0 LIMIT=${LIMIT:-240} bench mem_15b --shape 1.5b --vllm --no-trl --gradient_checkpointing --micro_batch 32 --warmup 1 \
    --steps 1 --ours_env "HYBRIDRL_MEMORY_SNAPSHOT=/tmp/snap" \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --micro_rollout_batch_size 16 ${OURS:-}"
  for f in /tmp/snap/*.pickle; do $PY bench/mem_peak.py "$f" --top 30; done > "$OUT/mem_15b_peak.txt" 2>&1; cat "$OUT/mem_15b_peak.txt"
  ;;
i23a)  # issue 19: equal work, 0.5B with compiled blocks under autocast (the speed bar), 1.5B as i21b (the memory bar)
  LOGS=0 LIMIT=${LIMIT05:-240} bench eq_05b_c --shape 0.5b --vllm --micro_batch 32 --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --torch_compile --micro_rollout_batch_size 16 ${OURS:-}"
  LOGS=0 LIMIT=${LIMIT15:-290} bench eq_15b --shape 1.5b --vllm --gradient_checkpointing --micro_batch 32 --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --micro_rollout_batch_size 16 ${OURS:-}"
  ;;
*) echo "usage: $0 dpo_rm|grpo|ppo|check|x2|tp2|diag|bench|train|bench_hf|static|decode|mfu|memplan|..." >&2; exit 2 ;;
esac
