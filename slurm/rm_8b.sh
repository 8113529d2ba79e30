#!/bin/bash
# Reward model on an 8B base across 2 nodes x 8 GPUs: one DeepSpeed ZeRO-3 process group of 16
# ranks, started by srun (one task per GPU), as the reference's `deepspeed --module ... train_rm`.
#
#   mkdir -p logs && sbatch slurm/rm_8b.sh                          # from the repo root
#   sbatch --nodes=4 slurm/rm_8b.sh --learning_rate 5e-6            # more nodes; any flag overrides
#   PRETRAIN=/shared/llama3-8b DATASET=/shared/prefs.jsonl sbatch slurm/rm_8b.sh
#   DRY_RUN=1 bash slurm/rm_8b.sh                                   # print each rank's command; no Slurm, no GPUs
#
# Every rank gets RANK/WORLD_SIZE/LOCAL_RANK from Slurm (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID)
# and MASTER_ADDR/MASTER_PORT from this script (the job's first node), so no launcher is needed.
# Requeued (node failure, preemption, `scontrol requeue`), it resumes from the newest checkpoint.
#SBATCH --job-name=rm-8b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

# Model and data: an empty value (PRETRAIN= DATASET=) means the built-in tiny model / task, a CPU smoke test.
PRETRAIN=${PRETRAIN-meta-llama/Meta-Llama-3-8B}
DATASET=${DATASET-OpenRLHF/preference_dataset_mixture2_and_safe_pku}
SAVE_PATH=${SAVE_PATH:-./output/llama3-8b-rm}
SAVE_STEPS=${SAVE_STEPS:-100}

cd "${SLURM_SUBMIT_DIR:-.}"
source slurm/env.sh
# Each rank's torch otherwise starts one OpenMP thread per core of the node: 8 ranks x all cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# Rank 0's rendezvous: the batch script runs on the job's first node, so a port free here is free there.
# Outside a job (DRY_RUN=1 on a laptop) there is no node list, and maybe no scontrol: this host.
if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
else
  MASTER_ADDR=$(hostname -s)
fi
MASTER_PORT=${MASTER_PORT:-$("$PYTHON" slurm/free_ports.py 1)}
export MASTER_ADDR MASTER_PORT

ARGS=(${PRETRAIN:+--pretrain "$PRETRAIN"} ${DATASET:+--dataset "$DATASET"}
      --apply_chat_template --chosen_key chosen --rejected_key rejected
      --max_len 8192 --train_batch_size 256 --micro_train_batch_size 1 --max_epochs 1 --learning_rate 9e-6
      --zero_stage 3 --bf16 --flash_attn --gradient_checkpointing
      --save_path "$SAVE_PATH" --save_steps "$SAVE_STEPS" --max_ckpt_num 2 --load_checkpoint
      --logging_steps 1 --eval_steps -1)
echo "rm_8b: job ${SLURM_JOB_ID:-none}, restart ${SLURM_RESTART_COUNT:-0}," \
     "${SLURM_NTASKS:-1} ranks on ${SLURM_JOB_NODELIST:-}, rendezvous $MASTER_ADDR:$MASTER_PORT"
if [[ ${DRY_RUN:-0} == 1 ]]; then  # the launch only: no srun, nothing trained
  echo "rm_8b: DRY_RUN=1: each of the job's ranks would run:"
  printf '%q ' "$PYTHON" train_rm.py "${ARGS[@]}" "$@"
  echo
  exit 0
fi
# --kill-on-bad-exit: one rank dying ends the step instead of the others hanging in a collective;
# --cpus-per-task again because srun (Slurm >= 22.05) no longer inherits it from sbatch.
# shellcheck disable=SC2016  # the $SLURM_* are expanded by each task's shell, on purpose
srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
  bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID exec "$0" "$@"' \
  "$PYTHON" train_rm.py "${ARGS[@]}" "$@"
