"""Agent files and chat turns (common/rl/agent.py), in this process: OpenRLHF's import answered without
OpenRLHF, the loader's refusals, the feedback's role tokens, and the drift check against the chat template
(none on a template that keeps earlier turns, reported on one that drops their reasoning)."""
from __future__ import annotations

import os
import sys

import pytest

from common.errors import UserError
from common.rl import agent as A
from tests.helpers import ROOT

QWEN_DROPS_THINKING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n"
    "{{ m['content'].split('</think>')[-1] }}<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    from common.training.models import load_tokenizer
    from common.training.tiny import tiny_model_path

    return load_tokenizer(tiny_model_path())


def test_openrlhf_files_load_without_openrlhf():
    for name in ("agent_copy_openrlhf.py", "agent_copy_plain.py"):
        executor = A.load_executor(os.path.join(ROOT, "examples", name))
        assert isinstance(executor, A.AgentExecutorBase)  # ours, OpenRLHF installed (the test extra) or not
    assert isinstance(A.load_executor(os.path.join(ROOT, "examples", "agent_copy_openrlhf.py")), A.MultiTurnAgentExecutor)
    real = sys.modules.get("openrlhf.utils.agent")  # left as it was: OpenRLHF's own, where something imported it
    assert real is None or real.MultiTurnAgentExecutor is not A.MultiTurnAgentExecutor


@pytest.mark.parametrize("body,expect", [
    ("x = 1\n", "it must define `AgentExecutor`"),
    ("class AgentExecutor:\n    pass\n", "must be a subclass of AgentExecutorBase or MultiTurnAgentExecutor"),
    ("import no_such_module\n", "importing it failed: ModuleNotFoundError"),
])
def test_a_bad_agent_file_is_one_line_naming_it(tmp_path, body, expect):
    path = tmp_path / "agent.py"
    path.write_text(body)
    with pytest.raises(UserError) as e:
        A.load_executor(str(path))
    assert str(e.value).startswith(f"--agent_func_path {path}: ") and expect in str(e.value)
    with pytest.raises(UserError, match="not a Python file"):
        A.load_executor(str(tmp_path / "missing.py"))


def test_feedback_becomes_a_chat_turn_and_drift_is_zero_on_a_prefix_keeping_template(tok):
    prefix, suffix = A.role_tokens(tok, "user")
    assert tok.decode(prefix) == "<|im_end|>\n<|im_start|>user\n" and tok.decode(suffix) == "<|im_end|>\n<|im_start|>assistant\n"

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # what the run accumulates: the sampled answer with its stop token, the role's tokens without a second one
    response = enc("red cat") + [eos] + prefix[1:] + enc("Wrong. Repeat: red cat") + suffix + enc("red cat") + [eos]
    assert not A.drift(tok, "user", ["red cat", "red cat"], ["Wrong. Repeat: red cat"], response)
    assert A.drift(tok, "user", ["red cat", "red dog"], ["Wrong. Repeat: red cat"], response)  # not the same text


def test_drift_is_reported_on_a_template_that_drops_earlier_reasoning(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = QWEN_DROPS_THINKING
    prefix, suffix = A.role_tokens(t, "user")
    eos = t.convert_tokens_to_ids("<|im_end|>")

    def enc(text):
        return t(text, add_special_tokens=False)["input_ids"]

    first = "<think>the words</think>red cat"
    response = enc(first) + [eos] + prefix[1:] + enc("Again") + suffix + enc("red cat") + [eos]
    assert A.drift(t, "user", [first, "red cat"], ["Again"], response)


def test_turn_versions_tag_each_turn_and_its_feedback():
    # prompt of 3 tokens; turn 1 = [3, 5), feedback [5, 7), turn 2 = [7, 10), feedback [10, 11)
    assert A.turn_versions([(3, 5), (7, 10)], 3, 8, [4, 5]) == [4, 4, 4, 4, 5, 5, 5, 5]
    assert A.turn_versions([(3, 5)], 3, 2, [7]) == [7, 7]
    # an executor whose engine calls and recorded actions do not pair up: no per-token answer
    assert A.turn_versions([(3, 5), (7, 10)], 3, 8, [4]) is None and A.turn_versions([], 3, 0, []) is None
