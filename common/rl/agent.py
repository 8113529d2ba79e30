"""Multi-turn agent rollouts (--agent_func_path): OpenRLHF's agent files, token in and token out.

An agent file defines `AgentExecutor`, OpenRLHF's contract: usually `class AgentExecutor(MultiTurnAgentExecutor)`
over an `AgentInstance(AgentInstanceBase)` whose `async reset(states)` returns {"observation": text} and whose
`async step(states)` returns {"rewards", "environment_feedback", "done"} and optionally "scores",
"sampling_params" and "extra_logs"; or an `AgentExecutorBase` subclass with its own `async execute(prompt,
label, sampling_params, max_length, hf_tokenizer, llm_engine)`. The file imports those names from
`openrlhf.utils.agent`, an import this module answers (`load_executor`), OpenRLHF installed or not.

How an episode runs here (`run_episodes`):
- every episode is a coroutine in a thread of its own, so an environment whose `step` blocks holds up only its
  episode; `llm_engine.generate` hands the turn to the batcher (common.rl.agent_batching), which adds it to
  its engine's running batch (`VllmEngine.serve`, continuous batching), so a turn that ends goes to its
  environment at once while the other episodes' turns keep decoding;
- token in, token out: the ids the engine sampled are appended as they are (a sampled stop token included);
  environment feedback is tokenised once and appended; the trainer gets exactly that sequence. Feedback tokens
  are masked out of the loss (`Samples.response_mask`), carry no log-prob and do not count as response length;
- `max_turns` and a per-turn token cap beside the episode's total budget (`max_length`, OpenRLHF's); an episode
  cut by the budget, the turn cap or a turn's token cap is `truncated`;
- `feedback_role`: the feedback wrapped in the chat template's own tokens for that role (taken from the
  tokenizer's template), so the file returns plain text;
- an environment that raises, exceeds the step timeout, or returns a malformed result stops the run with one
  message naming the file and the field (UserError, exit 2).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import importlib.util
import os
import sys
import threading
import time
import types
from dataclasses import dataclass, field

from common.errors import TrainingError, UserError, one_line
from common.rl.agent_batching import TurnBatcher


# ---------------------------------------------------------------- OpenRLHF's names
class AgentExecutorBase:
    """OpenRLHF's base of an agent executor: `async execute(...)` returns one episode as a dict."""

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        raise NotImplementedError("AgentExecutor.execute")


class AgentInstanceBase:
    """OpenRLHF's base of an environment: one instance per episode."""

    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    async def step(self, states: dict, **kwargs):
        raise NotImplementedError("AgentInstance.step")


