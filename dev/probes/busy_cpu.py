"""train_dpo.py's step time on an idle CPU and beside one competing CPU-bound process.

    flock /tmp/cpu.lock .venv/bin/python dev/probes/busy_cpu.py              # the figure in docs/performance.md
    flock /tmp/cpu.lock .venv/bin/python dev/probes/busy_cpu.py --env GOMP_SPINCOUNT=300000   # libgomp's default

Each case runs `train_dpo.py --max_steps N` on the built-in tiny model and reports the median
`time/step_s` (steps 3..N: the first two include warm-up) and the wall time of the whole run. The
competitor is one Python busy loop, the "one other job" of a shared 2-core machine. A slowdown near
2x is what a fair share of the cores gives; far more means threads waiting on each other.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(steps: int, env: dict, busy: bool) -> tuple[float, float, str]:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, os.path.join(ROOT, "train_dpo.py"), "--max_steps", str(steps),
                                "--save_path", out, "--eval_steps", "-1"], cwd=ROOT, env=env,
                               capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                sys.exit(f"train_dpo.py exited {p.returncode}:\n{p.stderr[-3000:]}")
            with open(os.path.join(out, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            threads = next((ln.strip() for ln in p.stdout.splitlines() if "torch threads on" in ln), "")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return statistics.median(r["time/step_s"] for r in rows[2:]), wall, threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the training process")
    args = ap.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".venv", "torch_extensions"))
    env.update(kv.split("=", 1) for kv in args.env)
    print(f"load average before: {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; extra env: {args.env or '-'}")
    idle, wall_idle, threads = run(args.steps, env, busy=False)
    busy, wall_busy, _ = run(args.steps, env, busy=True)
    print(f"banner: {threads or '(no thread line)'}")
    print(f"idle: {idle:.3f} s/step ({wall_idle:.0f} s run); one competing job: {busy:.3f} s/step "
          f"({wall_busy:.0f} s run); slowdown {busy / idle:.2f}x")


if __name__ == "__main__":
    main()
