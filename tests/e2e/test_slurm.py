"""The Slurm templates on a real one-node Slurm: a private munged, slurmctld and slurmd started for
this module (installed with apt-get when missing), jobs submitted with sbatch that train the tiny
model through the Ray helper and through srun, a requeued job that resumes from its checkpoint, a
Ray job that checkpoints and requeues itself on the time-limit warning, and static checks of every
template (bash -n, shellcheck, the 70B plan's GPU total).

Only one machine exists, so "several nodes" are several tasks on it (srun) and, for Ray, the
helper's RAY_NODES listing the node twice (a head and a worker on the same host).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import time

import pytest

from tests.helpers import PY, ROOT, env, metrics

TEMPLATES = sorted(glob.glob(os.path.join(ROOT, "slurm", "*.sh")))
PORTS = (16817, 16818)  # slurmctld, slurmd: fixed in slurm.conf, away from Slurm's defaults (6817/6818)


def _sh(cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _checkout(tmp_path) -> str:
    """A copy of the repo's files as a fresh clone has them (no logs/, no output/, no .venv): what a
    user submits from. The jobs take PYTHON from the environment."""
    dest = tmp_path / "repo"
    files = _sh(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    for rel in filter(None, files.split("\0")):
        if os.path.isfile(os.path.join(ROOT, rel)):  # a file deleted but not yet committed is not there
            os.makedirs(dest / os.path.dirname(rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), dest / rel)
    return str(dest)


def _ensure_installed(tools: tuple[str, ...], packages: tuple[str, ...]) -> None:
    """Install `packages` with apt-get when one of `tools` is missing; skip if apt-get cannot run."""
    if all(shutil.which(t) for t in tools):
        return
    if not shutil.which("apt-get"):
        pytest.skip(f"{', '.join(tools)} not installed and apt-get is not available to install {' '.join(packages)}")
    if os.geteuid() != 0:
        pytest.skip(f"{', '.join(tools)} not installed, and apt-get needs root to install {' '.join(packages)}")
    apt_env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *packages]):
        p = _sh(cmd, timeout=900, env=apt_env)
        assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def _wait(what: str, check, timeout: float, every: float = 1.0):
    """Poll `check()` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Slurm:
    """A one-node Slurm cluster in `root` (state, logs, pid files, a private munge socket)."""

    def __init__(self, root: str):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(root, "slurm.conf")
        self.env = env() | {"SLURM_CONF": self.conf}
        self.pid_files = [os.path.join(root, n) for n in ("slurmd.pid", "slurmctld.pid", "munged.pid")]

    def start(self) -> None:
        r = self.root
        for d in ("state", "spool"):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        # A munged of our own (own key and socket): nothing in /etc/munge or /run/munge is touched
        # and a munged already running on the machine is left alone.
        key, sock = os.path.join(r, "munge.key"), os.path.join(r, "munge.sock")
        _sh(["mungekey", "-c", "-k", key], check=True)
        _sh(["munged", "--force", f"--socket={sock}", f"--key-file={key}", f"--pid-file={r}/munged.pid",
             f"--log-file={r}/munged.log", f"--seed-file={r}/munged.seed"], check=True)
        cpus = os.cpu_count() or 1
        mem_mb = int(_sh(["free", "-m"]).stdout.splitlines()[1].split()[1]) - 1024
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=hybridrl-test
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=30
SlurmctldPort={PORTS[0]}
SlurmdPort={PORTS[1]}
NodeName={self.host} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")
        for daemon in ("slurmctld", "slurmd"):
            p = _sh([f"/usr/sbin/{daemon}", "-f", self.conf], env=self.env)
            assert p.returncode == 0, f"{daemon} did not start: {p.stderr}\n{self.logs()}"
        _wait("the Slurm node to be idle", lambda: self.sinfo() == "idle", timeout=60)

    def sinfo(self) -> str:
        return _sh(["sinfo", "-h", "-o", "%T"], env=self.env).stdout.strip()

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                out.append(f"--- {name}\n" + open(path).read()[-3000:])
        return "\n".join(out)

    def stop(self) -> None:
        try:  # a job left running (a failed test) would keep its processes after the daemons go
            _sh(["scancel", "--full", "--user", "root"], env=self.env, timeout=30)
            _wait("the jobs to end", lambda: not _sh(["squeue", "-h"], env=self.env).stdout.strip(), timeout=60)
        except (subprocess.TimeoutExpired, AssertionError):
            pass  # slurmctld is not answering; stop the daemons anyway
        for path in self.pid_files:
            try:
                pid = int(open(path).read().strip())
            except (OSError, ValueError):
                continue
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                continue
            _wait(f"pid {pid} ({os.path.basename(path)}) to exit", lambda: not _alive(pid), timeout=30, every=0.2)

    # ---- jobs
    def sbatch(self, *args: str, env_extra: dict | None = None, wait: bool = False, timeout: float = 600) -> str:
        """Submit from the repo root (as a user would); return the job id. With `wait`
        (`sbatch --wait`), block until the job ends and check that it succeeded."""
        cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), *args]
        p = _sh(cmd, timeout=timeout, cwd=ROOT, env=self.env | (env_extra or {}))
        job = p.stdout.strip().split(";")[0]
        if wait and p.returncode != 0:
            raise AssertionError(f"job {job} failed (sbatch --wait exit {p.returncode}):\n{p.stderr}\n"
                                 f"{self.job_output(job)}\n{self.logs()}")
        assert p.returncode == 0 and job, f"sbatch failed: {p.stderr}"
        return job

    ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")

    def finish(self, job: str, timeout: float = 600) -> str:
        """Poll every second until `job` ends (`sbatch --wait` looks less and less often, which
        costs up to half a minute per job here); return its final state."""
        return _wait(f"job {job} to end", lambda: (st := self.job(job).get("JobState")) in self.ENDED and st, timeout)

    def progress(self, job: str, what: str, check, timeout: float = 600, every: float = 0.3):
        """`_wait` for a sign of progress of a running job, ending at once with the job's output when the
        job has ended first (a job that failed at start would otherwise be waited on for `timeout` s)."""
        def check_while_running():
            got = check()
            if not got and (state := self.job(job).get("JobState")) in self.ENDED:
                got = check()  # what the job did just before it ended
                assert got, f"job {job} ended ({state}) before {what}:\n{self.job_output(job)}"
            return got
        return _wait(what, check_while_running, timeout, every)

    def job(self, job: str) -> dict:
        out = _sh(["scontrol", "show", "job", "--oneliner", job], env=self.env).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def job_output(self, job: str) -> str:
        path = self.job(job).get("StdOut", "")
        return open(path).read() if path and os.path.exists(path) else f"(no output file for job {job})"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The cluster, started once for this file and stopped (by its pid files) when the file's tests
    are done: module scope, so no Slurm daemon outlives these tests into other test files."""
    _ensure_installed(("slurmctld", "slurmd", "sbatch", "munged", "mungekey"), ("slurm-wlm", "munge"))
    if os.geteuid() != 0:
        pytest.skip("slurmd has to run as root to start jobs")
    if any(_port_busy(p) for p in PORTS):
        pytest.skip(f"ports {PORTS} are taken (another Slurm test running?)")
    cluster = Slurm(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---- static checks: no Slurm needed

def test_templates_are_valid_bash():
    assert {os.path.basename(t) for t in TEMPLATES} >= {
        "env.sh", "ray_cluster.sh", "ppo_70b.sh", "grpo_8b.sh", "dpo_8b.sh", "rm_8b.sh", "debug_tiny.sh",
        "sft_8b.sh", "ppo_8b.sh", "pipeline_8b.sh"}
    for t in TEMPLATES:
        p = _sh(["bash", "-n", t])
        assert p.returncode == 0, f"{t}: {p.stderr}"


def test_templates_pass_shellcheck():
    _ensure_installed(("shellcheck",), ("shellcheck",))
    # From the repo root, so `source slurm/env.sh` in a template is followed and checked too.
    p = _sh(["shellcheck", "--external-sources", *TEMPLATES], cwd=ROOT)
    assert p.returncode == 0, p.stdout


def test_sbatch_headers():
    for t in TEMPLATES:
        text = open(t).read()
        if "#SBATCH" not in text:
            continue  # a sourced helper
        head = text.split("set -euo pipefail")[0]
        for opt in ("--requeue", "--output=logs/%x-%j.out", "--open-mode=append"):
            assert f"#SBATCH {opt}" in head, (t, opt)
        assert "--save_steps" in text and "--load_checkpoint" in text, t
        assert 'cd "${SLURM_SUBMIT_DIR:-.}"' in text, t
        last = [ln for ln in text.splitlines() if ln.strip()][-1]
        assert last.rstrip().endswith('"$@"'), (t, last)


def _dry_run(template: str, *flags: str) -> str:
    p = _sh(["bash", os.path.join("slurm", template), *flags], cwd=ROOT,
            env=env() | {"PYTHON": PY, "DRY_RUN": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def _total_gpus(out: str) -> int:
    m = re.search(r"^total: (\d+) GPUs in (\d+) placement group", out, re.M)
    assert m, out
    return int(m.group(1))


def test_ppo_70b_plan_is_48_gpus_in_three_groups_of_16():
    out = _dry_run("ppo_70b.sh")
    assert _total_gpus(out) == 48 and "in 3 placement group(s)" in out, out
    roles = ("actor", "critic", "ref", "reward", "vllm")
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0] in roles}
    assert "group actor+ref: bundles 0-15" in rows["actor"] and "group actor+ref" in rows["ref"], out
    assert "group critic+reward: bundles 0-15" in rows["critic"] and "group critic+reward" in rows["reward"], out
    assert "4 engines x TP 4" in rows["vllm"] and "group vllm: bundles 0-3, 4 GPUs each" in rows["vllm"], out
    # A flag after the template's name overrides the template's own: 2 engines x TP 4 = 8 GPUs fewer.
    assert _total_gpus(_dry_run("ppo_70b.sh", "--vllm_num_engines", "2")) == 40


def test_grpo_8b_plan_is_one_hybrid_node():
    out = _dry_run("grpo_8b.sh")
    assert _total_gpus(out) == 8 and "group actor+ref+reward+vllm: bundles 0-7, 0.25 GPU each" in out, out


def test_ppo_8b_plan_is_one_hybrid_node_with_a_critic():
    out = _dry_run("ppo_8b.sh")
    assert _total_gpus(out) == 8 and "critic" in out, out


@pytest.mark.parametrize("template,script", [("sft_8b.sh", "train_sft.py"), ("rm_8b.sh", "train_rm.py"),
                                             ("dpo_8b.sh", "train_dpo.py")])
def test_deepspeed_templates_dry_run_off_a_cluster(template, script):
    """DRY_RUN=1 outside a job (no node list; scontrol exited 127 here before) prints the command each
    rank would run, the flags after the template's name last, so that they win."""
    out = _dry_run(template, "--max_epochs", "2")
    cmd = out.splitlines()[-1].split()
    assert "would run:" in out and cmd[:2] == [PY, script], out
    assert cmd[-2:] == ["--max_epochs", "2"] and "--load_checkpoint" in cmd and "--save_path" in cmd, out