@dataclass
class Limits:
    """What bounds an episode besides OpenRLHF's total budget (set by the run on the executor)."""
    max_turns: int = 0               # 0: no cap
    max_tokens_per_turn: int = 0     # 0: the remaining budget
    feedback_prefix: list[int] = field(default_factory=list)  # the role's opening tokens (feedback_role)
    feedback_suffix: list[int] = field(default_factory=list)  # its closing tokens and the assistant's opening
    feedback_role: str | None = None  # --agent_feedback_role: also check the episode against the chat template
    step_timeout: float = 0.0        # seconds a reset/step may take; 0: no limit


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's multi-turn executor, token in and token out (see the module's docstring)."""

    limits = Limits()  # the run sets its own on the instance

    def __init__(self, agent_instance_cls):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError("MultiTurnAgentExecutor(AgentInstance): AgentInstance must subclass AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    async def _call(self, what: str, coro):
        """The environment's reset() or step(); with a timeout, in a thread of its own, so that one that blocks
        (time.sleep, a synchronous request) is cut at the timeout too, not only one that awaits."""
        try:
            return await self._run(what, coro)
        except AgentError:
            raise
        except Exception as e:
            raise AgentError(what, f"raised {one_line(e)}") from None

    async def _run(self, what: str, coro):
        t = self.limits.step_timeout
        if not t:
            return await coro
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            try:
                result = asyncio.run(coro)
            except BaseException as e:  # handed to the episode, which reports it
                if fut.set_running_or_notify_cancel():  # False: the episode gave up at the timeout
                    fut.set_exception(e)
            else:
                if fut.set_running_or_notify_cancel():
                    fut.set_result(result)

        threading.Thread(target=run, daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), t)
        except asyncio.TimeoutError:
            raise AgentError(what, f"took longer than {t:g} s (--agent_timeout)") from None

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        lim = self.limits
        instance = self.agent_instance_cls()
        reset = await self._call("reset()", instance.reset({"observation": prompt, "label": label}))
        observation = _field(reset, "observation", str, "reset()")
        # the prompt's own ids when the environment keeps it: no re-tokenisation of what the run already tokenised
        known = getattr(llm_engine, "prompt_ids", {}).get(prompt)
        tokens = list(known) if observation == prompt and known else _encode(hf_tokenizer, observation)
        logprobs = [0.0] * len(tokens) if sampling_params.logprobs is not None else None
        ranges, total, scores, extra, truncated, turns = [], 0.0, None, {}, False, 0
        actions, feedbacks, start = [], [], len(tokens)
        while True:
            budget = max_length - len(tokens)
            if budget <= 0:
                truncated = True  # the episode's budget ran out before the environment said done
                break
            params = copy.deepcopy(sampling_params)
            # an environment's own max_tokens (sampling_params it returned) caps its next turn too: OpenRLHF
            # overwrites it with the budget
            caps = [budget, lim.max_tokens_per_turn or budget, getattr(sampling_params, "max_tokens", None) or budget]
            params.max_tokens = min(caps)
            out = (await llm_engine.generate(tokens, params)).outputs[0]
            action = list(out.token_ids)
            ranges.append((len(tokens), len(tokens) + len(action)))
            tokens += action
            if logprobs is not None:
                logprobs += [lp[t].logprob for lp, t in zip(out.logprobs, action)]
            turns += 1
            truncated = out.finish_reason == "length"
            states = {"observation_text": observation, "action_text": out.text, "label": label,
                      "sampling_params": sampling_params, "turn": turns}
            result = await self._call("step()", instance.step(states))
            reward = _number(_field(result, "rewards", None, "step()"), "rewards")
            total += reward
            scores = _number(result["scores"], "scores") if result.get("scores") is not None else total
            feedback = _field(result, "environment_feedback", str, "step()")
            done = bool(_field(result, "done", None, "step()"))
            extra = result.get("extra_logs") or {}
            if result.get("sampling_params") is not None:
                sampling_params = result["sampling_params"]
            observation = observation + out.text + feedback
            actions.append(out.text)
            if done:
                break
            if lim.max_turns and turns >= lim.max_turns:
                truncated = True  # the turn cap, not the environment, ended it
                break
            prefix = lim.feedback_prefix
            if prefix and action and prefix[0] == action[-1]:  # the model sampled the turn's stop token itself
                prefix = prefix[1:]
            fed = prefix + _encode(hf_tokenizer, feedback) + lim.feedback_suffix if feedback else []
            feedbacks.append(feedback)
            tokens += fed
            if logprobs is not None:
                logprobs += [0.0] * len(fed)
        out = {"prompt": prompt, "label": label, "observation_tokens": tokens, "action_ranges": ranges,
               "rollout_log_probs": logprobs, "reward": total, "scores": scores, "truncated": truncated,
               "extra_logs": extra, "turns": turns}
        if lim.feedback_role:  # a chat-turn episode: would its messages, re-rendered, give these ids?
            out["drift"] = drift(hf_tokenizer, lim.feedback_role, actions, feedbacks, tokens[start:])
        return out


class AgentError(Exception):
    def __init__(self, where: str, what: str):
        super().__init__(f"{where} {what}")


def _field(result, name: str, kind, where: str):
    if not isinstance(result, dict):
        raise AgentError(where, f"returned {type(result).__name__}, not a dict")
    if name not in result:
        raise AgentError(where, f"returned no '{name}' (it has: {', '.join(map(str, result)) or 'nothing'})")
    value = result[name]
    if kind is not None and not isinstance(value, kind):
        raise AgentError(where, f"returned '{name}' as {type(value).__name__}, not {kind.__name__}")
    return value


def _number(value, name: str) -> float:
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        raise AgentError("step()", f"returned '{name}' = {value!r}, not a number") from None


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _openrlhf_modules() -> dict:
    """Modules `openrlhf`, `openrlhf.utils`, `openrlhf.utils.agent` holding this module's classes."""
    top, utils = types.ModuleType("openrlhf"), types.ModuleType("openrlhf.utils")
    agent = types.ModuleType("openrlhf.utils.agent")
    for name in ("AgentExecutorBase", "AgentInstanceBase", "MultiTurnAgentExecutor"):
        setattr(agent, name, globals()[name])
    top.utils, utils.agent = utils, agent
    top.__path__, utils.__path__ = [], []
    return {"openrlhf": top, "openrlhf.utils": utils, "openrlhf.utils.agent": agent}


