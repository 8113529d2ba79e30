"""Faults: preemption, a kill during a save, dead workers, hung reward servers, NaN losses, a layout this
machine cannot hold, a stale Ray cluster file."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers import PY, ROOT, env, free_port, metrics, script, wait_for


def test_sigterm_saves_a_checkpoint_exits_143_and_resumes(tmp_path):
    """Exit 143, what a shell reports for a command SIGTERM ended, not 0: `train_rm.py ... && train_ppo.py ...`
    must not go on with a reward model that did not finish (slurm/ray_cluster.sh requeues on it)."""
    out = str(tmp_path / "rm")
    args = [PY, os.path.join(ROOT, "train_rm.py"), "--save_path", out, "--max_steps", "400", "--eval_steps", "-1"]
    p = subprocess.Popen(args, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mpath = os.path.join(out, "metrics.jsonl")
    wait_for(lambda: os.path.exists(mpath) and len(open(mpath).readlines()) >= 3, 120, "a few steps")
    p.send_signal(signal.SIGTERM)  # what Slurm sends before preempting or requeueing a job
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 143, text[-2000:]
    assert "SIGTERM: stopped after step" in text
    assert text.splitlines()[-3:] == [  # the run's last lines: where its files went, and that no model did
        f"metrics: {out}/metrics.jsonl", f"curves: {out}/curves.png",
        f"model: not saved (stopped before the last step); --load_checkpoint resumes from {out}/checkpoints",
    ], text[-2000:]
    done = [r["step"] for r in metrics(out)]
    ckpts = os.listdir(os.path.join(out, "checkpoints"))
    assert ckpts == [f"step{done[-1]:08d}"], (ckpts, done[-3:])
    p = script("train_rm.py", "--save_path", out, "--max_steps", str(done[-1] + 2), "--eval_steps", "-1",
               "--load_checkpoint")
    assert p.stdout.splitlines()[-3:] == [f"metrics: {out}/metrics.jsonl", f"curves: {out}/curves.png",
                                          f"reward model: {out}"], p.stdout[-2000:]
    steps = [r["step"] for r in metrics(out)]
    assert steps == list(range(1, done[-1] + 3))  # continued, nothing repeated or lost


KILL_DURING_SAVE = r"""
import os, signal, sys, torch
from common.training import ds
from common.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
root = sys.argv[1]
dist = ds.setup_distributed()
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
s = ds.DSSettings(zero_stage=2, micro_train_batch_size=2, train_batch_size=2)
engine = ds.initialize(model, s, dist, torch.float32, lr=1e-2, total_steps=10, scheduler="constant")
def step():
    loss = engine(torch.randn(2, 8)).pow(2).mean(); engine.backward(loss); engine.step()
step(); save_checkpoint(root, 1, {"model": engine}, {"step": 1}, rank=0)
step()
if sys.argv[2] == "kill":
    real = engine.save_checkpoint
    def dying(*a, **k):
        real(*a, **k)               # the model files are written...
        os.kill(os.getpid(), signal.SIGKILL)   # ...and the process dies before the save completes
    engine.save_checkpoint = dying
    save_checkpoint(root, 2, {"model": engine}, {"step": 2}, rank=0)
else:
    state = load_checkpoint(latest_checkpoint(root), {"model": engine}, rank=0)
    print("RESUMED", state["step"], latest_checkpoint(root))
    save_checkpoint(root, 3, {"model": engine}, {"step": 3}, rank=0)
    print("AFTER", sorted(os.listdir(root)))
"""


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path):
    root = str(tmp_path / "ckpt")
    code = tmp_path / "kill.py"
    code.write_text(KILL_DURING_SAVE)
    p = subprocess.run([PY, str(code), root, "kill"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert ".tmp-step00000002" in os.listdir(root)  # the half-written save is there, but does not count
    p = subprocess.run([PY, str(code), root, "resume"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"RESUMED 1 {root}/step00000001" in p.stdout
    assert "AFTER ['step00000001', 'step00000003']" in p.stdout  # the leftover was cleared by the next save


def test_nan_loss_stops_the_run_with_the_step(tmp_path):
    p = script("train_rm.py", "--save_path", str(tmp_path), "--learning_rate", "1e30", "--max_steps", "6", check=False)
    assert p.returncode == 1
    assert "the reward model loss is nan" in p.stderr and "step" in p.stderr and "Traceback" not in p.stderr


SKIP_NONFINITE = r"""
import json, torch
from common.training import ds
from common.training import updates
dist = ds.setup_distributed()
# seeded: with some draws the one-element bias's bf16 step rounds to no change, and 'changed' failed
torch.manual_seed(0)
x = torch.randn(2, 1, 8)

