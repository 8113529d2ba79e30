"""Rollouts: samples as token ids, their padded batch form, and generation by the policy itself.

Token ids stay token ids end to end; text is decoded once, only for rewards that need it.
Every rollout backend (the policy's own `generate`, vLLM engines) returns the same `Samples`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Samples:
    """N generated samples; sample i answers prompt `prompt_index[i]`."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    prompt_index: list[int]
    truncated: list[bool]                      # hit the length limit before eos
    logprobs: list[list[float]] | None = None  # the generator's log-prob of each response token, if known
    extra: dict = field(default_factory=dict)
    # the policy version (training steps done) whose weights generated each sample (common.rollout.queue);
    # with --partial_rollout the oldest of its tokens' versions (token_versions: one per response token)
    versions: list[int] | None = None
    token_versions: list[list[int]] | None = None
    # multi-turn agents (common.rl.agent): 1 on the model's response tokens, 0 on the environment's
    # (masked out of the loss, no log-prob, not counted as length); None: every response token is the model's
    response_mask: list[list[int]] | None = None
    agent: dict | None = None  # per-sample lists from the environment: rewards, scores, turns, extra_logs

    def __len__(self) -> int:
        return len(self.response_ids)

    def model_tokens(self) -> list[int]:
        """Each sample's count of tokens the model generated (the environment's excluded)."""
        if self.response_mask is None:
            return [len(r) for r in self.response_ids]
        return [sum(m) for m in self.response_mask]

    def select(self, keep: list[int]) -> "Samples":
        def pick(values):
            return None if values is None else [values[i] for i in keep]

        agent = None if self.agent is None else {k: pick(v) for k, v in self.agent.items()}
        return Samples(pick(self.prompt_ids), pick(self.response_ids), pick(self.prompt_index), pick(self.truncated),
                       pick(self.logprobs), versions=pick(self.versions), token_versions=pick(self.token_versions),
                       response_mask=pick(self.response_mask), agent=agent)


def merge_shards(parts: list[tuple[int, Samples]]) -> Samples:
    """One Samples from the engines' shards, in order; (first prompt's index, shard) each. A list field
    stays only if every shard has it; in `extra` (seconds) the slowest shard counts: engines run at once."""
    out = Samples([], [], [], [], [], extra={}, versions=[], token_versions=[])
    for offset, part in parts:
        for key, v in part.extra.items():
            out.extra[key] = max(out.extra.get(key, 0.0), v)
        out.prompt_ids += part.prompt_ids
        out.response_ids += part.response_ids
        out.prompt_index += [offset + j for j in part.prompt_index]
        out.truncated += part.truncated
        for name in ("logprobs", "versions", "token_versions"):
            mine, theirs = getattr(out, name), getattr(part, name)
            setattr(out, name, None if mine is None or theirs is None else mine + theirs)
    return out


