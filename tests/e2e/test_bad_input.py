"""Bad input of every kind gets one line naming the flag and exit code 2, in every script (issue #22 item 1):
the values click checks while parsing, the output folders, a model that is neither a folder nor
fetchable, and the small messages of item 8."""
from __future__ import annotations

import os

import pytest

from tests.helpers import script

SCRIPTS = ["train_sft.py", "train_rm.py", "train_dpo.py", "train_ppo.py", "train_grpo.py"]


def _one_line_error(p, flag: str) -> None:
    lines = [s for s in p.stderr.splitlines() if s.strip()]
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and flag in p.stderr, p.stderr[-2000:]
    assert len([s for s in lines if s.startswith("error:")]) == 1 and len(lines) <= 3, p.stderr[-2000:]


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("flags,flag", [(["--lr_scheduler", "foo"], "--lr_scheduler"),
                                        (["--zero_stage", "x"], "--zero_stage")])
def test_a_bad_value_is_one_line_at_parse_time(tmp_path, name, flags, flag):
    _one_line_error(script(name, *flags, "--save_path", str(tmp_path / "o"), check=False, timeout=60), flag)


@pytest.mark.parametrize("flags,flag", [(["--kl_estimator", "k9"], "--kl_estimator"),
                                        (["--advantage_estimator", "ppo"], "--advantage_estimator"),
                                        (["--vllm_sync_backend", "tcp"], "--vllm_sync_backend")])
def test_the_rl_choices_are_checked_at_parse_time(tmp_path, flags, flag):
    _one_line_error(script("train_grpo.py", *flags, "--save_path", str(tmp_path / "o"), check=False, timeout=60), flag)


def test_rm_loss_choice(tmp_path):
    _one_line_error(script("train_rm.py", "--loss", "hinge", "--save_path", str(tmp_path / "o"), check=False), "--loss")


@pytest.mark.parametrize("name", SCRIPTS)
def test_save_path_that_is_a_file_or_not_writable(tmp_path, name):
    f = tmp_path / "f"
    f.write_text("keep me")
    _one_line_error(script(name, "--save_path", str(f), check=False, timeout=60), "--save_path")
    assert f.read_text() == "keep me"  # nothing saved is lost
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        _one_line_error(script(name, "--save_path", str(ro / "run"), check=False, timeout=60), "--save_path")


@pytest.mark.parametrize("name", ["train_rm.py", "train_grpo.py"])
def test_a_hub_model_that_cannot_be_fetched_is_one_line(tmp_path, name):
    p = script(name, "--pretrain", "meta-llama/Meta-Llama-3-8B", "--max_steps", "1", "--save_path", str(tmp_path / "o"),
               check=False, timeout=300)
    _one_line_error(p, "--pretrain meta-llama/Meta-Llama-3-8B")
    assert "not a local folder" in p.stderr


def test_a_missing_pretrain_folder_names_the_flag(tmp_path):
    p = script("train_dpo.py", "--pretrain", str(tmp_path / "none"), "--save_path", str(tmp_path / "o"), check=False)
    _one_line_error(p, "--pretrain")
