"""OpenRLHF's last flat-flag CLIs (commit 76351db1) against ours: every flag parses and either lands in
the options or is refused naming itself (never click's "No such option"), and OpenRLHF's example
commands run (RL: --dry_run; RM/DPO: 2 steps) or stop naming the capability we lack.

The flag lists and example commands are a checked-in copy (tests/data/openrlhf_flags_76351db1.json,
made by tests/data/make_openrlhf_flags.py from OpenRLHF's git history), so the test needs no OpenRLHF.
"""
from __future__ import annotations

import importlib
import json
import os

import pytest
import typer
from typer.testing import CliRunner

from tests.helpers import ROOT

DATA = json.load(open(os.path.join(ROOT, "tests", "data", "openrlhf_flags_76351db1.json")))
SCRIPTS = ["train_rm", "train_dpo", "train_ppo", "train_grpo", "train_sft"]
SAMPLE = {"int": "1", "float": "0.5", "str": "x"}


def _value(flag: dict) -> list[str]:
    """A value of OpenRLHF's type and arity for the flag (its default where it has one)."""
    if flag["type"] == "bool":
        return []
    d = flag["default"]
    if flag["nargs"] == 2:
        return [str(x) for x in (d or [0.5, 5.0])]
    if flag["nargs"] == "*":
        return [d if isinstance(d, str) else "all-linear"]
    if flag.get("choices"):
        return [str(flag["choices"][-1])]  # not the default: a refusal must show
    if d is None or d == "inf" or d == "":
        return [SAMPLE.get(flag["type"], "x")]
    return [str(d)]


def _command(name: str):
    module = importlib.import_module(name)
    return module, typer.main.get_command(module.app)