def _pipeline(*, cwd: str = ROOT, **extra: str) -> subprocess.CompletedProcess:
    return _sh(["bash", "slurm/pipeline_8b.sh"], cwd=cwd, env=env() | {"PYTHON": PY} | extra, timeout=120)


def test_pipeline_8b_dry_run_prints_the_three_submissions():
    p = _pipeline(DRY_RUN="1", SFT_FLAGS="--max_epochs 2")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("pipeline_8b: DRY_RUN=1:")]
    assert [ln.split()[2] for ln in lines] == ["sft", "rm", "ppo"], p.stderr
    assert lines[0].endswith("slurm/sft_8b.sh --max_epochs 2"), lines[0]
    assert "--dependency=afterok:SFT_JOB_ID" in lines[1] and "--dependency=afterok:RM_JOB_ID" in lines[2], lines


def test_pipeline_8b_stops_naming_the_stage_when_sbatch_fails(tmp_path):
    """An sbatch that fails (no Slurm here, or a partition Slurm refuses) stops the pipeline with a
    non-zero exit naming the stage; before, it went on and printed empty job ids with exit 0."""
    # an empty slurm.conf: sbatch fails at once (a missing one it retries for 60 s)
    (tmp_path / "slurm.conf").write_text("")
    p = _pipeline(cwd=_checkout(tmp_path), SBATCH_FLAGS="--partition=no-such-partition",
                  SLURM_CONF=str(tmp_path / "slurm.conf"))
    assert p.returncode != 0, p.stdout + p.stderr
    assert "pipeline_8b: sbatch failed for the sft stage" in p.stderr and "no job was submitted" in p.stderr, p.stderr
    assert "-> rm job" not in p.stdout, p.stdout


