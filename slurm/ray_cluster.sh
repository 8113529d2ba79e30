# shellcheck shell=bash
# A Ray cluster over the nodes of this Slurm job; sourced by ppo_70b.sh, grpo_8b.sh, debug_tiny.sh.
#
#   source slurm/env.sh; source slurm/ray_cluster.sh
#   ray_cluster_start           # head here (the job's first node), a worker on every other node,
#                               # returns once the cluster shows all nodes and GPUs; exports RAY_ADDRESS
#   ray_cluster_run "$PYTHON" train_ppo.py ...   # the driver, which connects through RAY_ADDRESS
#
# Ray is stopped when the calling script exits, fails, or is cancelled or requeued (EXIT trap; the
# helper takes over the caller's EXIT, TERM, INT and USR1 traps). Only the processes this helper
# started are stopped, never other Ray clusters on the node (no `ray stop`).
#
# Time limit: with sbatch's `--signal=B:USR1@<seconds>`, Slurm sends USR1 to this shell alone that
# long before the limit. ray_cluster_run then sends SIGTERM to the driver alone, so Ray's processes
# live on while the driver finishes its step and checkpoints every role; once the driver has exited
# after that checkpoint (143, the stop's code), Ray is stopped and the job requeues itself (`scontrol
# requeue`), to resume from that checkpoint.
# scancel and preemption are different: Slurm sends SIGTERM to every process of the job, Ray's too,
# so the driver cannot save; this shell exits (TERM trap) and a requeued job resumes from the last
# periodic checkpoint.
#
# Settings (environment, all optional):
#   PYTHON              interpreter with ray installed (slurm/env.sh: the project's .venv). `ray` runs as
#                       `$PYTHON -m ray.scripts.scripts`, so Ray's workers use this interpreter too,
#                       not whichever python comes first on PATH on each node.
#   RAY_NODES           nodes to use, head first (default: the job's, from SLURM_JOB_NODELIST). A node
#                       listed twice gets two Ray nodes, which is how the tests reach the worker path
#                       on a one-machine Slurm.
#   RAY_GPUS_PER_NODE   GPUs every node must report (default: SLURM_GPUS_ON_NODE, else the count of
#                       `nvidia-smi -L`, else 0 for a CPU cluster, where only the nodes are counted)
#   RAY_NUM_CPUS        logical CPUs each node offers Ray (default: Ray counts them)
#   RAY_PORT            the head's GCS port (default: a free port on the head node)
#   RAY_DASHBOARD       true to start the dashboard, for `ray job submit` or watching (default: false)
#   RAY_TEMP_DIR        Ray's session and log folder on every node (default: /tmp/ray-<job>-<restart>;
#                       a path of its own per run, since Ray's socket paths must stay under 108 bytes
#                       and a requeued job must not find the killed run's address file)
#   RAY_START_TIMEOUT   seconds to wait for the whole cluster (default: 300)
#   RAY_WORKER_START_TRIES  starts of a worker node whose raylet did not register in Ray's fixed 30 s,
#                       as on a busy node (default: 3)
#   RAY_HEAD_START_TRIES    the same for the head node (default: 3)
#   RAY_STOP_TIMEOUT    seconds Ray gets to stop before it is killed (default: 30)
#   RAY_KEEP_LOGS       1 keeps RAY_TEMP_DIR after a successful run (it is always kept after a failure)
#   NET_IFNAME          interface to register the nodes on (set by slurm/env.sh)
#
# Run as a program (`bash slurm/ray_cluster.sh worker <head address>`) it is one worker node; that
# is what ray_cluster_start sends to every other node with srun.

_RAY_CLUSTER_SH=$(realpath "${BASH_SOURCE[0]}")
_RAY_PIDS=()
_RAY_DRIVER_PID=  # the driver started by ray_cluster_run, while it runs
_RAY_TIME_UP=0    # 1 once the time-limit warning (USR1) has come
# Ray's agents (Python processes) that start slowly, e.g. cold imports from a shared file system,
# get 2 min instead of 30 s to register with their raylet before it gives up on the node.
export RAY_agent_register_timeout_ms=${RAY_agent_register_timeout_ms:-120000}

# N distinct free ports on this node, one per line, below the ephemeral range (slurm/free_ports.py says why).
_RAY_FREE_PORTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/free_ports.py
_ray_free_ports() { "${PYTHON:-python}" "$_RAY_FREE_PORTS" "${1:-1}"; }

