"""MetricsLogger: the files a run leaves behind, plain vs terminal console output, resume, PNG."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


from common.logger import git_commit
from tests.helpers import ROOT, env


def test_versions_do_not_import_torch():
    code = ("import sys, json; from common.logger import versions, git_commit; "
            "print(json.dumps([versions(), git_commit(), 'torch' in sys.modules]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    v, commit, torch_loaded = json.loads(res.stdout)
    assert set(v) == {"python", "torch", "transformers", "deepspeed", "ray", "vllm"}
    assert all(isinstance(x, str) and x for x in v.values())
    assert v["python"] == ".".join(map(str, sys.version_info[:3]))
    assert not torch_loaded
    assert commit == git_commit() and (commit == "unknown" or re.fullmatch(r"[0-9a-f]{4,40}", commit))


def test_config_json_names_the_script_the_commit_and_uncommitted_changes(tmp_path):
    """A run of an edited copy is traceable from its config.json: the script's name, path and SHA-256, the
    commit, and whether the tree had uncommitted changes (the untracked copy is one). In a git repository of
    its own (a copy of common/), so that clean and dirty are both known."""
    import hashlib
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(Path(ROOT) / "common", repo / "common", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import sys\nfrom common.logger import MetricsLogger\n"
            "log = MetricsLogger(sys.argv[1], 1, config={'lr': 1})\nlog.banner('t', {})\nlog.close()\n")
    (repo / "train_x.py").write_text(code)

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "x")

    def run(script: str) -> tuple[dict, str]:
        out = tmp_path / script
        p = subprocess.run([sys.executable, script, str(out)], cwd=repo, capture_output=True, text=True, timeout=120,
                           env={**env(), "PYTHONPATH": str(repo)})
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads((out / "config.json").read_text())["hybridrl"], p.stdout

    clean, _ = run("train_x.py")
    assert clean["script"] == "train_x.py" and clean["script_path"] == str((repo / "train_x.py").resolve())
    assert clean["git_commit"] == git("rev-parse", "--short", "HEAD")
    assert clean["git_dirty"] is False and clean["git_changes"] == []
    (repo / "my_x.py").write_text(code + "# edited\n")  # copied and edited, not committed
    edited, banner = run("my_x.py")
    assert edited["script"] == "my_x.py" and edited["git_dirty"] is True and edited["git_changes"] == ["?? my_x.py"]
    assert edited["script_sha256"] == hashlib.sha256((repo / "my_x.py").read_bytes()).hexdigest() != clean["script_sha256"]
    assert f"source: my_x.py at commit {clean['git_commit']}, uncommitted changes in 1 file(s)" in banner, banner