# ---- jobs on the real Slurm

# Turns a GPU template into a one-node CPU job: the command line overrides its #SBATCH lines.
def _cpu_job(tmp_path, ntasks: int) -> list[str]:
    return ["--nodes=1", f"--ntasks={ntasks}", f"--ntasks-per-node={ntasks}", "--gpus-per-node=0",
            "--cpus-per-task=1", f"--output={tmp_path}/%x-%j.out"]


TINY_PAIRS = ["--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_len", "128"]


def _job_env(tmp_path) -> dict:
    # PRETRAIN= DATASET= : the built-in tiny model and task; SHARED_DIR keeps caches out of the repo.
    return {"PYTHON": PY, "PRETRAIN": "", "DATASET": "", "SHARED_DIR": str(tmp_path / "shared")}


def _steps(save_path) -> list[int]:
    return [r["step"] for r in metrics(str(save_path))]


def _assert_model_written(save_path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "curves.png"):
        assert os.path.exists(os.path.join(save_path, name)), (save_path, name, os.listdir(save_path))
    with open(os.path.join(save_path, "config.json")) as f:
        assert json.load(f).get("model_type")


def _start_requeued_now(slurm, job: str) -> None:
    """Wait until `job` is pending again after its requeue, then let it start at once instead of
    after Slurm's ~2 min hold (BeginTime)."""
    def pending():
        st = slurm.job(job)["JobState"]
        assert st not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), f"{st}\n{slurm.job_output(job)}"
        return st == "PENDING"
    _wait(f"job {job} to be requeued", pending, timeout=180, every=0.5)
    # slurmd refuses ("Job credential revoked") a launch credential made in the same whole second
    # as the requeue revoked the old one (`cred->ctime <= revoked`): release it in the next second.
    time.sleep(1.05 - time.time() % 1)
    _sh(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm.env, check=True)


