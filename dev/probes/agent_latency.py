"""examples/agent_copy_openrlhf.py with every environment step taking AGENT_STEP_LATENCY_S seconds (default
0.05) of waiting, as a remote tool or sandbox would, and turns of different lengths (each step sets the next
turn's max_tokens, drawn from 32-192 per episode and turn, as a tool answer of varying size would): for the
GPU figure of how much of that latency the concurrent episodes hide behind generation
(`bash dev/gpu_runs.sh agents_05b`). A random-weight model never stops on its own, so without the drawn caps
every episode's turns would end at the same decode step and there would be nothing to overlap.
AGENT_TURN_CAPS=off leaves every turn at --max_tokens_per_turn: the work of code that ignores an
environment's max_tokens (before 2026-12-06), for an equal-work comparison with it.
"""
import asyncio
import copy
import importlib.util
import itertools
import os
import random

from openrlhf.utils.agent import MultiTurnAgentExecutor

_spec = importlib.util.spec_from_file_location(
    "agent_copy_openrlhf", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agent_copy_openrlhf.py"))
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
LATENCY_S = float(os.environ.get("AGENT_STEP_LATENCY_S", "0.05"))
CAPS = os.environ.get("AGENT_TURN_CAPS", "32-192")
_EPISODES = itertools.count()  # the n-th episode of the run draws the same caps in every run


class AgentInstance(_example.AgentInstance):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rng = random.Random(next(_EPISODES))

    async def step(self, states: dict, **kwargs):
        await asyncio.sleep(LATENCY_S)  # the environment's round trip: the episode waits, the others go on
        out = await super().step(states, **kwargs)
        if CAPS == "off":
            return out
        params = copy.copy(states["sampling_params"])
        params.max_tokens = self.rng.randint(*map(int, CAPS.split("-")))
        return dict(out, sampling_params=params)


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