# The IPv4 address of NET_IFNAME on this node; empty (Ray picks) when unset or not found.
_ray_node_ip() {
  [[ -n ${NET_IFNAME:-} ]] && command -v ip >/dev/null || return 0
  ip -o -4 addr show dev "$NET_IFNAME" 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }'
}

_ray_temp_dir() { echo "${RAY_TEMP_DIR:-/tmp/ray-${SLURM_JOB_ID:-$$}-${SLURM_RESTART_COUNT:-0}}"; }

# Options every node starts with: where it keeps its files, which address it registers, its CPUs,
# and free ports for its agents. Ray's fixed default for the dashboard agent (52365) is taken when
# a second Ray runs on the node (another job's); and an agent port left to Ray (0) makes the raylet
# wait for the agent to report the port it bound, 30 s at most, then die: seen on a busy node.
_ray_node_args() {
  local ip ports
  ip=$(_ray_node_ip)
  mapfile -t ports < <(_ray_free_ports 4)
  _RAY_ARGS=(--block --disable-usage-stats "--temp-dir=$(_ray_temp_dir)"
             "--dashboard-agent-listen-port=${ports[0]}" "--dashboard-agent-grpc-port=${ports[1]}"
             "--runtime-env-agent-port=${ports[2]}" "--metrics-export-port=${ports[3]}")
  if [[ -n $ip ]]; then _RAY_ARGS+=("--node-ip-address=$ip"); fi
  if [[ -n ${RAY_NUM_CPUS:-} ]]; then _RAY_ARGS+=("--num-cpus=$RAY_NUM_CPUS"); fi
}

# Ray gives a new node's raylet a fixed 30 s to register with the head (not a setting); on a busy head
# or node `ray start` then fails with "timed out during startup" and cleans up after itself. That one
# failure, read from the ended `ray start`'s log here, is tried again, with fresh ports, by the worker
# (RAY_WORKER_START_TRIES) and the head (RAY_HEAD_START_TRIES); any other end is the node's end.
_ray_start_timed_out() {
  sleep 0.2  # tee (its own process) may still be writing `ray start`'s last lines
  grep -q "timed out during startup" "$1"
}

# One worker node. TERM and INT (srun passing on the stop) go to `ray start`, which then stops its
# node's processes.
_ray_worker() {
  local address=${1:?usage: ray_cluster.sh worker <head address>} tries=${RAY_WORKER_START_TRIES:-3} try pid rc log
  log=$(mktemp "${TMPDIR:-/tmp}/ray-worker-start.XXXXXX")
  trap 'rm -f "$log"' EXIT
  for ((try = 1; try <= tries; try++)); do
    _ray_node_args
    echo "ray_cluster: worker on $(hostname -s) joining $address"
    : >"$log"
    "${PYTHON:-python}" -m ray.scripts.scripts start --address="$address" "${_RAY_ARGS[@]}" > >(tee -a "$log") 2>&1 &
    pid=$!
    trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
    # `wait` returns early when a trapped signal comes: wait again while `ray start` stops its node.
    while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
    wait "$pid" && rc=0 || rc=$?
    trap - TERM INT
    if ((rc == 0)); then return 0; fi
    _ray_start_timed_out "$log" || return "$rc"
    echo "ray_cluster: the worker's raylet did not register with the head within Ray's 30 s (try $try of $tries)"
  done
  return "$rc"
}