def test_a_worker_whose_raylet_did_not_register_in_time_starts_again(tmp_path):
    """Ray gives a new node 30 s to register (fixed); a busy node's `ray start` fails with "timed out during
    startup", and the worker tries again; another failure ends the worker at once; TERM reaches `ray start`.
    A stand-in interpreter plays `ray start` (no Slurm or Ray needed)."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
n=$(cat {tmp_path}/n 2>/dev/null || echo 0); echo $((n + 1)) > {tmp_path}/n
[ "$1" = "{os.path.join(ROOT, "slurm", "free_ports.py")}" ] && exec {PY} "$@"
echo "ray start $((n + 1)) $*"
case $MODE in
  slow) [ "$(ls {tmp_path}/started-* 2>/dev/null | wc -l)" -lt 2 ] && {{ touch {tmp_path}/started-$n
        echo "Exception: The current node timed out during startup. This could happen ..."; exit 1; }} ;;
  bad) echo "ConnectionError: could not reach the head"; exit 1 ;;
esac
trap 'echo "ray start stopped by TERM"; exit 0' TERM
touch {tmp_path}/running; while true; do sleep 0.1; done
""")
    fake.chmod(0o755)
    cmd = ["bash", os.path.join(ROOT, "slurm", "ray_cluster.sh"), "worker", "10.0.0.1:6379"]
    p = subprocess.Popen(cmd, env=env() | {"PYTHON": str(fake), "MODE": "slow"}, stdout=subprocess.PIPE, text=True)
    _wait("the third start to run", lambda: (tmp_path / "running").exists(), timeout=30, every=0.1)
    p.terminate()
    out = p.communicate(timeout=30)[0]
    assert p.returncode == 0, out
    assert out.count("did not register with the head within Ray's 30 s") == 2, out
    assert "(try 2 of 3)" in out and "ray start stopped by TERM" in out, out
    assert "--address=10.0.0.1:6379" in out, out
    p = subprocess.run(cmd, env=env() | {"PYTHON": str(fake), "MODE": "bad"}, capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and p.stdout.count("joining 10.0.0.1:6379") == 1, p.stdout  # not tried again
    assert "could not reach the head" in p.stdout and "did not register" not in p.stdout, p.stdout


def test_a_head_whose_raylet_did_not_register_in_time_starts_again(tmp_path):
    """The head's raylet has the same fixed 30 s (seen failing on a machine busy with other Ray clusters):
    ray_cluster_start tries the head again with fresh ports, and gives up naming the head after the last
    try or at once on any other failure. A stand-in interpreter plays `ray start --head` and the readiness poll."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
[ "$1" = "{os.path.join(ROOT, "slurm", "free_ports.py")}" ] && exec {PY} "$@"
[ "$1" = "-" ] && {{ cat >/dev/null; echo "fake poll: ready"; exit 0; }}
n=$(cat {tmp_path}/n 2>/dev/null || echo 0); echo $((n + 1)) > {tmp_path}/n
echo "ray start $((n + 1)) $*"
if [ "$MODE" = bad ] || [ "$n" -lt "$FAILS" ]; then
  [ "$MODE" = bad ] && echo "ValueError: bad option" || echo "Exception: The current node timed out during startup."
  exit 1
fi
for a in "$@"; do case $a in --temp-dir=*) mkdir -p "${{a#--temp-dir=}}"; echo 10.0.0.2:6380 > "${{a#--temp-dir=}}/ray_current_cluster";; esac; done
trap 'echo "head stopped by TERM"; exit 0' TERM
while true; do sleep 0.1; done
""")
    fake.chmod(0o755)
    script = f'source {os.path.join(ROOT, "slurm", "ray_cluster.sh")}; ray_cluster_start && echo "address $RAY_ADDRESS"'

    def start(mode: str, fails: int) -> subprocess.CompletedProcess:
        (tmp_path / "n").unlink(missing_ok=True)
        shutil.rmtree(tmp_path / "ray", ignore_errors=True)
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env() | {
            "PYTHON": str(fake), "MODE": mode, "FAILS": str(fails), "RAY_NODES": "localhost",
            "RAY_GPUS_PER_NODE": "0", "RAY_TEMP_DIR": str(tmp_path / "ray")})

    p = start("slow", 2)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("the head's raylet did not register within Ray's 30 s") == 2, p.stdout
    assert "(try 2 of 3)" in p.stdout and "address 10.0.0.2:6380" in p.stdout, p.stdout
    assert "head stopped by TERM" in p.stdout, p.stdout  # the EXIT trap stops the head that started
    ports = re.findall(r"--port=(\d+)", p.stdout)
    assert len(ports) == 3, p.stdout  # fresh ports each try (a failed head may leave its port in TIME_WAIT)
    p = start("slow", 3)
    assert p.returncode == 1 and p.stdout.count("ray start") == 3, p.stdout
    assert "the Ray head exited while starting (exit 1" in p.stderr, p.stderr
    p = start("bad", 0)
    assert p.returncode == 1 and p.stdout.count("ray start") == 1, p.stdout  # not tried again
    assert "bad option" in p.stdout and "the Ray head exited while starting" in p.stderr, p.stdout + p.stderr