def load_executor(path: str):
    """The AgentExecutor of the file at `path`, instantiated as OpenRLHF does (no arguments). The file's
    `from openrlhf.utils.agent import ...` gets this module's classes, OpenRLHF installed or not: the run's
    episodes are this module's (token in and out, turn caps, timeouts)."""
    if not path.endswith(".py") or not os.path.isfile(path):
        raise UserError(f"--agent_func_path {path}: not a Python file")
    spec = importlib.util.spec_from_file_location("hybridrl_agent", path)
    module = importlib.util.module_from_spec(spec)
    ours = _openrlhf_modules()
    saved = {k: sys.modules.get(k) for k in ours}
    sys.modules.update(ours)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise UserError(f"--agent_func_path {path}: importing it failed: {one_line(e)}") from None
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    cls = getattr(module, "AgentExecutor", None)
    if not isinstance(cls, type):
        raise UserError(f"--agent_func_path {path}: it must define `AgentExecutor`, a subclass of "
                        "AgentExecutorBase or MultiTurnAgentExecutor (from openrlhf.utils.agent)")
    if not issubclass(cls, AgentExecutorBase):
        raise UserError(f"--agent_func_path {path}: its AgentExecutor must be a subclass of AgentExecutorBase or "
                        "MultiTurnAgentExecutor (from openrlhf.utils.agent)")
    try:
        return cls()
    except Exception as e:
        raise UserError(f"--agent_func_path {path}: AgentExecutor() failed: {one_line(e)}") from None


_ANSWER, _FEEDBACK, _PROMPT = "\x01ANSWER\x01", "\x01FEEDBACK\x01", "\x01PROMPT\x01"


