#!/usr/bin/env bash
# The GPU figures of docs/performance.md, one mode per figure; each mode fits one 10-minute run on one H200
# (x2, tp2, tp2_grpo: two). From the repo root, with the vllm extra installed (make install EXTRAS=vllm,test)
# and, for the rows against TRL, `pip install --no-deps trl==1.16.0`; figures land in $OUT.
#   bash dev/gpu_runs.sh dpo_rm            # RM and DPO, bf16, ZeRO-2 and ZeRO-3, 0.5B shape
#   bash dev/gpu_runs.sh grpo              # vLLM sleep/wake check, then GRPO with the hybrid engine on one GPU, 20 steps
#   bash dev/gpu_runs.sh ds_sleep_states   # GPU memory each DeepSpeed state frees when the actor sleeps (ZeRO-2, 3)
#   bash dev/gpu_runs.sh x2                # two GPUs: actor (+ reference) on one, vLLM on the other, NCCL sync, 20 steps
#   bash dev/gpu_runs.sh tp2               # two GPUs: the reference PPO command's shape, 1 engine x TP 2, hybrid engine
#   bash dev/gpu_runs.sh tp2_grpo          # two GPUs: GRPO, hybrid engine, 1 engine x TP 2, 20 steps
#   bash dev/gpu_runs.sh runner_v1_v2      # vLLM's model runner v1 against v2 on the bench's rollout
#   bash dev/gpu_runs.sh compile           # the training phase with --torch_compile (0.5B)
#   bash dev/gpu_runs.sh mfu15             # the training phase's MFU at 1.5B, with and without --torch_compile
#   bash dev/gpu_runs.sh bench_hf          # the GRPO step against TRL with neither side using vLLM (0.5B)
#   bash dev/gpu_runs.sh decode            # bench/decode_bench.py: the policy's own decoding vs transformers' and vLLM's
#   bash dev/gpu_runs.sh decode15          # the same on the 1.5B shape (no vLLM row)
#   bash dev/gpu_runs.sh equal_work_05b    # the GRPO step against TRL on equal work, 0.5B (and _15b, _3b)
#   bash dev/gpu_runs.sh no_correction_05b # the same with neither side correcting for vLLM's log-probs; ours decoding itself
#   bash dev/gpu_runs.sh async_one_gpu     # 0.5B: synchronous against --async_train with both sides on the one GPU
#   bash dev/gpu_runs.sh ref_flags_3b      # the reference command's flags at 3B: step, and each process against the plan
#   bash dev/gpu_runs.sh ref_flags_7b      # the same at 7B with --adam_offload --adam_offload_ratio 0.5
#   bash dev/gpu_runs.sh logprob_gap_3b    # rollout/logprob_diff per way the trainer computes log-probs, 3B
#   bash dev/gpu_runs.sh lora_7b           # the reference flags at 7B with --lora_rank 16, no --adam_offload
#   bash dev/gpu_runs.sh lora_decode       # vLLM decoding with a pushed LoRA adapter against the merged weights
#   bash dev/gpu_runs.sh lora_trl_05b      # the GRPO step against TRL, the same rank-16 LoRA on both sides (and _15b)
#   bash dev/gpu_runs.sh train_phase       # the training phase at 1.5B and 3B, ours against a plain PyTorch loop (TRL's), profiled
#   bash dev/gpu_runs.sh real_05b          # the GRPO step at 32 prompts x 8 samples x 1024 tokens, micro 32, against TRL (and _15b, _3b)
#   bash dev/gpu_runs.sh agents_05b        # multi-turn episodes at 0.5B: turns/s and tokens/s, without and with a 50 ms environment
#   bash dev/gpu_runs.sh real_05b_openrlhf # the same work against TRL and OpenRLHF 0.11.2's train_ppo_ray (its hybrid engine)
# Env: Z (ZeRO stage of the hybrid runs, default 3), SYNC (--vllm_sync_backend, default auto), OURS (more
#      train_grpo.py flags for the bench modes), WARMUP (bench steps not timed, default 2), LIMIT (seconds per run),
#      STEPS, LOGS=0 (keep the bench's table and logs in $WORK only), WORK (scratch: models, runs, logs; /tmp).
# The modes behind older entries of dev/LOG.md are in git history (`git log -p --follow -- dev/gpu_runs.sh`).
set -uo pipefail
WORK=${WORK:-/tmp}; OUT=${OUT:-$WORK/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # Ray workers import common/ from here
export HF_HUB_OFFLINE=1 HYBRIDRL_CACHE=$WORK/hrl-cache TORCH_EXTENSIONS_DIR=$WORK/torch-ext PYTHONUNBUFFERED=1
export VLLM_ALLOW_INSECURE_SERIALIZATION=1
PY=${PY:-python3}
M=$WORK/q05; RM=$WORK/q05rm; Z=${Z:-3}; SYNC=${SYNC:-auto}
[ -d $M ] || $PY bench/make_model.py --shape 0.5b --out $M
[ -d $RM ] || [ "${1:-}" != grpo ] || $PY bench/make_model.py --shape 0.5b --out $RM --reward
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

run() {  # name, script, flags...: keep the metrics and the log tail
  local name=$1; shift
  rm -rf "$WORK/runs/$name"  # a mode run again in one session: the scripts refuse a folder holding a run
  local t0=$SECONDS
  timeout "${LIMIT:-400}" $PY "$@" --save_path "$WORK/runs/$name" > "$WORK/runs-$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  mkdir -p "$OUT/$name"
  cp "$WORK/runs/$name/metrics.jsonl" "$OUT/$name/" 2>/dev/null
  tail -c 20000 "$WORK/runs-$name.log" > "$OUT/$name/log.txt"
  return $rc
}
bench() {  # name, grpo_step.py flags...
  local name=$1; shift
  local t0=$SECONDS
  timeout "${LIMIT:-500}" $PY bench/grpo_step.py --work_dir $WORK/bench --out "$OUT/$name.json" "$@" > "$WORK/$name.txt" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  tail -20 "$WORK/$name.txt"
  # the device returns only a few files: with LOGS=0 the run's table and logs stay on the machine
  [ "${LOGS:-1}" = 0 ] || { cp "$WORK/$name.txt" "$OUT/"
    for f in $WORK/bench/*.log; do [ -f "$f" ] && tail -c 4000 "$f" > "$OUT/$name-$(basename "$f")"; done; }
  local m; m=$(ls -t $WORK/bench/ours-*/metrics.jsonl 2>/dev/null | head -1)  # this run's (vLLM or HF), per step
  [ -n "$m" ] && cp "$m" "$OUT/${name}_ours_metrics.jsonl"
}
plan_lines() {  # shape, name: the memory plan our run printed before it loaded a model
  grep -h "memory plan" -A12 "$WORK/bench/ours-$1-vllm.log" > "$OUT/$2_plan.txt" 2>/dev/null; cut -c1-200 "$OUT/$2_plan.txt"
}
prompts() {  # $WORK/prompts.jsonl: the bench's copy-task prompts (random-weight models: the length reward scores them)
  $PY -c "from bench.grpo_step import _prompt_file; _prompt_file('$WORK')"
}
REF="--colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep --zero_stage 3 --bf16 --gradient_checkpointing --packing_samples"
TASK=(--prompt_data $WORK/prompts.jsonl --input_key prompt --label_key label --apply_chat_template
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
  [ -n "${SKIP_SLEEP_CHECK:-}" ] || { $PY dev/probes/sleep_check.py --model $M > "$OUT/sleep_check.txt" 2>&1; tail -5 "$OUT/sleep_check.txt"; }
  run grpo_hybrid train_grpo.py --pretrain $M --reward_pretrain $RM --bf16 --zero_stage $Z --colocate_all_models \
    --vllm_num_engines 1 --vllm_gpu_memory_utilization 0.3 --vllm_enable_sleep --deepspeed_enable_sleep \
    --vllm_sync_backend $SYNC --rollout_batch_size 8 --n_samples_per_prompt 8 --generate_max_len 256 --train_batch_size 64 \
    --micro_train_batch_size 16 --micro_rollout_batch_size 64 --max_steps 20 --eval_steps -1 --actor_learning_rate 1e-6
  ;;
ds_sleep_states)  # GPU memory each DeepSpeed state frees when the actor sleeps, ZeRO-3 and ZeRO-2
  for z in 2 3; do
    timeout 200 $PY dev/probes/ds_sleep_memory.py --model $M --zero-stage $z --out "$OUT/ds_sleep_z$z.json" > "$OUT/ds_sleep_z$z.txt" 2>&1
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
runner_v1_v2)  # vLLM's model runner v1 against v2 (VLLM_USE_V2_MODEL_RUNNER): one rollout's time and host work
  for r in 0 1; do
    VLLM_USE_V2_MODEL_RUNNER=$r timeout 200 $PY bench/vllm_gen.py --model $M --no-ours --seeds --no-reload --profile \
      > "$OUT/vllm_gen_runner_v$((r + 1)).txt" 2>&1; echo "vllm_gen runner v$((r + 1)): exit $?"
    grep -E "tok/s|Error" "$OUT/vllm_gen_runner_v$((r + 1)).txt"
  done
  ;;
