"""The built wheel: every module of common/'s folders is in it, and an edited copy of a script runs from a
folder outside the checkout on the installed package alone (what `pip install .` gives a user)."""
from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

from tests.helpers import PY, ROOT, env


def test_a_wheel_carries_every_module_and_a_copied_script_runs_outside_the_checkout(tmp_path):
    src = tmp_path / "src"  # a copy, so the build's egg-info and build/ stay out of the checkout
    shutil.copytree(os.path.join(ROOT, "common"), src / "common", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ["pyproject.toml", "README.md", *(p.name for p in Path(ROOT).glob("train_*.py"))]:
        shutil.copy(os.path.join(ROOT, name), src / name)
    p = subprocess.run([PY, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                        str(src)], env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("hybridrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {str(p.relative_to(ROOT)) for p in Path(ROOT, "common").rglob("*.py")}
    assert want - names == set(), sorted(want - names)  # a folder without its modules would break at import
    assert {f"train_{s}.py" for s in ("sft", "rm", "dpo", "ppo", "grpo")} <= names, sorted(names)

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    shutil.copy(site / "train_grpo.py", work / "my_grpo.py")
    # PYTHONPATH ahead of the checkout's editable install: `common` must come from the wheel
    e = env() | {"PYTHONPATH": str(site)}
    code = ("import runpy, sys; sys.argv = ['my_grpo.py', '--dry_run', '--vllm_num_engines', '1', '--colocate_all_models']\n"
            "try:\n    runpy.run_path('my_grpo.py', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "import common.rl.run, common.cluster.memory_plan\nprint('FROM', common.__path__[0], common.rl.run.__file__)")
    p = subprocess.run([PY, "-c", code], cwd=work, env=e, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resource plan" in p.stdout and "memory plan" in p.stdout, p.stdout[-2000:]
    where = p.stdout.split("FROM", 1)[1].split()
    assert all(w.startswith(str(site)) for w in where), where