def test_ray_helper_fails_fast_when_a_node_cannot_join(slurm, tmp_path):
    save = tmp_path / "grpo"
    start = time.monotonic()
    job = slurm.sbatch(f"--output={tmp_path}/%x-%j.out", "slurm/debug_tiny.sh", "--save_path", str(save),
                       env_extra=_job_env(tmp_path) | {"RAY_NODES": f"{slurm.host} no-such-node"})
    state, out = slurm.finish(job), slurm.job_output(job)
    assert state == "FAILED", (state, out)
    # Noticed when the worker's srun died, long before the 300 s start timeout; the driver never ran.
    assert time.monotonic() - start < 120, out
    # (on a box too busy for Ray's fixed 30 s node registration, the head's own start fails first: also fast and named)
    assert re.search(r"ray_cluster: a Ray start process \(pid \d+\) ended early with 1/2 nodes"
                     r"|ray_cluster: the Ray head exited while starting", out), out
    assert "ray_cluster: stopping Ray" in out and not save.exists(), out
    temp = f"/tmp/ray-{job}-0"
    assert f"Ray's logs are in {temp}/session_latest/logs" in out, out  # kept after a failure
    assert not _sh(["pgrep", "-f", temp]).stdout.split(), f"Ray processes of job {job} still running"
    shutil.rmtree(temp, ignore_errors=True)