compile)  # the training phase with compiled blocks, 0.5B (mfu15: the 1.5B shape)
  timeout ${T05:-150} $PY bench/train_step.py --model $M --stages 2 --micros 64 --modes ${MODES:-autocast,master+compile,autocast+compile} \
    --out "$OUT/train_compile_0.5b.json" > "$OUT/train_compile_0.5b.txt" 2>&1; echo "train_step 0.5b: exit $?"
  grep -E '^\{' "$OUT/train_compile_0.5b.txt" | cut -c1-220
  ;;
mfu15)
  [ -d $WORK/q15 ] || $PY bench/make_model.py --shape 1.5b --out $WORK/q15 > /dev/null 2>&1
  timeout ${T15:-200} $PY bench/train_step.py --model $WORK/q15 --stages ${STAGES15:-1} --micros ${MICROS15:-32} \
    --modes ${MODES15:-master,master+compile} --out "$OUT/train_1.5b.json" > "$OUT/train_1.5b.txt" 2>&1; echo "train_step 1.5b: exit $?"
  grep -E '^\{' "$OUT/train_1.5b.txt" | cut -c1-220
  ;;
bench_hf)  # no vLLM on either side: ours generates with --static_kv_cache (common.rollout.decode), TRL with its default generate
  bench bench_hf --shape 0.5b --prompts 8 --new_tokens 256 --no-vllm --micro_batch ${MB:-64} --ours_flags "--static_kv_cache --zero_stage ${BZ:-2}"
  ;;