_ray_alive() {
  local pid
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

# Stop the Ray processes started here. As the EXIT trap it reads the exit status from $?
# (logs are kept after a failure); ray_cluster_run passes 0 after a clean stop at the time limit.
ray_cluster_stop() {
  local rc=${1:-$?} pid deadline i temp_dir
  # A driver still running here means this shell itself was stopped (TERM, INT); the driver must not
  # outlive its Ray. (Under scancel it already has Slurm's SIGTERM; a second one changes nothing.)
  if [[ -n $_RAY_DRIVER_PID ]]; then kill -TERM "$_RAY_DRIVER_PID" 2>/dev/null || true; fi
  [[ ${#_RAY_PIDS[@]} -gt 0 ]] || return 0
  echo "ray_cluster: stopping Ray (pids ${_RAY_PIDS[*]})"
  # Workers first (their srun passes the TERM on to `ray start --block`, which stops its node's
  # processes), the head last.
  for ((i = ${#_RAY_PIDS[@]} - 1; i >= 0; i--)); do kill -TERM "${_RAY_PIDS[i]}" 2>/dev/null || true; done
  deadline=$((SECONDS + ${RAY_STOP_TIMEOUT:-30}))
  while _ray_alive "${_RAY_PIDS[@]}" && ((SECONDS < deadline)); do sleep 1; done
  for pid in "${_RAY_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait "${_RAY_PIDS[@]}" 2>/dev/null || true
  _RAY_PIDS=()
  # Ray's logs of a failed run stay for a look; a clean run leaves nothing in /tmp.
  temp_dir=$(_ray_temp_dir)
  if ((rc == 0)) && [[ ${RAY_KEEP_LOGS:-0} != 1 ]]; then
    rm -rf "$temp_dir"
  else
    echo "ray_cluster: Ray's logs are in $temp_dir/session_latest/logs on each node"
  fi
}

ray_cluster_start() {
  local nodes gpus_per_node want_gpus timeout head_pid addr_file deadline node
  timeout=${RAY_START_TIMEOUT:-300}
  if [[ -n ${RAY_NODES:-} ]]; then
    read -r -a nodes <<<"$RAY_NODES"
  elif [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  else
    nodes=("$(hostname -s)")
  fi
  gpus_per_node=${RAY_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
  if [[ -z $gpus_per_node ]]; then
    gpus_per_node=0
    if command -v nvidia-smi >/dev/null; then gpus_per_node=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
  fi
  want_gpus=$((gpus_per_node * ${#nodes[@]}))

  trap ray_cluster_stop EXIT
  # bash runs the EXIT trap on `exit`, not when killed: turn scancel/requeue's TERM into an exit.
  trap 'exit 143' TERM
  trap 'exit 130' INT
  # The time-limit warning: trapped from here on, since USR1's default action would end this shell
  # (and skip the EXIT trap) if it came while Ray is still starting.
  trap _ray_time_up USR1

  local temp_dir head_ports head_args tries=${RAY_HEAD_START_TRIES:-3} try log rc
  temp_dir=$(_ray_temp_dir)
  addr_file="$temp_dir/ray_current_cluster"
  log=$(mktemp "${TMPDIR:-/tmp}/ray-head-start.XXXXXX")
  echo "ray_cluster: head on $(hostname -s), ${#nodes[@]} node(s): ${nodes[*]}; waiting for ${#nodes[@]} node(s)," \
       "$want_gpus GPU(s), at most ${timeout}s"
  deadline=$((SECONDS + timeout))
  # The head's own raylet has Ray's fixed 30 s to register too (_ray_start_timed_out).
  for ((try = 1; try <= tries; try++)); do
    rm -f "$addr_file"
    _ray_node_args
    mapfile -t head_ports < <(_ray_free_ports 2)
    head_args=(--head "--port=${RAY_PORT:-${head_ports[0]}}" "--include-dashboard=${RAY_DASHBOARD:-false}"
               "--ray-client-server-port=${head_ports[1]}")
    : >"$log"
    "${PYTHON:-python}" -m ray.scripts.scripts start "${head_args[@]}" "${_RAY_ARGS[@]}" > >(tee -a "$log") 2>&1 &
    head_pid=$!
    _RAY_PIDS=("$head_pid")
    # The head writes its address file once its processes are up.
    rc=
    until [[ -s $addr_file ]]; do
      if ! kill -0 "$head_pid" 2>/dev/null; then
        wait "$head_pid" && rc=0 || rc=$?
        break
      fi
      if ((SECONDS >= deadline)); then
        rm -f "$log"
        echo "ray_cluster: the Ray head did not start within ${timeout}s" >&2
        return 1
      fi
      sleep 0.5
    done
    [[ -n $rc ]] || break  # the address file is there
    _RAY_PIDS=()
    if ! _ray_start_timed_out "$log" || ((try == tries)); then
      rm -f "$log"
      echo "ray_cluster: the Ray head exited while starting (exit $rc; see above)" >&2
      return 1
    fi
    echo "ray_cluster: the head's raylet did not register within Ray's 30 s (try $try of $tries)"
  done
  rm -f "$log"
  RAY_ADDRESS=$(<"$addr_file")
  export RAY_ADDRESS

  for node in "${nodes[@]:1}"; do
    # --overlap: the worker may share its node with the batch script instead of waiting for free
    # CPUs; -c: all of the node's CPUs, or Slurm's CPU binding would squeeze Ray's actors onto one.
    srun --nodes=1 --ntasks=1 --overlap -w "$node" --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" \
      bash "$_RAY_CLUSTER_SH" worker "$RAY_ADDRESS" &
    _RAY_PIDS+=("$!")
  done

  # Poll the cluster until every node (and GPU) has registered, a start process died, or time is up.
  _RAY_WANT_NODES=${#nodes[@]} _RAY_WANT_GPUS=$want_gpus _RAY_DEADLINE=$((deadline - SECONDS)) \
    _RAY_WATCH="${_RAY_PIDS[*]}" "${PYTHON:-python}" - <<'EOF'
import os, sys, time

import ray

want_nodes, want_gpus = int(os.environ["_RAY_WANT_NODES"]), float(os.environ["_RAY_WANT_GPUS"])
deadline = time.monotonic() + float(os.environ["_RAY_DEADLINE"])
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
while True:
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    res = ray.cluster_resources()
    have = f"{nodes}/{want_nodes} nodes, {res.get('GPU', 0):g}/{want_gpus:g} GPUs, {res.get('CPU', 0):g} CPUs"
    if nodes >= want_nodes and res.get("GPU", 0) >= want_gpus:
        print(f"ray_cluster: ready at {os.environ['RAY_ADDRESS']}: {have}", flush=True)
        sys.exit(0)
    for pid in os.environ["_RAY_WATCH"].split():
        try:  # gone, or a zombie its parent shell has not reaped yet
            with open(f"/proc/{pid}/stat") as f:
                dead = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            dead = True
        if dead:
            sys.exit(f"ray_cluster: a Ray start process (pid {pid}) ended early with {have}; see its lines above")
    if time.monotonic() > deadline:
        sys.exit(f"ray_cluster: only {have} after the timeout; a node failed to join (see above) or "
                 f"RAY_GPUS_PER_NODE is wrong")
    time.sleep(3)
EOF
}

# USR1, Slurm's warning before the time limit (sbatch --signal=B:USR1@<seconds>), sent to this
# shell alone: Ray's processes keep running, so the driver, alone asked to stop with SIGTERM, can
# finish its step and save every role's checkpoint.
_ray_time_up() {
  _RAY_TIME_UP=1
  echo "time limit near: asking the driver to checkpoint"
  if [[ -n $_RAY_DRIVER_PID ]]; then kill -TERM "$_RAY_DRIVER_PID" 2>/dev/null || true; fi
}

# Run the driver (the command given) and return its exit status. When the time-limit warning came
# and the driver then stopped with a checkpoint (exit 143, as a driver stopped by SIGTERM always exits:
# common/errors.py), stop Ray and requeue the job: the next run's --load_checkpoint resumes from
# that checkpoint. Without Slurm it just returns the driver's status.
ray_cluster_run() {
  local rc stopped
  # A driver that SIGTERM killed before it could save exits 143 too: the driver creates this file only
  # when it stopped after its checkpoint (common/training/checkpoint.py), so only that stop is requeued.
  stopped=$(mktemp -u "${TMPDIR:-/tmp}/hybridrl-stopped.XXXXXX")
  export HYBRIDRL_STOPPED_FILE=$stopped
  # In the background: bash runs a trap only once a foreground command has ended, which would hold
  # the warning until the driver finished on its own, and then the time limit would be past.
  "$@" &
  _RAY_DRIVER_PID=$!
  # A warning that came while Ray was starting.
  if ((_RAY_TIME_UP)); then kill -TERM "$_RAY_DRIVER_PID" 2>/dev/null || true; fi
  # `wait` also returns (status 138) when the trapped USR1 arrives: wait again while the driver
  # lives, then once more for its exit status, which bash keeps after the driver has gone.
  while kill -0 "$_RAY_DRIVER_PID" 2>/dev/null; do wait "$_RAY_DRIVER_PID" || true; done
  wait "$_RAY_DRIVER_PID" && rc=0 || rc=$?
  _RAY_DRIVER_PID=
  if ((rc == 143 && _RAY_TIME_UP)) && [[ -n ${SLURM_JOB_ID:-} && -e $stopped ]]; then
    rm -f "$stopped"
    # Ray first: the requeue ends this job's processes (SIGTERM), which would cut its stop short.
    ray_cluster_stop 0
    echo "time limit near: requeueing job $SLURM_JOB_ID to resume from the checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
  elif ((rc == 0 && _RAY_TIME_UP)); then
    echo "time limit near, but the run had already finished: not requeued"
  fi
  rm -f "$stopped"
  return "$rc"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  case ${1:-} in
    worker) shift; _ray_worker "$@" ;;
    *) echo "usage: source slurm/ray_cluster.sh, then ray_cluster_start; or: bash $0 worker <head address>" >&2
       exit 2 ;;
  esac
fi
