#!/bin/bash
# OpenRLHF's first workflow on Slurm: SFT -> reward model -> PPO for an 8B model, three jobs, each
# starting only when the one before it succeeded (sbatch --dependency=afterok:<job id>) and reading
# its output folder: the reward model starts from the SFT model, PPO's policy (and reference) is the
# SFT model and its reward model (and critic) the trained one. Run it from the repo root on a login
# node (it submits; it is not a batch job itself):
#
#   bash slurm/pipeline_8b.sh                                     # Llama-3-8B, OpenOrca, OpenRLHF's preference mix
#   OUT=/shared/run1 PRETRAIN=/shared/llama3-8b bash slurm/pipeline_8b.sh
#   SFT_FLAGS="--max_epochs 2" PPO_FLAGS="--actor_learning_rate 1e-6" bash slurm/pipeline_8b.sh
#   DRY_RUN=1 bash slurm/pipeline_8b.sh                           # print the three sbatch commands; submit nothing
#
# The jobs' logs go to logs/ in the repo root (made here if missing). If an sbatch fails, the script
# stops there with a non-zero exit naming the stage and the jobs already submitted.
#
# Each stage is its own template (slurm/sft_8b.sh, slurm/rm_8b.sh, slurm/ppo_8b.sh: 2 + 2 + 1 nodes),
# so each can be rerun alone, and each resumes from its newest checkpoint when requeued. A failed
# stage leaves the later ones pending with reason DependencyNeverSatisfied: `scancel` them, fix, and
# rerun this script (finished stages are not redone only if you submit the remaining ones by hand).
#
# Environment: OUT (the run folder, default ./output/llama3-8b-pipeline), PRETRAIN, SFT_DATASET,
# RM_DATASET, PROMPT_DATA (empty = the built-in tiny model / task: a CPU smoke test), SBATCH_FLAGS
# (extra sbatch options for all three jobs), SFT_FLAGS / RM_FLAGS / PPO_FLAGS (extra flags of each
# script, split on spaces), PPO_DRY_RUN=1 (the PPO job prints its GPU plan instead of training).
set -euo pipefail

OUT=${OUT:-./output/llama3-8b-pipeline}
PRETRAIN=${PRETRAIN-meta-llama/Meta-Llama-3-8B}
SFT_DATASET=${SFT_DATASET-Open-Orca/OpenOrca}
RM_DATASET=${RM_DATASET-OpenRLHF/preference_dataset_mixture2_and_safe_pku}
PROMPT_DATA=${PROMPT_DATA-OpenRLHF/prompt-collection-v0.1}
read -r -a SBATCH_EXTRA <<<"${SBATCH_FLAGS:-}"
read -r -a SFT_EXTRA <<<"${SFT_FLAGS:-}"
read -r -a RM_EXTRA <<<"${RM_FLAGS:-}"
read -r -a PPO_EXTRA <<<"${PPO_FLAGS:-}"

cd "$(dirname "$0")/.."  # the templates source slurm/env.sh from the repo root
# sbatch opens each job's --output (logs/%x-%j.out) before the job starts and does not make the
# folder: without it every job fails at once, with no log to say why.
[[ ${DRY_RUN:-0} == 1 ]] || mkdir -p logs
submitted=()
submit() {  # stage, sbatch args... -> the job id (--parsable prints "id" or "id;cluster")
  local stage=$1 id
  shift
  if [[ ${DRY_RUN:-0} == 1 ]]; then  # the commands only (on stderr: stdout is the job id); no Slurm needed
    local arg line="pipeline_8b: DRY_RUN=1: $stage stage: sbatch --parsable"
    for arg in "${SBATCH_EXTRA[@]}" "$@"; do
      if [[ $arg =~ ^[][A-Za-z0-9_./:=,+@%-]+$ ]]; then line+=" $arg"; else line+=" $(printf %q "$arg")"; fi
    done
    echo "$line" >&2
    echo "${stage^^}_JOB_ID"
    return
  fi
  # Checked here: a failing command substitution does not stop a `set -e` script by itself (bash
  # runs it without errexit), and the next stage would get an empty --dependency.
  if ! id=$(sbatch --parsable "${SBATCH_EXTRA[@]}" "$@") || [[ -z ${id%%;*} ]]; then
    local before="no job was submitted"
    if (( ${#submitted[@]} )); then
      before=$(printf '%s, ' "${submitted[@]}")
      before="${before%, } already submitted: scancel it, or submit the later stages by hand"
    fi
    echo "pipeline_8b: sbatch failed for the $stage stage (sbatch's message is above); $before" >&2
    exit 1
  fi
  echo "${id%%;*}"
}

# --export=ALL,...: the job sees this shell's environment plus the stage's own folders.
sft=$(submit sft --export="ALL,PRETRAIN=$PRETRAIN,DATASET=$SFT_DATASET,SAVE_PATH=$OUT/sft" \
      slurm/sft_8b.sh "${SFT_EXTRA[@]}")
submitted+=("sft job $sft")
rm=$(submit rm --dependency="afterok:$sft" --export="ALL,PRETRAIN=$OUT/sft,DATASET=$RM_DATASET,SAVE_PATH=$OUT/rm" \
     slurm/rm_8b.sh "${RM_EXTRA[@]}")
submitted+=("rm job $rm")
ppo_env="ALL,PRETRAIN=$OUT/sft,REWARD_PRETRAIN=$OUT/rm,SAVE_PATH=$OUT/ppo,DRY_RUN=${PPO_DRY_RUN:-0}"
if [[ -n $PROMPT_DATA ]]; then ppo_env+=",PROMPT_DATA=$PROMPT_DATA"; fi
ppo=$(submit ppo --dependency="afterok:$rm" --export="$ppo_env" slurm/ppo_8b.sh "${PPO_EXTRA[@]}")
if [[ ${DRY_RUN:-0} == 1 ]]; then exit 0; fi
echo "pipeline_8b: sft job $sft -> rm job $rm -> ppo job $ppo, folders $OUT/{sft,rm,ppo}"
echo "pipeline_8b: follow with  squeue -j $sft,$rm,$ppo  and  tail -f logs/*-{$sft,$rm,$ppo}.out"