decode)
  timeout 400 $PY bench/decode_bench.py --model $M --no-hf-dynamic --out "$OUT/decode.json" > "$OUT/decode.txt" 2>&1
  tail -8 "$OUT/decode.txt"
  ;;
decode15)
  [ -d $WORK/q15 ] || $PY bench/make_model.py --shape 1.5b --out $WORK/q15
  timeout 400 $PY bench/decode_bench.py --model $WORK/q15 --no-hf-dynamic --no-vllm --out "$OUT/decode15.json" > "$OUT/decode15.txt" 2>&1
  tail -8 "$OUT/decode15.txt"
  ;;
equal_work_05b)  # GRPO step against TRL at 0.5B, equal work: ours ZeRO-2 bf16, micro-batches of 32
  LOGS=0 LIMIT=${LIMIT:-240} bench eq_05b --shape 0.5b --prompts 8 --new_tokens 256 --vllm --micro_batch 32 --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC ${OURS:-}"
  ;;
equal_work_15b)  # the same at 1.5B: ours ZeRO-0 with fp32 weights under autocast, micro-batches of 32, both checkpointing
  LOGS=0 LIMIT=${LIMIT:-300} bench eq_15b --shape 1.5b --prompts 8 --new_tokens 256 --vllm --gradient_checkpointing --micro_batch 32 --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --micro_rollout_batch_size 16 ${OURS:-}"
  ;;
equal_work_3b)  # the same at 3B, micro-batches of 16
  LOGS=0 LIMIT=${LIMIT:-300} bench eq_3b --shape 3b --prompts 8 --new_tokens 256 --vllm --gradient_checkpointing --micro_batch 16 --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --micro_rollout_batch_size 16 ${OURS:-}"
  ;;
no_correction_05b)  # 0.5B, neither side asking vLLM for log-probs: ours with vLLM (compiled blocks), then ours decoding itself
  LOGS=0 LIMIT=${LIMIT:-240} bench nois_05b --shape 0.5b --prompts 8 --new_tokens 256 --vllm --no-is_correction --micro_batch 32 --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC --zero_stage 0 --torch_autocast --torch_compile --micro_rollout_batch_size 16 ${OURS:-}"
  LOGS=0 LIMIT=${LIMIT:-240} bench nois_static_05b --shape 0.5b --prompts 8 --new_tokens 256 --vllm --ours-no-vllm --no-is_correction --micro_batch 64 \
    --warmup 2 --steps 5 --ours_flags "--static_kv_cache --torch_compile --zero_stage 2 ${OURS:-}"
  ;;