def test_templates_find_the_venv_from_a_shell_without_it(slurm, tmp_path):
    """sbatch from a shell with neither PYTHON set nor the venv on PATH (`No module named 'ray'` before):
    slurm/env.sh takes the project's .venv. Ray templates print their plan (DRY_RUN=1), DeepSpeed ones
    their --help through srun; an interpreter without the packages is refused with what to set."""
    if os.path.realpath(PY) != os.path.realpath(os.path.join(ROOT, ".venv", "bin", "python")):
        pytest.skip("these tests do not run from the project's .venv, which is what the templates look for")
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and os.path.realpath(d) != os.path.realpath(os.path.dirname(PY)))
    bare = {"PATH": path, "PYTHON": "", "VIRTUAL_ENV": "", "PRETRAIN": "", "DATASET": "",
            "SHARED_DIR": str(tmp_path / "shared")}
    jobs = {}
    for name, extra, flags in (("debug_tiny.sh", {"DRY_RUN": "1"}, []), ("grpo_8b.sh", {"DRY_RUN": "1"}, []),
                               ("ppo_70b.sh", {"DRY_RUN": "1"}, []), ("dpo_8b.sh", {}, ["--help"]),
                               ("rm_8b.sh", {}, ["--help"])):
        jobs[name] = slurm.sbatch(*_cpu_job(tmp_path, ntasks=1), f"slurm/{name}", *flags, env_extra=bare | extra)
    bad = slurm.sbatch(*_cpu_job(tmp_path, ntasks=1), "slurm/debug_tiny.sh",
                       env_extra=bare | {"PYTHON": "/usr/bin/python3", "DRY_RUN": "1"})
    for name, job in jobs.items():
        state, out = slurm.finish(job, timeout=300), slurm.job_output(job)
        assert state == "COMPLETED", f"{name}: {state}\n{out}"
        assert ("resource plan" if name in ("debug_tiny.sh", "grpo_8b.sh", "ppo_70b.sh") else "Usage") in out, out
        assert "No module named" not in out, out
    state, out = slurm.finish(bad, timeout=300), slurm.job_output(bad)
    assert state == "FAILED" and "slurm/env.sh: /usr/bin/python3 cannot import hybridrl's packages" in out, out
    assert "PYTHON=/path/to/venv/bin/python sbatch" in out, out


