"""A multi-turn environment in OpenRLHF's agent format (runs unchanged with OpenRLHF's --agent_func_path, or ours):
the built-in copy task with retries. The model must repeat the words of the prompt; a wrong answer gets the
words again as feedback and another try, worth less: the share of words in place, times 1.0 on the first turn,
0.5 on the second and 0.25 on the third (the episode's reward is the sum of its turns').

    python train_grpo.py --agent_func_path examples/agent_copy_openrlhf.py --vllm_num_engines 1 \\
        --agent_feedback_role user --max_turns 3
"""
import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

TURN_WORTH = (1.0, 0.5, 0.25)


def words_in_place(answer: str, label: str) -> float:
    said, want = answer.split(), label.split()
    return sum(a == b for a, b in zip(said, want)) / max(len(said), len(want), 1)


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.turn += 1
        credit = words_in_place(states["action_text"], states["label"] or "")
        done = credit == 1.0 or self.turn >= len(TURN_WORTH)
        reward = TURN_WORTH[self.turn - 1] * credit
        feedback = "" if done else f"Wrong. Repeat: {states['label']}"
        return {"rewards": torch.tensor(reward), "scores": torch.tensor(reward), "environment_feedback": feedback,
                "done": done, "sampling_params": states.get("sampling_params"),
                "extra_logs": {"solved_turn": float(self.turn if credit == 1.0 else 0)}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