async_one_gpu)  # 0.5B: ours synchronous (vLLM colocated, no sleep) and with --async_train on the same GPU, then TRL
  LOGS=0 LIMIT=${LIMIT:-480} bench async_05b --shape 0.5b --prompts 8 --new_tokens 256 --vllm --async --warmup 2 --steps 5 \
    --ours_flags "--vllm_sync_backend $SYNC ${OURS:-}"
  ;;
ref_flags_3b)  # the reference command's flags at 3B (micro-batches of 64), ours only: step and each process against the plan
  LOGS=0 LIMIT=${LIMIT:-360} bench ref_3b --shape 3b --prompts 8 --new_tokens 256 --vllm --no-trl --gradient_checkpointing --warmup 1 --steps ${STEPS:-5} \
    --ours_flags "--vllm_sync_backend $SYNC $REF"
  plan_lines 3b ref_3b
  ;;
ref_flags_7b)  # the reference command's flags at 7B with half the optimizer in CPU memory (--adam_offload_ratio), micro 16
  LOGS=0 LIMIT=${LIMIT:-440} bench ref_7b --shape 7b --prompts 8 --new_tokens 256 --vllm --no-trl --gradient_checkpointing --micro_batch 16 --warmup 1 \
    --steps ${STEPS:-3} --ours_flags "--vllm_sync_backend $SYNC $REF --adam_offload --adam_offload_ratio ${RATIO:-0.5} --micro_rollout_batch_size 16"
  plan_lines 7b ref_7b
  free -g | tee -a "$OUT/summary.txt"
  ;;
lora_7b)  # the reference flags at 7B with a rank-16 LoRA (no --adam_offload): step, peak, adapter sync; sleep level 1
  LOGS=0 LIMIT=${LIMIT:-440} bench lora_7b --shape 7b --prompts 8 --new_tokens 256 --vllm --no-trl --gradient_checkpointing --micro_batch 16 --warmup 1 \
    --steps ${STEPS:-3} --ours_flags "--vllm_sync_backend $SYNC $REF --lora_rank 16 --vllm_sleep_level 1 --micro_rollout_batch_size 16"
  plan_lines 7b lora_7b
  ;;
