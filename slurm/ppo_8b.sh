#!/bin/bash
# PPO on an 8B SFT model on one node of 8 GPUs with the hybrid engine, the reference's 8B command:
# actor, critic, reference, reward model and 8 vLLM engines share every GPU; vLLM sleeps while
# DeepSpeed trains and DeepSpeed offloads its states while vLLM generates. The critic starts from
# the reward model, as in OpenRLHF.
#
#   mkdir -p logs && sbatch slurm/ppo_8b.sh                      # from the repo root
#   PRETRAIN=./output/llama3-8b-sft REWARD_PRETRAIN=./output/llama3-8b-rm sbatch slurm/ppo_8b.sh
#   sbatch slurm/ppo_8b.sh --actor_learning_rate 1e-6             # any train_ppo.py flag overrides
#   DRY_RUN=1 bash slurm/ppo_8b.sh                               # print the GPU plan; no Ray, no GPUs
#
# slurm/pipeline_8b.sh submits it after the SFT and reward-model jobs. Requeued, it resumes from the
# newest checkpoint. Time limit: 15 min before it, Slurm sends USR1 to this shell alone
# (--signal=B:USR1@900); the driver checkpoints at its current step and the job requeues itself to
# resume there (docs/reliability.md).
#SBATCH --job-name=ppo-8b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

PRETRAIN=${PRETRAIN:-OpenRLHF/Llama-3-8b-sft-mixture}
REWARD_PRETRAIN=${REWARD_PRETRAIN:-OpenRLHF/Llama-3-8b-rm-700k}
PROMPT_DATA=${PROMPT_DATA:-OpenRLHF/prompt-collection-v0.1}
INPUT_KEY=${INPUT_KEY:-context_messages}
SAVE_PATH=${SAVE_PATH:-./output/llama3-8b-ppo}
SAVE_STEPS=${SAVE_STEPS:-20}

cd "${SLURM_SUBMIT_DIR:-.}"
source slurm/env.sh
source slurm/ray_cluster.sh

ARGS=(--pretrain "$PRETRAIN" --reward_pretrain "$REWARD_PRETRAIN"
      --prompt_data "$PROMPT_DATA" --input_key "$INPUT_KEY" --apply_chat_template
      --actor_num_nodes 1 --actor_num_gpus_per_node 8 --critic_num_nodes 1 --critic_num_gpus_per_node 8
      --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
      --vllm_num_engines 8 --vllm_tensor_parallel_size 1 --vllm_gpu_memory_utilization 0.5
      --colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep
      --advantage_estimator gae --init_kl_coef 0.01 --kl_estimator k1
      --zero_stage 3 --bf16 --flash_attn --gradient_checkpointing --packing_samples
      --micro_train_batch_size 8 --train_batch_size 128 --micro_rollout_batch_size 16 --rollout_batch_size 1024
      --max_epochs 1 --num_episodes 1 --prompt_max_len 1024 --generate_max_len 1024
      --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --normalize_reward
      --save_path "$SAVE_PATH" --save_steps "$SAVE_STEPS" --max_ckpt_num 3 --load_checkpoint
      --logging_steps 1 --eval_steps -1)
echo "ppo_8b: job ${SLURM_JOB_ID:-none}, restart ${SLURM_RESTART_COUNT:-0}, nodes ${SLURM_JOB_NODELIST:-}"
if [[ ${DRY_RUN:-0} == 1 ]]; then  # the resource plan only: no Ray, no GPUs, no model
  exec "$PYTHON" train_ppo.py "${ARGS[@]}" --dry_run "$@"
fi
ray_cluster_start
# The driver; near the time limit (USR1) it checkpoints and the job requeues itself.
ray_cluster_run "$PYTHON" train_ppo.py "${ARGS[@]}" "$@"