def test_rm_8b_two_ranks_requeued_resume_from_their_checkpoint(slurm, tmp_path):
    """rm_8b.sh with two ranks started by srun (no launcher), requeued mid-run: both ranks stop at the same
    step, save there, and the requeued job resumes from that checkpoint; the model saved from the two ZeRO-3
    shards loads whole. (Merged: the two-rank run, the requeue of a one-rank DPO job, and the two-process
    ZeRO-3 reward model under torchrun of test_rm_dpo.py.)"""
    save, total = tmp_path / "rm", 10
    job = slurm.sbatch(*_cpu_job(tmp_path, ntasks=2), "slurm/rm_8b.sh", *TINY_PAIRS, "--max_steps", str(total),
                       "--save_steps", "2", "--save_path", str(save), env_extra=_job_env(tmp_path))
    slurm.progress(job, "the first checkpoint", lambda: glob.glob(str(save / "checkpoints" / "step*")))
    assert slurm.job(job)["JobState"] == "RUNNING", slurm.job_output(job)
    p = _sh(["scontrol", "requeue", job], env=slurm.env)
    assert p.returncode == 0, p.stderr
    _start_requeued_now(slurm, job)
    state, out = slurm.finish(job), slurm.job_output(job)
    assert state == "COMPLETED", f"{state}\n{out}\n{slurm.logs()}"
    assert slurm.job(job)["Restarts"] == "1"
    assert "2 ranks on" in out and "world size: 2" in out, out
    assert "batch: 8 = 4 x 1 accum x 2 ranks" in out, out
    # --open-mode=append: both runs are in the log. Requeue sends SIGTERM: the first run finished
    # its step, saved a checkpoint there and stopped; the second run resumed from that checkpoint.
    assert "restart 0," in out and "restart 1," in out, out
    stopped = re.search(r"SIGTERM: stopped after step (\d+)", out)
    assert stopped, out
    resumed = re.findall(r"resumed from: (\S+)", out)
    assert resumed == ["-", str(save / "checkpoints" / f"step{int(stopped.group(1)):08d}")], (resumed, out)
    # metrics.jsonl: appended by the second run from the step after the checkpoint, so every step
    # appears once: nothing repeated, nothing lost, never from step 1 again.
    assert 2 <= int(stopped.group(1)) < total
    assert _steps(save) == list(range(1, total + 1))
    _assert_model_written(save)
    cfg = json.load(open(save / "config.json"))
    assert cfg["hybridrl"]["zero_stage"] == 3 and cfg["model_type"] == "qwen2"  # run options + model config
    from common.training.models import load_reward_model

    model = load_reward_model(str(save))  # gathered from the two shards into full tensors
    assert model.score.weight.shape[1] == model.config.hidden_size


def test_time_limit_warning_checkpoints_a_two_node_ray_job_and_requeues_it(slurm, tmp_path):
    """debug_tiny.sh trains GRPO through a two-node Ray cluster (this node twice: a Ray head, and a Ray
    worker started through srun, as on two machines); the time-limit warning makes it checkpoint, stop
    its Ray and requeue, and the second run resumes there. (Merged: the two-node run that ended cleanly.)"""
    save, total = tmp_path / "grpo", 12  # steps of ~0.5 s: room for the signal to land before the last
    # --save_steps 100: no periodic checkpoint, so the only one is the one the warning asks for.
    job = slurm.sbatch(f"--output={tmp_path}/%x-%j.out", "slurm/debug_tiny.sh", "--save_path", str(save),
                       "--max_steps", str(total), "--save_steps", "100",
                       env_extra=_job_env(tmp_path) | {"RAY_NODES": f"{slurm.host} {slurm.host}"})
    log = save / "metrics.jsonl"
    slurm.progress(job, "two logged steps", lambda: log.exists() and log.read_text().count("\n") >= 2)
    # What `#SBATCH --signal=B:USR1@120` sends 2 min before the time limit: USR1 to the batch shell alone.
    _sh(["scancel", "--batch", "--signal=USR1", job], env=slurm.env, check=True)
    _start_requeued_now(slurm, job)  # the job requeues itself
    state, out = slurm.finish(job), slurm.job_output(job)
    assert state == "COMPLETED" and slurm.job(job)["Restarts"] == "1", f"{state}\n{out}\n{slurm.logs()}"
    assert "time limit near: asking the driver to checkpoint" in out, out
    stopped = re.search(r"SIGTERM: stopped after step (\d+)", out)
    assert stopped and 2 <= int(stopped.group(1)) < total, out
    ckpt = save / "checkpoints" / "actor" / f"step{int(stopped.group(1)):08d}"
    assert ckpt.is_dir(), out
    assert re.findall(r"resumed from: (\S+)", out) == ["-", str(ckpt)], out
    assert _steps(save) == list(range(1, total + 1))  # each step once: none redone, none lost
    assert len(re.findall(r"ray_cluster: ready at \S+: 2/2 nodes", out)) == 2, out  # both runs, both nodes
    assert "ray_cluster: worker on" in out, out
    _assert_model_written(save)
    # Both runs stopped their Ray cleanly (temp folders removed) and left no process behind.
    assert not glob.glob(f"/tmp/ray-{job}-*"), out
    assert not _sh(["pgrep", "-f", f"/tmp/ray-{job}-"]).stdout.split(), f"Ray processes of job {job} still running"