lora_trl_05b|lora_trl_15b)  # GRPO step against TRL with the same rank-16 LoRA on both sides (TRL: its peft_config)
  shape=${1#lora_trl_}; shape=${shape/05b/0.5b}; shape=${shape/15b/1.5b}
  LOGS=0 LIMIT=${LIMIT:-300} bench "$1" --shape $shape --prompts 8 --new_tokens 256 --vllm --lora_rank 16 --micro_batch 32 --warmup 2 --steps 4 \
    --ours_flags "--vllm_sync_backend $SYNC ${OURS:-}"
  ;;
real_05b|real_15b|real_3b)  # the GRPO step at the size people train, 32 prompts x 8 samples x 1024 tokens, micro 32, against TRL
  shape=${1#real_}; shape=${shape/05b/0.5b}; shape=${shape/15b/1.5b}
  LOGS=0 LIMIT=${LIMIT:-560} bench "$1" --shape $shape --vllm --warmup ${WARMUP:-2} --steps ${STEPS:-5} \
    --ours_flags "--vllm_sync_backend $SYNC ${OURS:-}"
  ;;
real_05b_openrlhf)  # the same work, ours against TRL and OpenRLHF 0.11.2 in one bench (openrlhf installed, or .whl/openrlhf
  # carried: dev/prepare_openrlhf.sh); without a flash-attn build, its import-time names come from dev/probes/flash_attn_stub
  if [ -d .whl/openrlhf ]; then
    mkdir -p $WORK/orlsite
    for w in .whl/openrlhf/*.whl; do $PY -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" $WORK/orlsite; done
    export PYTHONPATH=$PYTHONPATH:$WORK/orlsite
  fi
  $PY -c "import flash_attn_2_cuda" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$PWD/dev/probes/flash_attn_stub
  LIMIT=${LIMIT:-560} bench "$1" --shape 0.5b --vllm ${TRL:---trl} --openrlhf --openrlhf_micro_batch ${ORL_MICRO:-16} --warmup ${WARMUP:-2} --steps ${STEPS:-5} \
    --ours_flags "--vllm_sync_backend $SYNC ${OURS:-}"
  ;;
agents_05b)  # multi-turn episodes at 0.5B (the random model never copies: every episode runs its 3 turns, of 32-192 tokens after the first),
  # without and with a 50 ms environment step; turns/s and tokens/s come from the metrics
  prompts
  AG=(--pretrain $M --prompt_data $WORK/prompts.jsonl --input_key prompt --label_key label --apply_chat_template
      --agent_func_path dev/probes/agent_latency.py --agent_feedback_role user
      --max_turns 3 --max_tokens_per_turn 128 --vllm_num_engines 1 --colocate_all_models --vllm_gpu_memory_utilization 0.3
      --rollout_batch_size 8 --n_samples_per_prompt 8 --generate_max_len 512 --train_batch_size 64
      --micro_train_batch_size 32 --micro_rollout_batch_size 32 --max_steps ${STEPS:-6} --eval_steps -1 --bf16)
  AGENT_STEP_LATENCY_S=0 LIMIT=${LIMIT:-250} run agents_05b_0ms train_grpo.py "${AG[@]}"
  AGENT_STEP_LATENCY_S=0.05 LIMIT=${LIMIT:-250} run agents_05b_50ms train_grpo.py "${AG[@]}"
  for m in 0ms 50ms; do $PY - "$OUT/agents_05b_$m/metrics.jsonl" $m <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][2:]  # after two warm-up steps
med = lambda k: statistics.median(r[k] for r in rows if k in r)
n = 64
print(f"{sys.argv[2]}: step {med('time/step_s'):.2f} s, generate {med('time/generate_s'):.2f} s, "
      f"turns/s {n * med('rollout/agent_turns_mean') / med('time/generate_s'):.1f}, "
      f"model tokens/s {n * med('rollout/response_len_mean') / med('time/generate_s'):.0f}")
PYEOF
  done
  ;;
train_phase)  # the training phase alone at 1.5B (micro 32) and 3B (micro 16), the equal-work benches' settings (checkpointing,
  # ours ZeRO-0 with fp32 weights under autocast) against the same loss in a plain PyTorch loop as TRL runs it; phases and kernels
  for sh in ${SHAPES:-1.5b 3b}; do
    d=$WORK/q${sh/./}; [ -d $d ] || $PY bench/make_model.py --shape $sh --out $d > /dev/null 2>&1
    mb=32; [ $sh = 3b ] && mb=16
    timeout ${LIMIT:-200} $PY bench/train_step.py --model $d --stages 0 --micros $mb --modes ${MODES:-autocast,plain} \
      --gradient-checkpointing --profile --out "$OUT/train_phase_$sh.json" > "$OUT/train_phase_$sh.txt" 2>&1
    echo "train_phase $sh: exit $?"; grep -E '^\{' "$OUT/train_phase_$sh.txt" | cut -c1-400
  done
  ;;
lora_decode)  # vLLM decoding with a pushed rank-16 adapter against the merged weights, 0.5B
  timeout ${LIMIT:-300} $PY dev/probes/lora_decode.py --model $M --out "$OUT/lora_decode.json" > "$OUT/lora_decode.txt" 2>&1
  echo "lora_decode: exit $?"; tail -c 2000 "$OUT/lora_decode.txt"
  ;;
logprob_gap_3b)  # rollout/logprob_diff per way the trainer computes log-probs (bf16, packed, autocast, fp32), 3B
  [ -d $WORK/bench/model-3b ] || $PY bench/make_model.py --shape 3b --out $WORK/bench/model-3b > /dev/null 2>&1
  timeout ${LIMIT:-150} $PY dev/probes/logprob_gap.py --model $WORK/bench/model-3b --out "$OUT/logprob_gap_3b.json" > "$OUT/logprob_gap_3b.txt" 2>&1
  echo "logprob_gap: exit $?" | tee -a "$OUT/summary.txt"; tail -8 "$OUT/logprob_gap_3b.txt"
  ;;
*) echo "usage: $0 dpo_rm|grpo|ds_sleep_states|x2|tp2|tp2_grpo|runner_v1_v2|compile|mfu15|bench_hf|decode|decode15|equal_work_05b|equal_work_15b|equal_work_3b|no_correction_05b|async_one_gpu|ref_flags_3b|ref_flags_7b|logprob_gap_3b|train_phase|lora_7b|lora_decode|lora_trl_05b|lora_trl_15b|real_05b|real_15b|real_3b|real_05b_openrlhf|agents_05b" >&2; exit 2 ;;
esac