def _invoke(name: str, args: list[str], monkeypatch) -> tuple[int, str, dict | None]:
    """Run the script's main in-process through click, its train() replaced by a capture."""
    module, cmd = _command(name)
    got = {}
    monkeypatch.setattr(module, "train", lambda a, *rest: got.update(a=a))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # --use_wandb KEY puts it there: undone after the test
    result = CliRunner().invoke(module.app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output, got.get("a")


def _cases():
    for name in SCRIPTS:
        for flag in DATA["scripts"][name]["flags"]:
            yield pytest.param(name, flag, id=f"{name}--{flag['name']}")


@pytest.mark.parametrize("name,flag", list(_cases()))
def test_every_openrlhf_flag_parses_and_lands_or_is_refused(name, flag, monkeypatch, tmp_path):
    args = [f"--{flag['name']}", *_value(flag), "--save_path", str(tmp_path)]
    code, out, a = _invoke(name, args, monkeypatch)
    assert "No such option" not in out and "unexpected extra argument" not in out, out
    if code == 0:
        assert a is not None and flag["name"] in a, f"--{flag['name']} parsed but is not in the options"
    else:
        assert code == 2 and f"--{flag['name']}" in out and "Traceback" not in out, out


def test_defaults_are_openrlhfs_with_a_model_and_the_demos_without(monkeypatch, tmp_path):
    code, out, a = _invoke("train_ppo", ["--save_path", str(tmp_path)], monkeypatch)
    assert code == 0 and a["actor_learning_rate"] == 3e-4 and a["rollout_batch_size"] == 64
    assert "demo" in a["openrlhf"]["defaults"]["actor_learning_rate"]
    code, out, a = _invoke("train_ppo", ["--pretrain", "some/model", "--save_path", str(tmp_path),
                                         "--rollout_batch_size", "128"], monkeypatch)
    assert code == 0, out
    assert (a["actor_learning_rate"], a["kl_estimator"], a["lambd"], a["value_clip"], a["bf16"]) == (1e-6, "k1", 1.0, 0.5, True)
    assert a["rollout_batch_size"] == 128 and "rollout_batch_size" not in a["openrlhf"]["defaults"]  # the user's
    assert (a["prompt_max_len"], a["generate_max_len"]) == (1024, 1024)  # OpenRLHF's --max_len 2048
    code, out, a = _invoke("train_rm", ["--pretrain", "m", "--save_path", str(tmp_path)], monkeypatch)
    assert (a["learning_rate"], a["train_batch_size"], a["micro_train_batch_size"]) == (9e-6, 128, 1)


@pytest.mark.parametrize("args,expect", [
    (["--max_len", "4096", "--max_new_tokens", "1000"], {"prompt_max_len": 3096, "generate_max_len": 1000}),
    (["--max_len", "100"], {"prompt_max_len": 50, "generate_max_len": 50}),
    (["--param_dtype", "bf16"], {"bf16": True}),
    (["--attn_implementation", "eager"], {"flash_attn": "eager"}),
    (["--attn_implementation", "flash_attention_2"], {"flash_attn": True}),
    (["--vllm_sync_with_ray"], {"vllm_sync_backend": "ray"}),
    (["--remote_rm_url", "r.py"], {"reward_func": "r.py", "remote_rm_url": None}),
    (["--zpg", "8", "--overlap_comm"], {"zpg": 8, "overlap_comm": True}),
])
def test_translations(args, expect, monkeypatch, tmp_path):
    code, out, a = _invoke("train_grpo", [*args, "--save_path", str(tmp_path)], monkeypatch)
    assert code == 0, out
    assert {k: a[k] for k in expect} == expect


@pytest.mark.parametrize("args,expect", [
    (["--max_new_tokens", "8", "--generate_max_len", "8"], "two spellings of one limit"),
    (["--max_len", "64", "--prompt_max_len", "32", "--generate_max_len", "32"], "not all three"),
    (["--param_dtype", "fp16"], "use --param_dtype bf16"),
    (["--ring_attn_size", "2"], "ring attention"),
    (["--async_train"], "--async_train overlaps the vLLM engines' generation with training: add --vllm_num_engines N"),
    (["--async_train", "--vllm_num_engines", "1", "--colocate_all_models", "--vllm_enable_sleep"],
     "neither side can sleep: drop --vllm_enable_sleep, or give the engines GPUs of their own"),
    (["--attn_implementation", "flash_attention_3"], "choose flash_attention_2, sdpa or eager"),
])
def test_refusals_say_what_to_use(args, expect, monkeypatch, tmp_path):
    code, out, a = _invoke("train_grpo", [*args, "--save_path", str(tmp_path)], monkeypatch)
    assert code == 2 and expect in out and out.startswith("error: "), out


@pytest.mark.parametrize("name", ["train_ppo", "train_grpo"])
def test_partial_rollout_needs_async_train(name, monkeypatch, tmp_path):
    """--partial_rollout is a real option of both RL scripts; without --async_train it stops at once, in one line."""
    code, out, a = _invoke(name, ["--partial_rollout", "--vllm_num_engines", "1", "--save_path", str(tmp_path)], monkeypatch)
    assert code == 2 and out == ("error: --partial_rollout syncs weights into the generation that --async_train "
                                 "overlaps with training: add --async_train or drop --partial_rollout\n"), out
    code, out, a = _invoke(name, ["--partial_rollout", "--async_train", "--vllm_num_engines", "1",
                                  "--partial_rollout_chunk", "16", "--save_path", str(tmp_path)], monkeypatch)
    assert code == 0 and a["partial_rollout"] and a["partial_rollout_chunk"] == 16, out


def test_wandb_key_goes_to_the_environment_only(monkeypatch, tmp_path):
    code, out, a = _invoke("train_rm", ["--use_wandb", "SECRET123", "--save_path", str(tmp_path)], monkeypatch)
    assert code == 0 and os.environ.get("WANDB_API_KEY") == "SECRET123"
    assert a["use_wandb"] == "env" and "SECRET123" not in json.dumps(a, default=str)


@pytest.mark.parametrize("name", ["train_ppo", "train_grpo"])
def test_partial_rollout_with_an_agent_syncs_between_turns(name, monkeypatch, tmp_path):
    """--partial_rollout with --agent_func_path: a sync lands between two turns, so a chunk size has nothing
    to cut and is refused when given; the default goes through."""
    agent = ["--agent_func_path", os.path.join(ROOT, "examples", "agent_copy_openrlhf.py"), "--async_train",
             "--partial_rollout", "--vllm_num_engines", "1", "--save_path", str(tmp_path)]
    code, out, a = _invoke(name, [*agent, "--partial_rollout_chunk", "16"], monkeypatch)
    assert code == 2 and out.startswith("error: --partial_rollout_chunk does not apply with --agent_func_path: a weight "
                                        "sync lands between two turns of an episode"), out
    code, out, a = _invoke(name, agent, monkeypatch)
    assert code == 0 and a["partial_rollout"], out