def engine(stage, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    s = ds.DSSettings(zero_stage=stage, micro_train_batch_size=1, train_batch_size=2)  # 2 accumulation steps
    return ds.initialize(model, s, dist, dtype, lr=1e-2, total_steps=10, scheduler="linear", warmup_ratio=0.0)

def update(e, fault=None):
    for i in range(2):
        # one NaN in one gradient of the first micro-batch, or an infinite loss whose gradients are finite
        hook = e.module[0].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([3]), float("nan"))) \
            if fault == "nan_grad" and i == 0 else None
        loss = e(x[i].to(e.module[0].weight.dtype)).float().pow(2).mean()
        if fault == "inf_loss" and i == 1:
            loss = loss + float("inf")
        e.backward(updates.poison_nonfinite(loss))
        e.step()
        if hook:
            hook.remove()
    return e.was_step_applied()

for stage, dtype in [(0, torch.float32), (1, torch.float32), (2, torch.float32), (3, torch.float32),
                     (0, torch.bfloat16), (2, torch.bfloat16)]:
    faulty, clean = engine(stage, dtype), engine(stage, dtype)
    out = {"stage": stage, "dtype": str(dtype), "applied": [update(faulty)]}
    before = ds.full_state_dict(faulty)
    out["applied"] += [update(faulty, "nan_grad"), update(faulty, "inf_loss")]
    out["unchanged"] = all(torch.equal(v, ds.full_state_dict(faulty)[k]) for k, v in before.items())
    out["skipped_steps"] = faulty.skipped_steps
    out["applied"].append(update(faulty))
    out["changed"] = all(not torch.equal(v, ds.full_state_dict(faulty)[k]) for k, v in before.items())
    update(clean), update(clean)
    # bit-identical to a run that never saw the faults: moments and LR schedule untouched too
    out["as_if_never"] = all(torch.equal(v, ds.full_state_dict(clean)[k]) for k, v in ds.full_state_dict(faulty).items())
    print(json.dumps(out))
