#!/bin/bash
# GRPO on the built-in tiny model, CPU only, one node, through a real Ray cluster started by
# slurm/ray_cluster.sh: checks Slurm, the Ray helper, checkpoints and the driver together before
# a job waits in the queue for GPUs. About a minute for 4 steps on 2 cores.
#
#   mkdir -p logs && sbatch slurm/debug_tiny.sh                  # from the repo root
#   sbatch slurm/debug_tiny.sh --max_steps 10 --seed 1            # any train_grpo.py flag overrides
#   PYTHON=.venv/bin/python SAVE_PATH=/tmp/dbg sbatch slurm/debug_tiny.sh
#
# Requeued (`scontrol requeue <job>`), it resumes from the newest checkpoint in $SAVE_PATH.
# Time limit: 2 min before it, Slurm sends USR1 to this shell alone (--signal=B:USR1@120, a step and
# a save take seconds here); the driver checkpoints at its current step and the job requeues itself
# to resume there. Try it on a running job with `scancel --batch --signal=USR1 <job>`. scancel and
# preemption send SIGTERM to every process, Ray's too, so the run just stops; requeued, it resumes
# from the last --save_steps checkpoint (docs/reliability.md).
#SBATCH --job-name=debug-tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

SAVE_PATH=${SAVE_PATH:-./output/debug-tiny}
MAX_STEPS=${MAX_STEPS:-4}
SAVE_STEPS=${SAVE_STEPS:-2}

cd "${SLURM_SUBMIT_DIR:-.}"
source slurm/env.sh
source slurm/ray_cluster.sh
# Logical CPUs, not cores: the tiny model's CPU workers mostly wait on each other.
export RAY_NUM_CPUS=${RAY_NUM_CPUS:-8}
# The tiny model is built locally; nothing needs the hub.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

ARGS=(--save_path "$SAVE_PATH" --max_steps "$MAX_STEPS" --rollout_batch_size 8 --eval_steps -1
      --save_steps "$SAVE_STEPS" --load_checkpoint)
echo "debug_tiny: job ${SLURM_JOB_ID:-none}, restart ${SLURM_RESTART_COUNT:-0}, on $(hostname -s)"
if [[ ${DRY_RUN:-0} == 1 ]]; then  # the resource plan only: no Ray, nothing trained
  exec "$PYTHON" train_grpo.py "${ARGS[@]}" --dry_run "$@"
fi
ray_cluster_start
# The driver; near the time limit (USR1) it checkpoints and the job requeues itself.
ray_cluster_run "$PYTHON" train_grpo.py "${ARGS[@]}" "$@"