def role_tokens(tokenizer, role: str) -> tuple[list[int], list[int]]:
    """What the tokenizer's chat template puts between an assistant's answer and a `role` message's text
    (its stop token included: the run drops it when the model sampled it), and after that text up to the
    assistant's next opening: (prefix, suffix) ids, so plain feedback text becomes a whole turn."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ANSWER},
            {"role": role, "content": _FEEDBACK}]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception as e:
        raise UserError(f"--agent_feedback_role {role}: the tokenizer's chat template cannot render it "
                        f"({one_line(e)})") from None
    if _ANSWER not in text or _FEEDBACK not in text:
        raise UserError(f"--agent_feedback_role {role}: the tokenizer's chat template drops an earlier turn's "
                        "answer when a message is added, so feedback cannot be a turn of its own; drop the flag")
    head = text[text.index(_ANSWER) + len(_ANSWER):text.index(_FEEDBACK)]
    tail = text[text.index(_FEEDBACK) + len(_FEEDBACK):]
    return _encode(tokenizer, head), _encode(tokenizer, tail)


def drift(tokenizer, role: str, actions: list[str], feedbacks: list[str], response: list[int]) -> bool:
    """Whether `response` (the episode's ids after the prompt) differs from the chat template applied to its
    messages, re-tokenised: what a trainer that rebuilds histories from text would train on instead."""
    msgs = [{"role": "user", "content": _PROMPT}]
    for i, a in enumerate(actions):
        msgs.append({"role": "assistant", "content": a})
        if i < len(feedbacks):
            msgs.append({"role": role, "content": feedbacks[i]})
    start = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=len(feedbacks) >= len(actions))
    if not whole.startswith(start):
        return True
    ids = _encode(tokenizer, whole[len(start):])
    # the template closes the last turn with text the model does not sample (Qwen's newline after <|im_end|>)
    return ids[:len(response)] != response or tokenizer.decode(ids[len(response):]).strip() != ""


# ---------------------------------------------------------------- the engines, shared by every episode
@dataclass
class SamplingParams:
    """What an agent file reads and sets of vLLM's SamplingParams (max_tokens, temperature, ...)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    logprobs: int | None = None
    n: int = 1


class _EngineClient:
    """`llm_engine` as an agent file sees it: `await llm_engine.generate(token_ids, sampling_params)`."""

    def __init__(self, batcher: TurnBatcher, slot: int, seed: int, prompt_ids: dict):
        self.batcher, self.slot, self.seed, self.turn, self.prompt_ids = batcher, slot, seed, 0, prompt_ids
        self.versions: list[int] = []  # the policy version that sampled each of its turns

    async def generate(self, token_ids, sampling_params, multi_modal_data=None, **kwargs):
        if multi_modal_data:
            raise AgentError("llm_engine.generate", "got images: multimodal agents are not supported here")
        self.turn += 1  # one seed per episode and turn: the rollout repeats whatever the batches were
        fut = self.batcher.request(self.slot, list(token_ids), sampling_params, self.seed + 7919 * self.turn)
        result = await asyncio.wrap_future(fut)
        self.versions.append(result.version)
        return result


def turn_versions(ranges: list, start: int, length: int, versions: list[int]) -> list[int] | None:
    """One policy version per response token of an episode: a turn's tokens (`ranges`: [a, b) in the
    whole sequence, the response starting at `start`, `length` tokens in all) carry the version that
    sampled that turn (`versions`, one per engine call, in order); the environment's tokens after a turn
    carry that turn's. None when the calls and the turns do not pair up (an executor that calls the
    engine more or less often than it records actions)."""
    if not versions or len(versions) != len(ranges):
        return None
    out, pos, v = [], start, versions[0]
    for (a, b), ver in zip(ranges, versions):
        out += [v] * (a - pos) + [ver] * (b - a)
        pos, v = b, ver
    return out + [v] * (start + length - pos)


def run_episodes(executor, path: str, prompts: list, labels: list, engines: list, tokenizer, *, n: int,
                 temperature: float, top_p: float, max_length: int, seed: int, logprobs: bool,
                 limits: Limits, window_s: float = 0.02, timeout_s: float = 1800, per_token_versions: bool = False):
    """`n` episodes per prompt (prompts: the rendered texts, with their ids in `prompt_ids`), all at once.
    Returns Samples (response_mask: 1 on the model's tokens) with extra["agent"]: rewards, scores, turns.
    With `per_token_versions` (--partial_rollout: a weight sync may land between two turns, each turn
    being one engine call), also `token_versions`, each token tagged with the weights of its turn."""
    from common.rollout.samples import Samples

    if isinstance(executor, MultiTurnAgentExecutor) or hasattr(executor, "limits"):
        executor.limits = limits
    jobs = [(i, j) for i in range(len(prompts)) for j in range(n)]
    batcher = TurnBatcher(engines, tokenizer, len(jobs), window_s, timeout_s)
    known = {p.prompt_text: p.prompt_ids for p in prompts}
    t0 = time.perf_counter()

    def one(k: int):
        i, _ = jobs[k]
        client = _EngineClient(batcher, k, seed + 104_729 * k, known)
        params = SamplingParams(temperature=temperature, top_p=top_p, logprobs=0 if logprobs else None)
        try:
            out = asyncio.run(executor.execute(prompts[i].prompt_text, labels[i], params, max_length, tokenizer, client))
        finally:
            batcher.finished(k)
        return out, client.versions

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        futures = [pool.submit(one, k) for k in range(len(jobs))]
        results = []
        for k, f in enumerate(futures):
            try:
                results.append(f.result())
            except AgentError as e:
                raise UserError(f"--agent_func_path {path}: episode {k} (prompt {jobs[k][0]}): {e}") from None
            except (UserError, TrainingError):
                raise
            except Exception as e:
                raise UserError(f"--agent_func_path {path}: episode {k} (prompt {jobs[k][0]}) raised "
                                f"{one_line(e)}") from None
    s = Samples([], [], [], [], [] if logprobs else None, extra={}, versions=[], response_mask=[],
                token_versions=[] if per_token_versions else None)
    rewards, scores, turns, logs, drifts = [], [], [], [], []
    for k, (r, versions) in enumerate(results):
        if not isinstance(r, dict):
            raise UserError(f"--agent_func_path {path}: execute() returned {type(r).__name__}, not a dict")
        s.versions.append(min(versions) if versions else 0)  # the oldest weights that sampled any of its turns
        for name in ("observation_tokens", "action_ranges", "reward"):
            if name not in r:
                raise UserError(f"--agent_func_path {path}: execute() returned no '{name}'")
        tokens, ranges = list(r["observation_tokens"]), list(r["action_ranges"])
        start = ranges[0][0] if ranges else len(tokens)
        mask = [0] * (len(tokens) - start)
        for a, b in ranges:
            mask[a - start:b - start] = [1] * (b - a)
        if per_token_versions:
            tv = turn_versions(ranges, start, len(tokens) - start, versions)
            s.token_versions.append(tv if tv is not None else [s.versions[-1]] * (len(tokens) - start))
        s.prompt_ids.append(tokens[:start])
        s.response_ids.append(tokens[start:])
        s.response_mask.append(mask)
        s.prompt_index.append(jobs[k][0])
        s.truncated.append(bool(r.get("truncated")))
        lp = r.get("rollout_log_probs")
        if s.logprobs is not None and lp is not None and len(lp) == len(tokens):
            s.logprobs.append([x if m else 0.0 for x, m in zip(lp[start:], mask)])
        else:  # an executor that keeps no log-probs: the trainer then computes them all itself
            s.logprobs = None
        rewards.append(_number(r["reward"], "reward"))
        scores.append(_number(r["scores"], "scores") if r.get("scores") is not None else rewards[-1])
        turns.append(r.get("turns", len(ranges)))
        drifts.append(r.get("drift"))
        logs.append(r.get("extra_logs") or {})
    s.extra = {"agent_s": time.perf_counter() - t0, "agent_batches": float(batcher.batches)}
    s.agent = {"rewards": rewards, "scores": scores, "turns": turns, "extra_logs": logs, "drift": drifts}
    return s
