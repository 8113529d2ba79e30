#!/bin/bash
# PPO on a 70B model over 6 nodes x 8 GPUs (48 GPUs), the reference's 70B layout: vLLM, actor and
# critic on separate node groups, "vLLM:Actor:Critic = 1:1:1", ZeRO-3, no hybrid engine (each
# group keeps its GPUs, so generation and training never wait for each other's memory).
#
#   GPUs  nodes  what
#   16    2      actor (ZeRO-3, Adam states in CPU memory) + reference model on the same GPUs
#   16    2      critic (ZeRO-3, Adam states in CPU memory) + reward model on the same GPUs
#   16    2      vLLM: 4 engines x tensor parallel 4
#
#   mkdir -p logs && sbatch slurm/ppo_70b.sh                     # from the repo root
#   sbatch slurm/ppo_70b.sh --actor_learning_rate 1e-6            # any train_ppo.py flag overrides
#   DRY_RUN=1 bash slurm/ppo_70b.sh                               # print the GPU plan; no Ray, no GPUs
#
# Ray runs across the allocation (slurm/ray_cluster.sh); each role's placement group packs whole
# nodes (16 one-GPU bundles fill 2 nodes of 8; each vLLM engine holds one bundle of its 4 GPUs). Requeued (node failure, preemption,
# `scontrol requeue`), the job starts a new Ray cluster and resumes from the newest checkpoint.
#
# Time limit: an hour before it, Slurm sends USR1 to this shell alone (--signal=B:USR1@3600: the
# rest of a step of 1024 rollouts plus the ~2 TB actor + critic save; lower it once time/step_s and
# the save time on your cluster are known). The driver then checkpoints at its current step and the
# job requeues itself to resume there. scancel and preemption send SIGTERM to every process, Ray's
# too, so the run just stops; requeued, it resumes from the last --save_steps checkpoint
# (docs/reliability.md).
#SBATCH --job-name=ppo-70b
#SBATCH --nodes=6
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@3600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

PRETRAIN=${PRETRAIN:-meta-llama/Llama-3.1-70B-Instruct}
REWARD_PRETRAIN=${REWARD_PRETRAIN:-./output/llama3-70b-rm}
PROMPT_DATA=${PROMPT_DATA:-OpenRLHF/prompt-collection-v0.1}
INPUT_KEY=${INPUT_KEY:-context_messages}
SAVE_PATH=${SAVE_PATH:-./output/llama3-70b-ppo}
# A 70B actor + critic checkpoint with optimizer states is ~2 TB: save rarely, keep two.
SAVE_STEPS=${SAVE_STEPS:-20}

cd "${SLURM_SUBMIT_DIR:-.}"
source slurm/env.sh
source slurm/ray_cluster.sh

ARGS=(--pretrain "$PRETRAIN" --reward_pretrain "$REWARD_PRETRAIN"
      --prompt_data "$PROMPT_DATA" --input_key "$INPUT_KEY" --apply_chat_template
      --actor_num_nodes 2 --actor_num_gpus_per_node 8 --ref_num_nodes 2 --ref_num_gpus_per_node 8 --colocate_actor_ref
      --critic_num_nodes 2 --critic_num_gpus_per_node 8 --reward_num_nodes 2 --reward_num_gpus_per_node 8
      --colocate_critic_reward
      --vllm_num_engines 4 --vllm_tensor_parallel_size 4 --vllm_gpu_memory_utilization 0.85
      --advantage_estimator gae --zero_stage 3 --adam_offload --bf16 --flash_attn --gradient_checkpointing
      --packing_samples
      --micro_train_batch_size 1 --train_batch_size 128 --micro_rollout_batch_size 4 --rollout_batch_size 1024
      --max_epochs 1 --num_episodes 1 --prompt_max_len 1024 --generate_max_len 1024
      --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --normalize_reward
      --save_path "$SAVE_PATH" --save_steps "$SAVE_STEPS" --max_ckpt_num 2 --load_checkpoint
      --logging_steps 1 --eval_steps -1)
echo "ppo_70b: job ${SLURM_JOB_ID:-none}, restart ${SLURM_RESTART_COUNT:-0}, nodes ${SLURM_JOB_NODELIST:-}"
if [[ ${DRY_RUN:-0} == 1 ]]; then  # the resource plan only: no Ray, no GPUs, no model
  exec "$PYTHON" train_ppo.py "${ARGS[@]}" --dry_run "$@"
fi
ray_cluster_start
# The driver; near the time limit (USR1) it checkpoints and the job requeues itself.
ray_cluster_run "$PYTHON" train_ppo.py "${ARGS[@]}" "$@"
