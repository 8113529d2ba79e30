"""A multi-turn agent written as one plain loop: an AgentExecutor with its own `execute` (OpenRLHF's lower-level
contract), here the copy task with one retry. It keeps the token ids the engine sampled as they are and
appends the feedback's ids once, so the trainer sees exactly the sequence the engine saw.

    python train_grpo.py --agent_func_path examples/agent_copy_plain.py --vllm_num_engines 1
"""
from openrlhf.utils.agent import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        tokens = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ranges, logprobs, reward, truncated = [], [0.0] * len(tokens), 0.0, False
        for worth in (1.0, 0.5):  # a right first answer is worth 1, a right retry 0.5
            sampling_params.max_tokens = max_length - len(tokens)
            if sampling_params.max_tokens <= 0:
                truncated = True
                break
            out = (await llm_engine.generate(tokens, sampling_params)).outputs[0]
            ranges.append((len(tokens), len(tokens) + len(out.token_ids)))
            tokens += list(out.token_ids)
            logprobs += [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
            truncated = out.finish_reason == "length"
            if out.text.strip() == (label or "").strip():
                reward = worth
                break
            feedback = hf_tokenizer(f"\nWrong. Repeat: {label}\n", add_special_tokens=False)["input_ids"]
            tokens += feedback
            logprobs += [0.0] * len(feedback)
        return {"observation_tokens": tokens, "action_ranges": ranges, "rollout_log_probs": logprobs,
                "reward": reward, "scores": reward, "truncated": truncated, "extra_logs": {}, "turns": len(ranges)}