def test_pipeline_8b_chains_sft_rm_ppo_as_dependent_jobs(slurm, tmp_path):
    """slurm/pipeline_8b.sh submits three jobs, each after the one before succeeded (afterok) and reading
    its folder: SFT and the reward model train the tiny model for a few steps (srun, one rank), and
    the PPO job prints its 8-GPU plan (PPO_DRY_RUN=1: this node has no GPUs). From a fresh clone, with
    the templates' own logs/%x-%j.out: the script makes logs/, which sbatch needs before a job starts."""
    out, repo = tmp_path / "pipeline", _checkout(tmp_path)
    tiny = _job_env(tmp_path) | {
        "OUT": str(out), "SFT_DATASET": "", "RM_DATASET": "", "PROMPT_DATA": "", "PPO_DRY_RUN": "1",
        "SBATCH_FLAGS": " ".join(f for f in _cpu_job(tmp_path, ntasks=1) if not f.startswith("--output")),
        "SFT_FLAGS": "--max_steps 3 --eval_steps 3 --train_batch_size 8 --micro_train_batch_size 4 --max_len 128",
        "RM_FLAGS": " ".join([*TINY_PAIRS, "--max_steps", "2", "--learning_rate", "5e-4"])}
    p = _sh(["bash", "slurm/pipeline_8b.sh"], cwd=repo, env=slurm.env | tiny, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"sft job (\d+) -> rm job (\d+) -> ppo job (\d+)", p.stdout)
    assert m, p.stdout
    sft, rm, ppo = m.groups()
    assert slurm.job(rm)["Dependency"].startswith(f"afterok:{sft}"), slurm.job(rm)
    assert slurm.job(ppo)["Dependency"].startswith(f"afterok:{rm}"), slurm.job(ppo)
    for job in (sft, rm, ppo):
        state = slurm.finish(job)
        assert state == "COMPLETED", f"{job}: {state}\n{slurm.job_output(job)}\n{slurm.logs()}"
    _assert_model_written(out / "sft")
    _assert_model_written(out / "rm")
    assert f"model: {out / 'sft'}" in slurm.job_output(rm), slurm.job_output(rm)  # the RM starts from the SFT model
    plan = slurm.job_output(ppo)
    assert _total_gpus(plan) == 8 and "group actor+critic+ref+reward+vllm" in plan, plan
    assert sorted(os.listdir(os.path.join(repo, "logs"))) == sorted(
        [f"sft-8b-{sft}.out", f"rm-8b-{rm}.out", f"ppo-8b-{ppo}.out"])


def test_readme_slurm_line_runs_as_written_from_a_fresh_clone(slurm, tmp_path):
    """The README's Slurm line, verbatim, from a fresh clone (no logs/): sbatch opens the job's
    logs/%x-%j.out before the job starts and does not make the folder, so a bare `sbatch` there made a
    job that failed at once, with no log. sbatch's environment sets GPUs to 0 (this node has none) and
    DRY_RUN=1 makes the job print its plan."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    bullet = readme[readme.index("\n- Slurm"):]
    bullet = bullet[:bullet.index("\n- ", 1)]
    line = next(s for s in re.findall(r"`([^`]+)`", bullet) if "sbatch slurm/grpo_8b.sh" in s)
    repo = _checkout(tmp_path)
    p = _sh(["bash", "-c", line], cwd=repo,
            env=slurm.env | _job_env(tmp_path) | {"DRY_RUN": "1", "SBATCH_GPUS_PER_NODE": "0"})
    assert p.returncode == 0, p.stdout + p.stderr
    job = re.search(r"Submitted batch job (\d+)", p.stdout).group(1)
    state, log = slurm.finish(job, timeout=300), os.path.join(repo, "logs", f"grpo-8b-{job}.out")
    assert state == "COMPLETED" and os.path.exists(log), (line, state, slurm.job(job))
    assert _total_gpus(open(log).read()) == 8
