# shellcheck shell=bash
# Environment for multi-node jobs, sourced by every template in slurm/ (from the repo root).
#
# Each value is only a default: export your own before `sbatch` (sbatch passes your environment
# on) and it wins, e.g. `NET_IFNAME=ib0 NCCL_IB_HCA=mlx5_0,mlx5_1 sbatch slurm/ppo_70b.sh`.
# Check the values on a compute node with `srun -N1 bash -c 'source slurm/env.sh; env | sort'`.

# ---- Python and the run folders
# The interpreter that has hybridrl's packages (Ray's workers use it too): PYTHON if set, else the
# project's .venv (what `make install` makes), else `python` from PATH. sbatch runs the job in a
# fresh shell, so an activated venv of the submitting shell does not count.
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python; fi
fi
export PYTHON
if ! "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("torch", "ray", "deepspeed", "typer")))' 2>/dev/null; then
  echo "slurm/env.sh: $PYTHON cannot import hybridrl's packages (torch, ray, deepspeed, typer): run \`make install\` in the repo" \
       "(it makes .venv, which the templates then use) or submit with PYTHON=/path/to/venv/bin/python sbatch ..." >&2
  exit 2
fi
# Shared file system folder visible from every node (the submit folder is, on any sane cluster).
export SHARED_DIR=${SHARED_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/.cache}
# Model weights are downloaded once to the shared folder, not once per node into ~/.cache.
export HF_HOME=${HF_HOME:-$SHARED_DIR/huggingface}
# DeepSpeed JIT-builds its ops (cpu_adam, fused_adam, the CPU shm all-reduce: 1-2 min each) once
# per venv; a shared folder means one build for all nodes and all later jobs. If the file system
# has no working file locks (some NFS mounts), point this at node-local disk instead.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$SHARED_DIR/torch_extensions}
# Progress lines reach logs/%x-%j.out as they are printed, not in 4 KB blocks at exit.
export PYTHONUNBUFFERED=1

# ---- Network
# The interface nodes reach each other on for control traffic (NCCL bootstrap, Gloo, Ray). On an
# InfiniBand cluster use the IPoIB one (often ib0); the default is the interface of the default
# route, which is what Ray and Gloo would otherwise guess from the hostname (sometimes 127.0.1.1).
if [[ -z ${NET_IFNAME:-} ]] && command -v ip >/dev/null; then
  NET_IFNAME=$(ip route show default 2>/dev/null |
               awk '{ for (i = 1; i < NF; i++) if ($i == "dev") { print $(i + 1); exit } }')
fi
export NET_IFNAME=${NET_IFNAME:-}
# NCCL's bootstrap and socket fallback: without it NCCL may pick docker0 or a virtual bridge and
# hang at the first collective.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-${NET_IFNAME:-^lo,docker}}
# Gloo (CPU-side collectives, barriers, DeepSpeed on CPU) has no interface search of its own.
if [[ -n $NET_IFNAME ]]; then
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NET_IFNAME}
fi
# Mellanox HCAs carry the GPU traffic (a prefix: every mlx5_* port); list ports (mlx5_0:1,...) or
# exclude one (^mlx5_bond_0) where a storage or Ethernet RoCE port would otherwise be picked.
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
# NCCL_IB_GID_INDEX is left to NCCL: since 2.21 it finds the RoCE v2 GID itself, and native IB
# does not use it. On RoCE with an older NCCL, export NCCL_IB_GID_INDEX=3 before sbatch.
# A longer IB retry timeout (4.096 us x 2^22, about 17 s) rides out a switch hiccup on a large job
# instead of failing the collective.
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
# Print NCCL warnings (the transport it fell back to, a missing HCA) but not the per-ring chatter.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A rank that hits a NCCL error aborts instead of hanging to the 30 min timeout, so the job ends and
# Slurm can requeue it.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

# ---- Ray
# Ray 2.60 turns token auth on for `ray start`; the cluster lives inside one job's allocation and
# every node would need the head's token file. Set RAY_AUTH_MODE=token to keep it on (the token is
# ~/.ray/auth_token, shared when home is).
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# The interface Ray registers each node on: slurm/ray_cluster.sh passes the address of NET_IFNAME
# as --node-ip-address.