"""


def test_nonfinite_gradients_skip_the_update_under_every_zero_stage(tmp_path):
    code = tmp_path / "skip.py"
    code.write_text(SKIP_NONFINITE)
    p = subprocess.run([PY, str(code)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 6, p.stdout[-2000:]
    for r in rows:
        assert r["applied"] == [True, False, False, True], r
        assert r["unchanged"] and r["changed"] and r["as_if_never"] and r["skipped_steps"] == 2, r
    assert "OVERFLOW" not in p.stdout + p.stderr  # our metrics count skips; DeepSpeed's line is filtered out


def test_skip_nonfinite_updates_counts_them_and_resumes_the_count(tmp_path):
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    # 1e30: the first update makes the weights huge, every later loss is NaN and its update skipped
    # (no warm-up: OpenRLHF's ceil(ratio x steps) warm-up would make the first update's learning rate 0)
    flags = ["--learning_rate", "1e30", "--lr_warmup_ratio", "0", "--skip_nonfinite_updates", "--max_steps", "4",
             "--save_steps", "2", "--eval_steps", "-1"]
    script("train_rm.py", "--save_path", full, *flags)
    assert [r["train/skipped_updates"] for r in metrics(full)] == [0, 1, 2, 3]
    script("train_rm.py", "--save_path", resumed, "--ckpt_path", os.path.join(full, "checkpoints"), "--load_checkpoint",
           *flags)
    assert [r["train/skipped_updates"] for r in metrics(resumed)] == [2, 3]  # the count went into the checkpoint


class _Silent(BaseHTTPRequestHandler):
    def do_POST(self):
        time.sleep(30)  # never answers in time

    def log_message(self, *args):
        pass


def test_hung_reward_server_ends_the_run_with_a_timeout(tmp_path, ray_head):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        from tests.e2e.test_rl import SMALL

        t0 = time.time()
        p = script("train_grpo.py", "--save_path", str(tmp_path), "--remote_rm_url",
                   f"http://127.0.0.1:{server.server_port}/score", "--reward_timeout", "1", "--prompt_data",
                   _prompts(tmp_path), "--apply_chat_template", "--max_steps", "2", *SMALL["train_grpo.py"], check=False)
        assert p.returncode == 2, p.stderr[-2000:]
        assert "127.0.0.1" in p.stderr and ("timed out" in p.stderr or "timeout" in p.stderr), p.stderr[-2000:]
        assert time.time() - t0 < 150
    finally:
        server.shutdown()


def _prompts(tmp_path):
    import json

    from common.data.tasks import prompt_rows

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(32, "train", seed=4)))
    return str(path)


def _descendants(root: int) -> set[int]:
    """`root` and every process below it, from /proc's parent ids."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except OSError:  # gone meanwhile
                continue
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def test_a_killed_worker_ends_the_run_naming_it(tmp_path, ray_head):
    out = str(tmp_path / "run")
    args = [PY, os.path.join(ROOT, "train_grpo.py"), "--save_path", out, "--max_steps", "200", "--eval_steps", "-1",
            "--rollout_batch_size", "8"]
    p = subprocess.Popen(args, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mpath = os.path.join(out, "metrics.jsonl")
    wait_for(lambda: os.path.exists(mpath) and len(open(mpath).readlines()) >= 1, 180, "the first step")
    try:  # Ray titles each actor's process "ray::<Class>..."; kill one model worker of this cluster with SIGKILL
        ours = _descendants(int(os.environ["HYBRIDRL_TEST_RAY_HEAD_PID"]))  # not another test's cluster beside it
        pids = [q for q in subprocess.run(["pgrep", "-f", "ray::ModelWorker"], capture_output=True, text=True).stdout.split()
                if int(q) in ours]
        assert pids, "no model worker process found"
        os.kill(int(pids[0]), signal.SIGKILL)
    except BaseException:
        p.kill()
        raise
    t0 = time.time()
    _, err = p.communicate(timeout=300)
    assert p.returncode == 1, err[-2000:]
    assert ("actor" in err or "ref" in err) and ("died" in err or "dead" in err or "kill" in err.lower()), err[-2000:]
    assert "Traceback" not in err
    assert time.time() - t0 < 120


def test_preemption_marks_a_stop_only_where_the_launcher_asks(tmp_path, monkeypatch):
    """A stop for SIGTERM exits 143, as does a driver SIGTERM killed before it could save; slurm/ray_cluster.sh
    tells them apart by the file it names in HYBRIDRL_STOPPED_FILE, which only a stop after its checkpoint creates."""
    import signal as sig

    from common.training.checkpoint import Preemption

    marker = tmp_path / "stopped"
    monkeypatch.setenv("HYBRIDRL_STOPPED_FILE", str(marker))
    old, old_int = sig.getsignal(sig.SIGTERM), sig.getsignal(sig.SIGINT)
    try:
        p = Preemption()
        assert not p.requested() and not marker.exists()
        os.kill(os.getpid(), sig.SIGTERM)
        time.sleep(0.1)
        assert p.requested()
        p.mark_stopped()
        assert marker.read_text() == "stopped\n"
        monkeypatch.delenv("HYBRIDRL_STOPPED_FILE")
        marker.unlink()
        p.mark_stopped()  # no launcher asking: nothing written anywhere
        assert not marker.exists()
    finally:
        sig.signal(sig.SIGTERM, old)
        sig.signal(sig.SIGINT, old_int)  # Preemption takes Ctrl-C too


GRAD_NORM = r"""
import json, torch
from common.training import ds
dist = ds.setup_distributed()
x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

def loss(m, i):
    return m(x[i]).pow(2).mean() * 100  # gradients far above the clipping norm

# the naive first norm: the plain model, the two micro-batches' mean loss
m = model()
((loss(m, 0) + loss(m, 1)) / 2).backward()
naive = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters()])).item()
for stage in (0, 1, 2, 3):
    s = ds.DSSettings(zero_stage=stage, micro_train_batch_size=1, train_batch_size=2, max_norm=0.05)
    e = ds.initialize(model(), s, dist, torch.float32, lr=1e-2, total_steps=10, scheduler="linear", warmup_ratio=0.0)
    norms = []
    for _ in range(3):
        for i in range(2):
            e.backward(loss(e, i))
            e.step()
        norms.append(e.get_global_grad_norm())
    print(json.dumps({"stage": stage, "naive": naive, "norms": [float(n) for n in norms],
                      "weights": [v.flatten().tolist() for v in ds.full_state_dict(e).values()]}))
"""


def test_grad_norm_is_reported_and_clipped_alike_under_every_zero_stage(tmp_path):
    """ZeRO-0 steps a plain optimizer, whose gradient norm DeepSpeed never kept (train/grad_norm was None):
    every stage reports the norm before clipping (the first against a naive computation) and, having
    clipped by it, ends with the same weights."""
    code = tmp_path / "norm.py"
    code.write_text(GRAD_NORM)
    p = subprocess.run([PY, str(code)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3], p.stdout[-2000:]
    for r in rows:
        assert r["norms"][0] == pytest.approx(r["naive"], rel=1e-5), r
        assert r["norms"][0] > 0.05 * 10, r  # clipping is active in this test
        assert r["norms"] == pytest.approx(rows[3]["norms"], rel=1e-5), r
        for w, w3 in zip(r["weights"], rows[3]["weights"]):
            assert w == pytest.approx(w3, rel=1e-5, abs=1e-7), r["stage"]


@pytest.fixture
def ray_tmpdir():
    """An empty RAY_TMPDIR for a script: Ray's cluster file and session folders go there instead of /tmp/ray, which
    other clusters on the machine use. Short, since Ray's socket paths inside it must stay under 108 bytes."""
    path = tempfile.mkdtemp(prefix="r", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_layout_this_machine_cannot_hold_is_refused_before_any_process(tmp_path, ray_tmpdir):
    """OpenRLHF's 8-GPU PPO command run as `python train_ppo.py` on a CPU: 24 worker processes for a Ray of its own,
    against 4 per core of the 2 it may use. Refused in seconds with the README's counts, the message a too small
    `ray start` cluster gives, before Ray or any other process starts; its --dry_run starts none either."""
    from common.training.tiny import tiny_model_path
    from tests.e2e.test_newcomer import TAG, _run_processes
    from tests.e2e.test_rl import REFERENCE_GRPO, REFERENCE_PPO

    model, tag, out = tiny_model_path(), uuid.uuid4().hex, tmp_path / "out"
    e = env() | {"RAY_TMPDIR": ray_tmpdir, TAG: tag}
    e.pop("RAY_ADDRESS", None)  # a Ray of the script's own, not the session's `ray start` one
    cores = sorted(os.sched_getaffinity(0))[:2]  # the machine the message describes, whatever runs the test

    def run(name: str, flags: str, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        p = subprocess.Popen([PY, os.path.join(ROOT, name), *flags.format(model=model, rm=model, out=out).split(),
                              *extra], cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: os.sched_setaffinity(0, cores))
        stdout, stderr = p.communicate(timeout=300)
        assert not _run_processes(tag, p.pid), _run_processes(tag, p.pid)
        return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), time.monotonic() - t0

    for name, flags in (("train_ppo.py", REFERENCE_PPO), ("train_grpo.py", REFERENCE_GRPO)):
        p, _ = run(name, flags, "--dry_run")
        assert p.returncode == 0 and "total: 8 GPUs" in p.stdout, p.stderr[-2000:]
    p, took = run("train_ppo.py", REFERENCE_PPO)
    assert p.returncode == 2, p.stderr[-3000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    msg = errors[0]
    assert (f"the plan starts 24 worker processes (actor 8, critic 8, vllm 8) but a Ray of its own on this machine "
            f"runs at most {4 * len(cores)}") in msg, msg
    for change in ("--actor_num_gpus_per_node 1", "--critic_num_gpus_per_node 1", "--ref_num_gpus_per_node 1",
                   "--reward_num_gpus_per_node 1", "--vllm_num_engines 1", "--vllm_tensor_parallel_size 1",
                   "drop --vllm_enable_sleep", "drop --deepspeed_enable_sleep"):
        assert change in msg, (change, msg)
    assert took < 60, took  # before Ray: seconds (5 s alone), not the minutes of starting 24 processes
    assert os.listdir(ray_tmpdir) == [] and not out.exists()  # no Ray session, no run folder


def test_a_stale_ray_cluster_file_gives_a_local_ray(tmp_path, ray_tmpdir):
    """A `ray start` head that died leaves Ray's cluster file naming it. A run given no address starts a Ray of its
    own, saying so in one line; RAY_ADDRESS=auto asks for that cluster, so it is refused naming the file."""
    cluster_file = os.path.join(ray_tmpdir, "ray", "ray_current_cluster")
    os.makedirs(os.path.dirname(cluster_file))
    with open(cluster_file, "w") as f:
        f.write(f"127.0.0.1:{free_port()}")  # nothing listens there
    e = env() | {"RAY_TMPDIR": ray_tmpdir}
    e.pop("RAY_ADDRESS", None)
    # what every script calls before its workers start (a whole run costs a minute more and checks nothing else)
    code = "from common.errors import exit_on_user_error\nfrom common.cluster.ray_groups import init_ray\n" \
           "with exit_on_user_error():\n    print('CPUs', init_ray(num_cpus=2)['CPU'])\n"
    p = subprocess.run([PY, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "CPUs 2.0" in p.stdout, p.stderr[-3000:]
    said = [ln for ln in (p.stdout + p.stderr).splitlines() if cluster_file in ln]
    assert len(said) == 1 and said[0].startswith("warning: nothing answers at "), p.stderr[-3000:]
    assert said[0].endswith("starting a local Ray for this run"), said
    p = subprocess.run([PY, "-c", code], cwd=ROOT, env=e | {"RAY_ADDRESS": "auto"}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.startswith("error: RAY_ADDRESS=auto: nothing answers at ") and cluster_file in p.stderr, p.stderr
    assert os.path.exists(cluster_file)  # Ray's file, not ours to remove
