"""examples/agent_copy_openrlhf.py with every environment step taking AGENT_STEP_LATENCY_S seconds (default
0.05) of waiting, as a remote tool or sandbox would: for the GPU figure of how much of that latency the
concurrent episodes hide behind generation (`bash dev/gpu_runs.sh agents_05b`).
"""
import asyncio
import importlib.util
import os

from openrlhf.utils.agent import MultiTurnAgentExecutor

_spec = importlib.util.spec_from_file_location(
    "agent_copy_openrlhf", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agent_copy_openrlhf.py"))
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
LATENCY_S = float(os.environ.get("AGENT_STEP_LATENCY_S", "0.05"))


class AgentInstance(_example.AgentInstance):
    async def step(self, states: dict, **kwargs):
        await asyncio.sleep(LATENCY_S)  # the environment's round trip: the episode waits, the others go on
        return await super().step(states, **kwargs)


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