def make_batch(samples: Samples, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response rows.

    input_ids, attention_mask: [N, T]; action_mask: [N, T-1], 1 where input_ids[:, 1:] is a response
    token (aligned with log-probs of logits[:, :-1]); gen_logprobs: [N, T-1] when the generator gave them.
    """
    # Built from flat lists with masks (no per-row tensor writes): 64 rows of ~270 tokens took 4.8 ms
    # row by row on the 2-core box, twice per step.
    plen = torch.tensor([len(p) for p in samples.prompt_ids])
    lens = plen + torch.tensor([len(r) for r in samples.response_ids])
    N, T = len(lens), int(lens.max())
    cols = torch.arange(T)
    attn = (cols[None, :] < lens[:, None]).long()
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    flat: list[int] = []
    for p, r in zip(samples.prompt_ids, samples.response_ids):
        flat.extend(p)
        flat.extend(r)
    ids[attn.bool()] = torch.tensor(flat, dtype=torch.long)
    acts = (cols[None, :-1] >= plen[:, None] - 1) & (cols[None, :-1] < lens[:, None] - 1)
    action = acts.float()
    if samples.response_mask is not None:  # an agent's environment tokens: no loss, no advantage, no KL
        flat_mask: list[int] = []
        for m in samples.response_mask:
            flat_mask.extend(m)
        action[acts] = torch.tensor(flat_mask, dtype=torch.float32)
    gen_lp = None
    if samples.logprobs is not None:
        bad = [i for i, (lp, r) in enumerate(zip(samples.logprobs, samples.response_ids)) if len(lp) != len(r)]
        if bad:
            raise ValueError(f"sample {bad[0]}: {len(samples.logprobs[bad[0]])} log-probs for "
                             f"{len(samples.response_ids[bad[0]])} response tokens")
        flat_lp: list[float] = []
        for lp in samples.logprobs:
            flat_lp.extend(lp)
        gen_lp = torch.zeros((N, T - 1), dtype=torch.float32)
        gen_lp[acts] = torch.tensor(flat_lp, dtype=torch.float32)
    batch = {"input_ids": ids, "attention_mask": attn, "action_mask": action}
    if gen_lp is not None:
        batch["gen_logprobs"] = gen_lp
    return batch


def split_batch(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Split every [N, ...] tensor into `parts` equal row blocks (N must divide evenly)."""
    N = next(iter(batch.values())).shape[0]
    assert N % parts == 0, f"{N} rows do not split into {parts} equal parts"
    k = N // parts
    return [{key: v[i * k:(i + 1) * k] for key, v in batch.items()} for i in range(parts)]


def trim(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop padding columns no row of this (micro-)batch uses: [*, T] -> [*, t], [*, T-1] -> [*, t-1]."""
    T_full = batch["input_ids"].shape[1]
    T = int(batch["attention_mask"].sum(1).max())
    out = {}
    for k, v in batch.items():
        if v.dim() >= 2 and v.shape[1] == T_full:
            out[k] = v[:, :T]
        elif v.dim() >= 2 and v.shape[1] == T_full - 1:
            out[k] = v[:, : T - 1]
        else:
            out[k] = v
    return out


def generation_note(use_gpu: bool, vllm_engines: int, static_cache: bool, zero_stage: int) -> str | None:
    """A banner hint when the policy samples on GPU with transformers' default generate, which runs
    each new token from Python (a GRPO step 6x slower than with --static_kv_cache on an H200)."""
    if not use_gpu or vllm_engines or static_cache:
        return None
    faster = "--static_kv_cache (compiled decoding) or " if zero_stage < 3 else ""
    return ("the policy generates with transformers' dynamic KV cache, one Python step per token: "
            f"{faster}vLLM engines (--vllm_num_engines) make the rollout several times faster (docs/performance.md)")


def positions_note(model_path: str, longest_prompt: int, max_new_tokens: int) -> str | None:
    """A banner warning when the longest prompt plus --generate_max_len exceeds the model's
    max_position_embeddings (its config.json): those responses are cut there, silently otherwise.
    The actual prompts count, not --prompt_max_len, so a short task on a short model is not warned."""
    import json
    import os

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            positions = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    if not positions or longest_prompt + max_new_tokens <= positions:
        return None
    return (f"the longest prompt ({longest_prompt} tokens) + --generate_max_len {max_new_tokens} exceeds the model's "
            f"{positions} positions: responses are cut there; lower --generate_max_len or --prompt_max_len")


def generate_on_ranks(actor, prompt_ids: list[list[int]], sampling: dict, seed: int) -> Samples:
    """The policy samples for itself (no vLLM): prompts dealt round-robin over the actor group's
    ranks (rank r, seed + r), the answers put back in prompt order, each prompt's group together."""
    world = len(actor)
    parts = actor.call_per_rank("generate", [(prompt_ids[r::world], sampling, seed + r) for r in range(world)])
    out = Samples([], [], [], [])
    for r, part in enumerate(parts):
        out.prompt_ids += part.prompt_ids
        out.response_ids += part.response_ids
        out.prompt_index += [r + i * world for i in part.prompt_index]
        out.truncated += part.truncated
    return out.select(sorted(range(len(out)), key=lambda i: out.prompt_index[i]))

