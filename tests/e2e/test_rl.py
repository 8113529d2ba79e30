"""PPO and GRPO end to end on CPU: a real Ray cluster (started once, jobs connect to it as with
`ray job submit`), real DeepSpeed workers, rewards from the built-in rule, a function file, an HTTP
server and a reward model; learning curves, resume, colocation, dry runs, and bad input."""
from __future__ import annotations

import ast
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers import metrics, script


def _fifths(rows, key="rollout/reward_mean"):
    vals = [r[key] for r in rows if r.get(key) is not None]
    k = max(1, len(vals) // 5)
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    """{script: save_path} of the built-in default (12 steps) with a checkpoint at step 6, run once per script
    for the learning-curve test and as the uninterrupted run that the resume test repeats from step 6."""
    runs = {}

    def get(name):
        if name not in runs:
            out = str(tmp_path_factory.mktemp(name.removesuffix(".py")) / "run")
            p = script(name, "--save_path", out, *DEFAULT_FLAGS)
            runs[name] = (out, p)
        return runs[name]
    return get


DEFAULT_FLAGS = ["--max_steps", "12", "--eval_steps", "6", "--save_steps", "6", "--save_hf_ckpt"]


@pytest.mark.parametrize("name", ["train_grpo.py", "train_ppo.py"])
def test_builtin_default_reward_rises(ray_head, default_runs, name):
    out, p = default_runs(name)
    assert "positions" not in p.stdout + p.stderr  # short prompts on a 512-position model: nothing to warn of
    rows = metrics(out)
    # every --eval_steps from step 0, the starting policy: a row of its own, the eval keys only
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/reward_mean" in r]
    assert [s for s, _ in evals] == [0, 6, 12] and all(k.startswith("eval/") for k in rows[0] if "/" in k), rows[0]
    # only an exact copy passes (--eval_correct_threshold 1.0), so pass@1 starts far from its ceiling and
    # the improvement shows; the best checkpoint is the highest pass@1, the later step on a tie
    assert evals[0][1] < 0.5 and evals[-1][1] > evals[0][1], evals
    from common.training.checkpoint import latest_checkpoint

    best = max((v, s) for s, v in evals[1:])[1]
    assert latest_checkpoint(os.path.join(out, "checkpoints", "best", "actor")).endswith(f"step{best:08d}"), evals
    assert f"best eval/pass@1 {max(v for _, v in evals):.4f} at step {best}:" in p.stdout
    rows = rows[1:]
    first, last = _fifths(rows)
    assert last - first >= 0.2, (first, last)
    for key in ("rollout/response_len_mean", "train/policy_loss", "train/kl", "train/clip_frac", "train/entropy",
                "time/generate_s", "time/train_s", "time/step_s", "perf/tokens_per_s"):
        assert key in rows[-1], key
    if name == "train_ppo.py":
        assert "train/value_loss" in rows[-1]
    else:  # groups of n samples: the share whose rewards all tie (they get advantage 0)
        assert all(0.0 <= r["rollout/tied_group_frac"] <= 1.0 for r in rows)
    assert os.path.exists(os.path.join(out, "curves.png"))
    # --save_hf_ckpt: each checkpoint also holds a Hugging Face copy of the policy
    assert os.path.exists(os.path.join(out, "checkpoints", "actor", "step00000006", "actor", "hf", "config.json"))
    # the run's last lines say where its files went
    for line in (f"metrics: {out}/metrics.jsonl", f"curves: {out}/curves.png", f"policy: {out}"):
        assert line in p.stdout.splitlines(), (line, p.stdout[-2000:])
    _check_samples(p.stdout)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def _check_samples(stdout: str) -> None:
    """Each `sample:` line shows the end of its prompt in whole tokens: the last ones whose text fits 60
    characters, `…` in front when cut (a cut of the text gave `'tart|>user\\n...'`, half of `<|im_start|>`)."""
    from common.training.models import load_tokenizer
    from common.data.prompts import encode, render_chat, user_turn
    from common.data.tasks import user_text
    from common.training.tiny import tiny_model_path

    tok = load_tokenizer(tiny_model_path())
    shown = re.findall(r"^sample: (…?)('(?:[^'\\]|\\.)*') -> ", stdout, re.M)
    assert len(shown) == 2, stdout[-3000:]  # steps 1 and 11
    for cut, text in shown:
        text = ast.literal_eval(text)
        words = re.search(r"Repeat: ([a-z ]+)<\|im_end\|>", text).group(1).split()
        ids = encode(tok, render_chat(tok, user_turn(user_text(words)), True, "the built-in task"))
        tails = [tok.decode(ids[-k:]) for k in range(1, len(ids) + 1)]
        fits = [t for t in tails if len(t) <= 60]
        assert (cut, text) == ("…" if len(fits) < len(tails) else "", fits[-1]), (cut, text, tails)


@pytest.mark.parametrize("name", ["train_grpo.py", "train_ppo.py"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, ray_head, default_runs, name):
    """From the default run's step-6 checkpoint (weights, optimizer, schedule, data position, RNG, the
    adaptive KL and the best-checkpoint state), steps 7-12 train exactly as they did uninterrupted."""
    full, _ = default_runs(name)
    resumed = str(tmp_path / "resumed")
    script(name, "--save_path", resumed, "--ckpt_path", os.path.join(full, "checkpoints"), "--load_checkpoint",
           *DEFAULT_FLAGS)
    keep = lambda rows: [{k: v for k, v in r.items() if k.startswith(("rollout/", "train/"))} for r in rows]  # noqa: E731
    a, b = keep(metrics(full)), keep(metrics(resumed))
    assert [r["step"] for r in metrics(resumed)] == list(range(7, 13))  # no step-0 evaluation when resumed
    assert a[7:] == b  # a[0] is step 0's evaluation


# Three more variants ride on runs below, one script start each fewer: GRPO with RLOO, OpenRLHF's reward
# shaping and adaptive KL on the --skip_bad_rewards run (GRPO_VARIANT), PPO with group_norm, k2 and the
# static cache on the HTTP reward server's run (PPO_VARIANT), PPO with packing, asymmetric and dual clips,
# two epochs and a frozen first actor step on both reward-model runs (PPO_RM_VARIANT); _check_variant
# asserts what each flag shows.
@pytest.mark.parametrize("name,flags", [
    # also fp32 weights with a bf16 forward, compiled transformer blocks, and each prompt run once for
    # its samples (their responses on its key/value cache)
    ("train_grpo.py", ["--advantage_estimator", "reinforce", "--n_samples_per_prompt", "2", "--init_kl_coef", "0",
                       "--train_batch_size", "16", "--micro_train_batch_size", "8",
                       "--dynamic_filtering", "--loss_agg_mode", "seq_mean_token_mean", "--policy_loss_type", "gspo",
                       "--bf16", "--torch_autocast", "--torch_compile", "--share_prompt_prefix"]),
])
def test_variants_run(tmp_path, ray_head, name, flags):
    out = str(tmp_path / "run")
    script(name, "--save_path", out, "--max_steps", "2", "--eval_steps", "-1", *SMALL[name], *flags)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    _check_variant(name, flags, rows)


# RLOO with OpenRLHF's reward shaping (DAPO's overlong and ProRL's stop-properly penalties) and adaptive KL
GRPO_VARIANT = ["--colocate_actor_ref", "--advantage_estimator", "rloo", "--use_kl_loss", "--packing_samples",
                "--skip_nonfinite_updates", "--overlong_buffer_len", "4", "--stop_properly_penalty_coef", "0.5",
                "--kl_target", "0.05", "--reward_clip_range", "-0.5", "0.5"]
# packed samples, asymmetric and dual clips, two epochs per rollout, the critic alone at step 1
# (--colocate_all_models, which this variant had, runs in both reference commands below)
PPO_RM_VARIANT = ["--packing_samples", "--eps_clip_low_high", "0.2", "0.28", "--dual_clip", "3", "--max_epochs", "2",
                  "--skip_nonfinite_updates", "--freezing_actor_steps", "1", "--save_value_network"]
# group_norm and k2 with the policy's own decoding on a preallocated cache (common.rollout.decode)
PPO_VARIANT = ["--advantage_estimator", "group_norm", "--kl_estimator", "k2", "--no_advantage_std_norm",
               "--n_samples_per_prompt", "4", "--static_kv_cache"]


def _check_variant(name: str, flags: list[str], rows: list[dict]) -> None:
    """What a variant's flags show in its two steps' metrics."""
    if "--init_kl_coef" in flags:  # no reference model at all
        assert rows[-1]["train/kl"] == 0.0
    if "--freezing_actor_steps" in flags:  # only the critic trains at step 1
        assert "train/policy_loss" not in rows[0] and "train/value_loss" in rows[0] and "train/policy_loss" in rows[1]
    if "--kl_target" in flags:  # the adaptive coefficient moves
        assert rows[1]["train/kl_coef"] != rows[0]["train/kl_coef"]
    if "--overlong_buffer_len" in flags:
        assert "rollout/overlong_frac" in rows[0] and "rollout/stop_penalized_frac" in rows[0]
    if "--dynamic_filtering" in flags:  # groups whose samples all tie are counted as dropped
        assert all("rollout/filtered_groups" in r for r in rows)
    if "--skip_nonfinite_updates" in flags:  # a healthy run skips nothing
        assert [r["train/skipped_updates"] for r in rows] == [0, 0]
        if name == "train_ppo.py":
            assert [r["train/critic_skipped_updates"] for r in rows] == [0, 0]


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory):
    from common.data.tasks import prompt_rows

    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(path, "w") as f:
        for r in prompt_rows(64, "train", seed=9):
            f.write(json.dumps({"question": r["prompt"][0]["content"], "answer": r["label"]}) + "\n")
    return str(path)


# A small step: 8 prompts x 8 samples for GRPO; 16 prompts x 1 sample for PPO with GAE.
SMALL = {"train_grpo.py": ["--rollout_batch_size", "8"],
         "train_ppo.py": ["--rollout_batch_size", "16", "--train_batch_size", "16", "--micro_train_batch_size", "8"]}


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    """A tiny reward model trained for a few steps, shared by the tests that need one to load and score."""
    rm = str(tmp_path_factory.mktemp("rm") / "rm")
    script("train_rm.py", "--save_path", rm, "--max_steps", "20", "--eval_steps", "-1")
    return rm


def _prompt_flags(prompt_file, name="train_grpo.py"):
    return ["--prompt_data", prompt_file, "--input_key", "question", "--label_key", "answer",
            "--apply_chat_template", "--max_steps", "2", "--eval_steps", "-1", *SMALL[name]]


def test_reward_function_file_and_evaluation_on_the_users_data(tmp_path, ray_head, prompt_file):
    """A reward function file, --eval_dataset of the user's own prompts, --eval_steps -1 (at the end of each
    pass over the prompts, and at the last step), and pass@k from the function's own "pass" verdicts."""
    from common.data.tasks import prompt_rows

    fn, held_out, out = tmp_path / "reward.py", tmp_path / "held_out.jsonl", str(tmp_path / "run")
    fn.write_text("from common.data.tasks import reward_func as copy\n\n\n"
                  "def reward_func(prompts, completions, labels):\n"
                  "    r = copy(prompts, completions, labels)\n"
                  "    return {'rewards': r, 'pass': [x == 1.0 for x in r]}  # only an exact copy passes\n")
    held_out.write_text("".join(json.dumps({"question": r["prompt"][0]["content"], "answer": r["label"]}) + "\n"
                                for r in prompt_rows(8, "eval", seed=2)))
    flags = _prompt_flags(prompt_file)
    flags[flags.index("--max_steps") + 1] = "3"
    script("train_grpo.py", "--save_path", out, "--reward_func", str(fn), *flags, "--max_samples", "16",
           "--num_episodes", "2", "--eval_dataset", str(held_out), "--eval_n_samples_per_prompt", "4")
    rows = metrics(out)
    assert 0.1 < rows[0]["rollout/reward_mean"] < 0.9
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [2, 3]  # 16 prompts / 8 per step: a pass ends at step 2; 3 is the last
    for r in evals:
        assert 0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= r["eval/pass@4"] <= 1
        # an exact copy scores 1 and partial copies less: the exact-copy rate is at most the mean reward
        # (with "reward > 0 passes" it would be far above it)
        assert r["eval/pass@1"] <= r["eval/reward_mean"] + 1e-9


class _CopyScorer(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls += 1
        from common.data.tasks import reward_func

        out = json.dumps({"rewards": reward_func(body["prompts"], body["completions"], body["labels"])}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_http_reward_server(tmp_path, ray_head, prompt_file):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CopyScorer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = str(tmp_path / "run")
        script("train_ppo.py", "--save_path", out, "--remote_rm_url", f"http://127.0.0.1:{server.server_port}/score",
               *PPO_VARIANT, *_prompt_flags(prompt_file, "train_ppo.py"))
        assert _CopyScorer.calls >= 2
        rows = metrics(out)
        assert 0.1 < rows[0]["rollout/reward_mean"] < 0.9 and [r["step"] for r in rows] == [1, 2]
        _check_variant("train_ppo.py", PPO_VARIANT, rows)
    finally:
        server.shutdown()


def test_reward_model_path_and_frozen_models_in_the_trained_processes(tmp_path, ray_head, prompt_file, tiny_rm):
    """PPO with a reward model (a tiny RM trained for a few steps) and the critic initialised from it. Colocated,
    the reference loads into the actor's processes and the reward model into the critic's (common.rl.guests):
    the run equals the one with a process per role, number for number."""
    flags = ["--reward_pretrain", tiny_rm, "--colocate_critic_reward", "--colocate_actor_ref", *PPO_RM_VARIANT,
             *_prompt_flags(prompt_file, "train_ppo.py")]
    shared, apart = str(tmp_path / "shared"), str(tmp_path / "apart")
    p = script("train_ppo.py", "--save_path", shared, *flags)
    assert "the reference in the actor's, the reward model in the critic's processes" in p.stdout, p.stdout[-3000:]
    p = script("train_ppo.py", "--save_path", apart, *flags, extra_env={"HYBRIDRL_SHARE_PROCESS": "0"})
    assert "the reference in the actor's" not in p.stdout
    keep = lambda rows: [{k: v for k, v in r.items() if k.startswith(("rollout/", "train/"))} for r in rows]  # noqa: E731
    a, b = keep(metrics(shared)), keep(metrics(apart))
    assert len(a) == 2 and "train/value_loss" in a[-1] and "train/kl" in a[-1]
    assert a == b
    _check_variant("train_ppo.py", PPO_RM_VARIANT, metrics(shared))
    assert os.path.exists(os.path.join(shared + "_critic", "config.json"))  # OpenRLHF's folder for the critic


def test_skip_bad_rewards_drops_samples_goes_on_and_an_unmappable_reply_stops_the_run(tmp_path, ray_head, prompt_file):
    """--skip_bad_rewards drops a sample whose score is NaN (its whole group) and goes on; a reply no score of
    which can be mapped to a sample (a wrong count, at step 3) still ends the run, with exit code 2 and one
    message naming the file and the prompt. (Merged: a function that raises, without the flag, ends the run
    the same way; its message and the other bad replies' (a non-number, a hang) come from the same check,
    common.rl.rewards.score_with_function, whose messages tests/unit/test_rewards.py reads.)"""
    fn = tmp_path / "flaky.py"
    fn.write_text("calls = 0\n\n\n"
                  "def reward_func(prompts, completions, labels):\n"
                  "    global calls\n"
                  "    calls += 1\n"
                  "    scores = [float('nan') if i == 3 else 0.2 * (i % 3) for i in range(len(completions))]\n"
                  "    return scores[:-1] if calls == 3 else scores\n")
    out = str(tmp_path / "run")
    flags = _prompt_flags(prompt_file)
    flags[flags.index("--max_steps") + 1] = "3"
    p = script("train_grpo.py", "--save_path", out, "--reward_func", str(fn), "--skip_bad_rewards", *GRPO_VARIANT,
               *flags, check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"--reward_func {fn} returned 63 scores for 64 completions" in p.stderr, p.stderr[-3000:]
    assert "Repeat:" in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    rows = metrics(out)
    # the NaN sample's whole group (8 samples) is left out of each update; the other 7 groups train
    assert [r["step"] for r in rows] == [1, 2] and [r["rollout/skipped_rewards"] for r in rows] == [1, 1], rows
    assert "train/policy_loss" in rows[0]
    _check_variant("train_grpo.py", GRPO_VARIANT, rows)


REFERENCE_PPO = """--ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
  --critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
  --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5
  --pretrain {model} --reward_pretrain {rm} --save_path {out} --micro_train_batch_size 8 --train_batch_size 128
  --micro_rollout_batch_size 16 --rollout_batch_size 1024 --max_epochs 1 --prompt_max_len 1024
  --generate_max_len 1024 --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6
  --init_kl_coef 0.01 --normalize_reward --gradient_checkpointing --packing_samples
  --vllm_enable_sleep --deepspeed_enable_sleep"""
REFERENCE_GRPO = """--advantage_estimator group_norm --ref_num_nodes 1 --ref_num_gpus_per_node 8
  --reward_num_nodes 1 --reward_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
  --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --pretrain {model}
  --reward_pretrain {rm} --save_path {out} --micro_train_batch_size 8 --train_batch_size 128
  --micro_rollout_batch_size 16 --rollout_batch_size 1024 --max_epochs 1 --bf16 --actor_learning_rate 5e-7
  --init_kl_coef 0.01 --use_kl_loss --kl_estimator k3 --normalize_reward --no_advantage_std_norm"""


@pytest.mark.parametrize("name,flags", [("train_ppo.py", REFERENCE_PPO), ("train_ppo.py", REFERENCE_GRPO),
                                        ("train_grpo.py", REFERENCE_GRPO)])
def test_reference_commands_dry_run_print_the_plan(tmp_path, name, flags):
    from common.training.tiny import tiny_model_path

    model = tiny_model_path()
    args = flags.format(model=model, rm=model, out=str(tmp_path / "out")).split()
    p = script(name, *args, "--dry_run")
    out = p.stdout
    assert "resource plan" in out and "4 engines x TP 2" in out
    for role in ("actor", "ref", "reward") + (("critic",) if "critic_num_nodes" in flags else ()):
        assert f"\n  {role} " in out
    assert "total: 8 GPUs" in out
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


# The refusals decided before training starts run in-process (tests/unit/test_flags.py); these two are
# decided once the run starts (the model folder, the GPUs the sync needs), so they run as the user would.
@pytest.mark.parametrize("flags,expect", [
    (["--pretrain", "./no/such/model"], "no such folder"),
    (["--vllm_num_engines", "1", "--vllm_sync_backend", "nccl"], "--vllm_sync_backend nccl needs GPUs"),
])
def test_flag_contradictions(tmp_path, flags, expect):
    p = script("train_ppo.py", "--save_path", str(tmp_path), *flags, check=False)
    assert p.returncode == 2 and expect in p.stderr, p.stderr[-2000:]


def _on_cpu(flags: str, workers: int, tp: int) -> list[str]:
    """The reference command with `workers` CPU workers per role and one engine of `tp` workers
    (8 GPUs per role and 4 engines x TP 2 do not fit two cores)."""
    args = flags.replace("_num_gpus_per_node 8", f"_num_gpus_per_node {workers}").replace(
        "--vllm_num_engines 4 --vllm_tensor_parallel_size 2", f"--vllm_num_engines 1 --vllm_tensor_parallel_size {tp}")
    return args.split()


@pytest.mark.parametrize("name,flags,workers,tp,small", [
    # the reference's hybrid layout kept: the tensor-parallel engine's two workers share the bundles
    # of two ranks of every role (--colocate_all_models)
    ("train_grpo.py", REFERENCE_GRPO, 2, 2, ["--rollout_batch_size", "8", "--train_batch_size", "64", "--enforce_eager"]),
    # vLLM-CPU cannot sleep, so on CPU the hybrid engine's two sleep flags are dropped (test_vllm.py
    # checks that they are refused with that advice). --enforce_eager on both: a compiled engine's start is
    # 15 s (cached) to 31 s (first) on this CPU against 0.4 s, and test_vllm.py's two-engine run compiles
    ("train_ppo.py", REFERENCE_PPO.replace("--vllm_enable_sleep --deepspeed_enable_sleep", ""), 1, 1,
     ["--rollout_batch_size", "8", "--train_batch_size", "8", "--enforce_eager"]),
])
def test_reference_commands_train_on_cpu(tmp_path, ray_head, name, flags, workers, tp, small, tiny_rm):
    from common.training.tiny import tiny_model_path

    out = str(tmp_path / "out")
    args = _on_cpu(flags.format(model=tiny_model_path(), rm=tiny_rm, out=out), workers, tp)
    script(name, *args, "--max_steps", "2", "--eval_steps", "-1", *small)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    # bf16 on both sides (fp32 where the CPU has no bf16): a worker holding a wrong shard differs by
    # nats, not thousandths (that each sync reaches every worker is tested in test_vllm.py)
    # the engines' log-probs come every --logprob_diff_steps (default 10) steps, from the first
    diffs = [r["rollout/logprob_diff"] for r in rows[:1]]
    assert "rollout/logprob_diff" not in rows[1], rows[1]
    print(f"{name}: rollout/logprob_diff {diffs}")
    assert max(diffs) < 0.05, diffs
