#!/usr/bin/env bash
# .whl/openrlhf: what OpenRLHF 0.11.2's train_ppo_ray needs on the GPU machine beyond our two bundles (its image
# has no network): the package itself and the two pure-Python modules it imports that neither the image nor
# the bundles hold. No flash-attn build travels (hundreds of MB): dev/probes/flash_attn_stub answers its
# import-time names and the bench runs OpenRLHF with sdpa attention. dev/gpu_runs.sh real_05b_openrlhf
# unpacks these when the folder is carried.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl/openrlhf
"${PIP:-.venv/bin/pip}" download -q --no-deps -d .whl/openrlhf "openrlhf==0.11.2" "torchdata==0.11.0" "pylatexenc==2.11"
ls -la .whl/openrlhf
