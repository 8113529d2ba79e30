"""The command lines: --help of each script, flag spelling, and the user's reference commands."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers import PY, ROOT, env, script

SCRIPTS = ["train_rm.py", "train_dpo.py", "train_ppo.py", "train_grpo.py", "train_sft.py"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_lists_panels_and_reference_flags(name):
    p = script(name, "--help")
    out = p.stdout
    for panel in ("Model", "Optimization", "DeepSpeed", "Logging & checkpoints"):
        assert panel in out, f"{name} --help has no {panel} panel"
    for flag in ("--pretrain", "--save_path", "--zero_stage", "--micro_train_batch_size", "--bf16", "--flash_attn"):
        assert flag in out, f"{name} --help does not show {flag}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_does_not_import_heavy_packages(name):
    code = (f"import sys; sys.argv = ['{name}', '--help']; import runpy\n"
            f"try:\n    runpy.run_path('{ROOT}/{name}', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'ray', 'vllm', 'deepspeed', 'transformers') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    p = subprocess.run([PY, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in p.stdout, p.stdout[-500:] + p.stderr[-500:]


def test_local_rank_is_accepted_and_bad_flags_say_what_to_change(tmp_path):
    # --local_rank=N is what the deepspeed launcher appends.
    p = script("train_rm.py", "--local_rank=0", "--zero_stage", "7", "--save_path", str(tmp_path), check=False)
    assert p.returncode == 2
    assert "--zero_stage 7" in p.stderr and "stages 0, 1, 2 and 3" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("name,role", [("train_grpo.py", "actor"), ("train_ppo.py", "critic")])
def test_batch_that_does_not_split_over_the_ranks_stops_before_the_models_load(tmp_path, name, role):
    """64 samples cannot be split into micro-batches of 64 on each of 2 ranks: said at start, in
    seconds, not after Ray and the models have loaded (it used to surface from a worker, ~40 s in)."""
    out = tmp_path / "run"
    p = script(name, "--save_path", str(out), f"--{role}_num_gpus_per_node", "2", "--rollout_batch_size", "64",
               "--train_batch_size", "64", "--micro_train_batch_size", "64", check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "--micro_train_batch_size 64 x world size 2 = 128" in p.stderr and "Traceback" not in p.stderr, p.stderr
    # the banner comes once the models have loaded, and Ray's workers would have said "ray::"
    assert not out.exists() and "== hybridrl" not in p.stdout and "ray::" not in p.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_at_80_columns_shows_every_flag_name_whole_and_no_value_for_flags(name):
    """A pipe, a Slurm log or a small terminal: no flag name may be cut (`--micro_train_batch_s…`),
    and a boolean flag shows no `<bool>` value, since it takes none."""
    import re

    p = subprocess.run([PY, os.path.join(ROOT, name), "--help"], cwd=ROOT, env=env() | {"COLUMNS": "80"},
                       capture_output=True, text=True, timeout=60)
    lines = p.stdout.splitlines()
    assert max(len(s) for s in lines) <= 80
    shown = set(re.findall(r"(--[a-z0-9_]+)(?![a-z0-9_…])", p.stdout))
    code = (f"import runpy, typer; m = runpy.run_path({os.path.join(ROOT, name)!r}); "
            "c = typer.main.get_command(m['app']); "
            "print(' '.join(o for q in c.params if not q.hidden for o in q.opts))")
    flags = subprocess.run([PY, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60).stdout.split()
    assert len(flags) > 20
    missing = [f for f in flags if f not in shown]
    assert not missing, f"cut or missing at 80 columns: {missing}"
    assert "…" not in p.stdout and "<bool>" not in p.stdout


@pytest.mark.parametrize("name,cls", [("train_dpo.py", "DPOOptions"), ("train_sft.py", "SFTOptions"),
                                      ("train_grpo.py", "GRPOOptions")])
def test_train_receives_typed_frozen_options(name, cls):
    """`train` gets one typed, read-only object, not a dict: a misspelt option is an AttributeError,
    a derived default (GRPO's --n_samples_per_prompt) is already filled in, and common/ can still
    read it by key."""
    code = (f"import runpy, sys, dataclasses; sys.argv = [{name!r}, '--zero_stage', '1', '--save_path', '/nonexistent/x']\n"
            f"m = runpy.run_path({os.path.join(ROOT, name)!r})\n"
            "got = []\n"
            "m['train'].__globals__['train'] = lambda a, *rest: got.append(a)\n"
            "try:\n    m['app']()\nexcept SystemExit:\n    pass\n"
            "a = got[0]\n"
            "assert a.zero_stage == 1 and a['zero_stage'] == 1 and dict(a)['zero_stage'] == 1\n"
            "try:\n    a.zero_stge\nexcept AttributeError:\n    print('MISSPELT-RAISES')\n"
            "try:\n    a.zero_stage = 3\nexcept dataclasses.FrozenInstanceError:\n    print('FROZEN')\n"
            "print('TYPE', type(a).__name__, getattr(a, 'n_samples_per_prompt', 'absent'))\n")
    p = subprocess.run([PY, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert "MISSPELT-RAISES" in p.stdout and "FROZEN" in p.stdout, p.stdout[-1000:] + p.stderr[-2000:]
    assert f"TYPE {cls}" in p.stdout
    if name == "train_grpo.py":
        assert "TYPE GRPOOptions 8" in p.stdout  # filled from --advantage_estimator group_norm


@pytest.mark.parametrize("mode,gpus", [("ppo8", 8), ("grpo8", 8)])
def test_multi_gpu_runs_plan_on_a_cpu(tmp_path, mode, gpus):
    """The multi-GPU runs wait for a machine of several GPUs: each is one command, checked here with
    --dry_run (config-only models of the real shape), so that there it only needs running."""
    e = env() | {"DRY": "1", "PY": PY, "OUT": str(tmp_path / "out"), "MODELS": str(tmp_path / "models")}
    p = subprocess.run(["bash", "dev/multi_gpu_runs.sh", mode], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"total: {gpus} GPUs" in p.stdout and "needs a GPU of" in p.stdout
    assert "4 engines x TP 2" in p.stdout  # the reference's engines, verbatim


@pytest.mark.parametrize("name", ["train_rm.py", "train_grpo.py"])
def test_a_second_run_into_a_run_folder_is_refused_unless_it_continues_that_run(tmp_path, name):
    """--save_path holding another run's metrics: refused before torch loads (exit 2, one line saying what to
    do), its files untouched. --load_checkpoint (that run continues from its checkpoint) and --dry_run
    (writes nothing) pass the check, as does a folder an earlier run left with nothing logged."""
    import json

    from common.cli.checks import check_output_folders

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"hybridrl": {"script": "train_rm.py"}}))
    check_output_folders({"save_path": str(out)})  # only its config.json: a run that stopped before logging
    (out / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.69}\n')
    p = script(name, "--save_path", str(out), check=False, timeout=120)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert errors[0] == (f"error: --save_path {out} already holds a run of train_rm.py (metrics.jsonl with 1 logged "
                         "step(s)), which this one would overwrite: give another --save_path, add --load_checkpoint "
                         "to continue that run from its newest checkpoint, or remove the folder"), errors
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "train/loss": 0.69}\n'
    check_output_folders({"save_path": str(out), "load_checkpoint": True})
    check_output_folders({"save_path": str(out), "dry_run": True})
