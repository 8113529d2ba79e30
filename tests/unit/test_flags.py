"""Every boolean flag of the five scripts acts, is refused, or says in the banner that it changes nothing.

No flag starts a training run. Each is flipped on the script's own command, run in-process (Typer's
CliRunner, `train` replaced by a capture of the typed options it would receive: no model, no Ray), and
one of the things the script builds from those options before training must differ:
  Refused    exit 2, one line naming the flag
  Banner     a banner note naming the flag (an OpenRLHF flag accepted here that changes nothing)
  Changes    a view: "options" (a translated option), "ds" (the DSSettings a GPU run builds; every field
             reaches common.training.ds.initialize), "attn" (attention and its note), "memory" (the memory plan's
             per-process figures, what --dry_run and the preflight show), "plan" (the resource plan),
             "specs" (the RL workers' ModelSpecs), "engine" (the vLLM EngineSpec), "prompts" (the RL
             prompts' tokens), "dry_run" (the plans printed, train() never reached)
A flag whose only effect is inside the training step names the test that asserts it (Asserted), or has
its first step's numbers computed through the real loss function (Numbers). Both name the line of
the script that hands the flag on (`wire`): a flag that stops being read fails here. Each view also names
the call in the scripts that it mirrors. Flags come from each script's `main` signature (the
OpenRLHF decorator's included): a new boolean flag fails until it is classified below; OpenRLHF's rows
marked refuse or accept (common/cli/openrlhf_table.py) are classified by that table.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import typing

import pytest
from typer.testing import CliRunner

from common.cli.openrlhf_table import EXTRA
from tests.helpers import ROOT

SCRIPTS = ["train_sft", "train_rm", "train_dpo", "train_ppo", "train_grpo"]
RL = ("train_ppo", "train_grpo")


@dataclasses.dataclass(frozen=True)
class Refused:
    context: tuple = ()


@dataclasses.dataclass(frozen=True)
class Banner:
    context: tuple = ()


@dataclasses.dataclass(frozen=True)
class Changes:
    view: str
    context: tuple = ()


@dataclasses.dataclass(frozen=True)
class Asserted:
    test: str             # tests/<file>.py::<function>
    wire: tuple | str | None = None  # "fragment" of the script, or (file, fragment)


@dataclasses.dataclass(frozen=True)
class Numbers:
    compute: str          # a function of this file: (options) -> tensor, the script's call with these options
    wire: tuple | str
    context: tuple = ()


@dataclasses.dataclass(frozen=True)
class NotAsserted:
    """Read by the script (`wire`), but no test asserts what it does yet: `run` names the existing
    end-to-end test that could, and what it would assert, at no extra run."""
    wire: tuple | str
    run: str              # tests/<file>.py::<function>: what to assert there


ENGINE = ("--vllm_num_engines", "1")
REWARD = ("--reward_pretrain", "./rm")  # only the resource plan and the specs read it: no model loads
USER_PROMPTS = ("--prompt_data", "{prompts}", "--reward_func", os.path.join(ROOT, "examples", "reward_func_copy.py"))
SKIP_TEST = "tests/test_reliability.py::test_skip_nonfinite_updates_counts_them_and_resumes_the_count"
FILTERED = "tests/test_rl.py::test_variants_run"

Q4_TEST = "tests/test_lora.py::test_4bit_is_refused_where_bitsandbytes_cannot_run"
COMMON = {
    # without --lora_rank refused at once; with it, refused off CUDA when the model loads (the test's function)
    "load_in_4bit": (Refused(), Asserted(Q4_TEST, "**quantization(lora, dist.device)")),
    "bf16": Changes("ds"),
    "torch_autocast": (Refused(), Changes("ds", ("--bf16",))),
    "torch_compile": Changes("ds"),
    "gradient_checkpointing": Changes("ds"),
    "adam_offload": Changes("ds"),
    "full_determinism": Changes("ds"),
    "overlap_comm": Changes("ds"),
    "gradient_checkpointing_use_reentrant": (Refused(), Changes("ds", ("--gradient_checkpointing",))),
}
HF_CKPT = "hf_tokenizer=tokenizer if a.save_hf_ckpt else None"
HF_COPY = ": with --save_hf_ckpt, <checkpoint>/{role}/hf/config.json exists"
RESUME = "if a.load_checkpoint else None"
FLAGS = {
    "train_sft": {
        **COMMON,
        "flash_attn": Changes("attn"),
        "use_liger_kernel": Asserted("tests/test_openrlhf_data.py::test_liger_is_said_not_used_off_gpu_or_not_installed",
                                     "if a.use_liger_kernel:"),
        "apply_chat_template": Asserted("tests/test_sft.py::test_row_layouts_give_the_same_sequence",
                                        "apply_chat_template=a.apply_chat_template"),
        "multiturn": Asserted("tests/test_sft.py::test_multiturn_trains_every_assistant_turn_and_nothing_else",
                              "multiturn=a.multiturn"),
        "pretrain_mode": Asserted("tests/test_sft.py::test_pretrain_mode_counts_every_token", "pretrain_mode=a.pretrain_mode"),
        "skip_nonfinite_updates": Asserted(SKIP_TEST, "allow=a.skip_nonfinite_updates"),
        "packing_samples": Asserted("tests/test_sft.py::test_sft_loss_is_the_masked_cross_entropy_padded_and_packed",
                                    "packing=a.packing_samples"),
        "load_checkpoint": Asserted("tests/test_sft.py::test_resume_reproduces_the_uninterrupted_run", RESUME),
        "save_hf_ckpt": Asserted("tests/test_sft.py::test_resume_reproduces_the_uninterrupted_run", HF_CKPT),
    },
    "train_rm": {
        **COMMON,
        "flash_attn": Changes("attn"),
        "apply_chat_template": Asserted("tests/test_data.py::test_message_formats_agree",
                                        "apply_chat_template=a.apply_chat_template"),
        "margin_loss": (Numbers("rm_loss", 'batch["margin"] if a.margin_loss else None'),
                        Refused(("--loss", "logexp"))),
        "compute_fp32_loss": Banner(),
        "skip_nonfinite_updates": Asserted(SKIP_TEST, "allow=a.skip_nonfinite_updates"),
        "packing_samples": Changes("memory"),
        "load_checkpoint": Asserted("tests/test_rm_dpo.py::test_resume_reproduces_the_uninterrupted_run", RESUME),
        "save_hf_ckpt": Asserted("tests/test_rm_dpo.py::test_resume_reproduces_the_uninterrupted_run", HF_CKPT),
    },
    "train_dpo": {
        **COMMON,
        "flash_attn": Changes("attn"),
        "use_liger_kernel": Asserted("tests/test_openrlhf_data.py::test_liger_is_said_not_used_off_gpu_or_not_installed",
                                     "if a.use_liger_kernel:"),
        "apply_chat_template": Asserted("tests/test_data.py::test_message_formats_agree",
                                        "apply_chat_template=a.apply_chat_template"),
        "ipo": (Numbers("dpo_loss", "ipo=a.ipo"), Refused(("--label_smoothing", "0.1"))),
        "skip_nonfinite_updates": Asserted(SKIP_TEST, "allow=a.skip_nonfinite_updates"),
        "packing_samples": Changes("memory"),
        "ref_offload": Changes("memory"),
        "load_checkpoint": Asserted("tests/test_rm_dpo.py::test_resume_reproduces_the_uninterrupted_run", RESUME),
        "save_hf_ckpt": Asserted("tests/test_rm_dpo.py::test_resume_reproduces_the_uninterrupted_run", HF_CKPT),
    },
}
_RL_FLAGS = {
    **COMMON,
    "load_in_4bit": (Refused(), Asserted(Q4_TEST, ("common/rl/workers.py", "quantization(lora, self.dist.device)"))),
    "skip_bad_rewards": Asserted(
        "tests/test_rl.py::test_skip_bad_rewards_drops_samples_goes_on_and_an_unmappable_reply_stops_the_run",
        ("common/rl/eval.py", 'a["skip_bad_rewards"]')),
    "flash_attn": Changes("specs"),
    "use_liger_kernel": Changes("specs"),
    "apply_chat_template": Changes("prompts", USER_PROMPTS),
    "use_kl_loss": Numbers("advantages", "kl_in_loss = a.use_kl_loss and a.init_kl_coef > 0"),
    "normalize_reward": Changes("specs", REWARD),
    "no_advantage_std_norm": (Numbers("advantages", "std_norm=not a.no_advantage_std_norm"),
                              Refused(("--advantage_estimator", "rloo"))),  # which never divides by a std
    "dynamic_filtering": Asserted(FILTERED, "if a.dynamic_filtering:"),
    "skip_nonfinite_updates": Asserted("tests/test_rl.py::test_variants_run", "skip_nonfinite=a.skip_nonfinite_updates"),
    "packing_samples": Changes("specs"),
    "share_prompt_prefix": Changes("specs"),
    "ref_reward_offload": Changes("specs"),
    "deepspeed_enable_sleep": (Changes("ds"), Changes("memory")),
    "colocate_actor_ref": Changes("plan"),
    "colocate_all_models": Changes("plan"),
    "vllm_enable_sleep": (Refused(), Changes("engine", (*ENGINE, "--colocate_all_models"))),
    "enable_prefix_caching": Changes("engine", ENGINE),
    "enforce_eager": Changes("engine", ENGINE),
    "static_kv_cache": Changes("specs"),
    "dry_run": Changes("dry_run"),
    "load_checkpoint": Asserted("tests/test_rl.py::test_resume_reproduces_the_uninterrupted_run",
                                ("common/rl/run.py", 'if a["load_checkpoint"] else None')),
    "save_hf_ckpt": Asserted("tests/test_rl.py::test_builtin_default_reward_rises", ("common/rl/run.py", 'self.a["save_hf_ckpt"]')),
    "vllm_sync_with_ray": Changes("options"),
}
# Without vLLM engines these are refused; with them they act in the loop, which each script's test runs.
IS = "if a.enable_vllm_is_correction else None"
ASYNC, PARTIAL = "if a.async_train else 0", "if a.partial_rollout else 0"
FLAGS["train_ppo"] = {
    **_RL_FLAGS,
    "dynamic_filtering": (Refused(), Asserted(FILTERED, "if a.dynamic_filtering:")),  # one sample per prompt by default
    "share_prompt_prefix": (Refused(), Changes("specs", ("--n_samples_per_prompt", "4"))),
    "colocate_critic_reward": Changes("plan", REWARD),
    "save_value_network": Asserted("tests/test_rl.py::test_variants_run",
                                   'if a.save_value_network and "critic" in run.groups'),
    "enable_vllm_is_correction": (Refused(), Asserted("tests/test_vllm.py::test_async_queue_size_0_is_the_synchronous_loop", IS)),
    "async_train": (Refused(), Asserted("tests/test_vllm.py::test_async_queue_size_0_is_the_synchronous_loop", ASYNC)),
    # the loop's lines are GRPO's, whose test asserts the chunks' token versions
    "partial_rollout": (Refused(), Asserted("tests/test_vllm.py::test_grpo_partial_rollout_runs_with_bounded_staleness", PARTIAL)),
}
FLAGS["train_grpo"] = {
    **_RL_FLAGS,
    "enable_vllm_is_correction": (Refused(), Asserted("tests/test_vllm.py::test_grpo_two_engines_reward_rises", IS)),
    "async_train": (Refused(), Asserted(
        "tests/test_vllm.py::test_grpo_async_reward_rises_with_bounded_staleness_and_resumes_exactly", ASYNC)),
    "partial_rollout": (Refused(), Asserted("tests/test_vllm.py::test_grpo_partial_rollout_runs_with_bounded_staleness",
                                            PARTIAL)),
}

# The call in the scripts that each view repeats; "{script}" is the script's own file.
VIEW_CALLS = {
    "ds": {"rl": ("common/rl/run.py", 'ds.DSSettings.from_options(a, bf16=a["bf16"], fused_adam=a["deepspeed_enable_sleep"])'),
           "other": ("{script}", "ds.DSSettings.from_options(a, bf16=dtype == torch.bfloat16)")},
    "attn": ("{script}", "attn_implementation(a.flash_attn)"),
    "memory": {"rl": ("common/rl/run.py", 'memory_plan.from_options(a, "rl", plan'),
               "train_rm": ("{script}", 'memory_plan.from_options(a, "rm"'),
               "train_dpo": ("{script}", 'memory_plan.from_options(a, "dpo"')},
    "plan": ("{script}", "plan = resource_plan(a)"),
    "specs": ("{script}", "specs = run.policy_specs()"),
    "engine": ("common/rl/run.py", "EngineSpec.from_options(a, plan, self.pretrain)"),
    "prompts": ("common/rl/run.py", "load_prompts(a, self.tokenizer)"),
    "options": None, "dry_run": None,
}


def _module(script: str):
    return importlib.import_module(script)


def boolean_flags(script: str) -> list[str]:
    """The boolean parameters of the script's `main` as Typer sees it (the OpenRLHF decorator's included)."""
    sig = inspect.signature(_module(script).main)
    return [n for n, p in sig.parameters.items() if typing.get_args(p.annotation)[:1] == (bool,)]


def openrlhf_rows(script: str) -> dict:
    """OpenRLHF's boolean flags that the script takes only through the decorator and that its table
    refuses or accepts as changing nothing: classified by the table itself."""
    declared = inspect.signature(_module(script).main.__wrapped__).parameters
    how = {"refuse": Refused(), "accept": Banner()}
    return {n: how[row[2]] for n, row in EXTRA[script].items()
            if row[0] == "bool" and row[2] in how and n not in declared}


def _cases():
    for script in SCRIPTS:
        for flag, effects in {**FLAGS[script], **openrlhf_rows(script)}.items():
            for effect in effects if isinstance(effects, tuple) else (effects,):
                yield pytest.param(script, flag, effect, id=f"{script}--{flag}-{type(effect).__name__}")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_boolean_flag_is_classified(script):
    flags, known = set(boolean_flags(script)), set(FLAGS[script]) | set(openrlhf_rows(script))
    assert len(flags) > 10
    assert not flags - known, f"{script}: new boolean flags, classify them in tests/test_flags.py: {sorted(flags - known)}"
    assert not known - flags, f"{script}: tests/test_flags.py classifies flags the script no longer has: {sorted(known - flags)}"


@dataclasses.dataclass
class Run:
    script: str
    code: int
    out: str
    a: object   # the typed options train() would get (None: it was not reached)
    rest: tuple  # and the rest of its arguments (RL: the resource plan, the derived defaults)


def _run(script: str, args: list[str], monkeypatch, tmp_path) -> Run:
    module = _module(script)
    got: dict = {}
    monkeypatch.setattr(module, "train", lambda a, *rest: got.update(a=a, rest=rest))
    result = CliRunner().invoke(module.app, [*args, "--save_path", str(tmp_path / "out")])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Run(script, result.exit_code, result.output, got.get("a"), got.get("rest", ()))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    """Plain-text prompts, which --apply_chat_template renders as a user turn."""
    path = tmp_path_factory.mktemp("flags") / "prompts.jsonl"
    path.write_text("".join(f'{{"prompt": "Repeat: {w}", "label": "{w}"}}\n' for w in ("red", "cat dog", "sun")))
    return str(path)


# ---------------------------------------------------------------- the views
def _rl_shell(r: Run):
    """RLRun as its __init__ leaves it for `policy_specs`, without the Ray cluster and the prompts it starts."""
    from common.training import ds
    from common.training.lora import LoraSettings
    from common.training.models import resolve_pretrain
    from common.rl.run import RLRun

    run = RLRun.__new__(RLRun)
    plan = r.rest[0]
    run.a, run.plan, run.pretrain = r.a, plan, resolve_pretrain(r.a["pretrain"])
    run.roles = {role.role: role for role in plan.roles}
    run.settings = ds.DSSettings.from_options(r.a, bf16=r.a["bf16"], fused_adam=r.a["deepspeed_enable_sleep"])
    run.lora = LoraSettings.from_options(r.a)
    run.total_steps = run.optim_steps = 1
    return run


def view(name: str, r: Run, flag: str, monkeypatch):
    a = r.a
    if name == "dry_run":
        return a is None, "resource plan:" in r.out
    assert a is not None, r.out
    if name == "options":
        return {k: v for k, v in dict(a).items() if k not in (flag, "openrlhf")}
    if name == "ds":
        import torch

        from common.training import ds

        if r.script in RL:
            return ds.DSSettings.from_options(a, bf16=a["bf16"], fused_adam=a["deepspeed_enable_sleep"])
        dtype, _ = ds.resolve_dtype(a["bf16"], torch.device("cuda"))  # a CPU without native bf16 says it runs fp32
        return ds.DSSettings.from_options(a, bf16=dtype == torch.bfloat16)
    if name == "attn":
        from common.training.models import attn_implementation

        return attn_implementation(a["flash_attn"])
    if name == "memory":
        from common.cluster import memory_plan

        kind = {"train_rm": "rm", "train_dpo": "dpo"}.get(r.script, "rl")
        return memory_plan.from_options(a, kind, r.rest[0] if r.rest else None).processes
    if name == "plan":
        from common.cluster.resources import plan_rows

        return plan_rows(r.rest[0])
    if name == "specs":
        return _rl_shell(r).policy_specs()
    if name == "engine":
        from common.rollout import vllm_engine

        return vllm_engine.EngineSpec.from_options(a, r.rest[0], _rl_shell(r).pretrain) if a["vllm_num_engines"] else None
    if name == "prompts":
        from common.training.models import load_tokenizer
        from common.rl.eval import load_prompts

        return [p.prompt_ids for p in load_prompts(a, load_tokenizer(_rl_shell(r).pretrain))[0]]
    raise ValueError(name)


# ---------------------------------------------------------------- the first step's numbers
def rm_loss(a):
    """train_rm.py's Bradley-Terry loss on three pairs with margins."""
    import torch

    from common.algo.losses import bradley_terry_loss

    chosen, rejected, margin = torch.tensor([1.0, 0.2, -0.3]), torch.tensor([0.5, 0.4, -1.0]), torch.tensor([0.3, 1.0, 0.5])
    return bradley_terry_loss(chosen, rejected, margin if a["margin_loss"] else None)


def dpo_loss(a):
    """train_dpo.py's loss on two pairs of sequence log-probs."""
    import torch

    from common.algo.losses import dpo_loss as loss

    pc, pr, rc, rr = torch.tensor([-4.0, -6.0]), torch.tensor([-5.0, -5.5]), torch.tensor([-4.5, -6.0]), torch.tensor([-5.0, -5.0])
    return loss(pc, pr, rc, rr, a["beta"], label_smoothing=a["label_smoothing"], ipo=a["ipo"])[0]


def advantages(a):
    """The RL scripts' phase 4 on two prompts' groups: scores, a KL [B, T] with padding, and (gae) values."""
    import torch

    from common.algo.advantages import rl_advantages

    n, t = a["n_samples_per_prompt"], 5
    g = torch.Generator().manual_seed(0)
    scores, kl, values = torch.rand(2 * n, generator=g), torch.rand(2 * n, t, generator=g) / 10, torch.rand(2 * n, t, generator=g)
    mask = torch.ones(2 * n, t)
    mask[0, 3:] = 0
    kl_in_loss = a["use_kl_loss"] and a["init_kl_coef"] > 0
    return rl_advantages(scores, kl * mask, mask, estimator=a["advantage_estimator"], n=n,
                         kl_coef=0.0 if kl_in_loss else a["init_kl_coef"], gamma=a["gamma"], lambd=a.get("lambd", 1.0),
                         values=values if a["advantage_estimator"] == "gae" else None,
                         std_norm=not a["no_advantage_std_norm"], reward_clip=tuple(a["reward_clip_range"]))[0]


# ---------------------------------------------------------------- the checks
def _check_wire(script: str, wire) -> None:
    path, fragment = wire if isinstance(wire, tuple) else ("{script}", wire)
    path = path.format(script=f"{script}.py")
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    assert fragment in text, f"{path} no longer has `{fragment}`: update tests/test_flags.py to where the flag is read"


def _check_test_exists(test: str) -> None:
    path, name = test.split("::")
    name = name.split(":")[0]  # a NotAsserted run goes on with what to assert there
    base = os.path.basename(path)  # tests/<file>.py: in tests/unit/ or tests/e2e/, whichever holds the function
    names = set()
    for folder in ("unit", "e2e"):
        if os.path.isfile(os.path.join(ROOT, "tests", folder, base)):
            with open(os.path.join(ROOT, "tests", folder, base)) as f:
                names |= {n.name for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.FunctionDef)}
    assert name in names, f"{test} does not exist"


@pytest.mark.parametrize("script,flag,effect", list(_cases()))
def test_flag_acts_is_refused_or_says_it_does_nothing(script, flag, effect, monkeypatch, tmp_path, request):
    if isinstance(effect, Asserted):
        _check_test_exists(effect.test)
        if effect.wire:
            _check_wire(script, effect.wire)
        return
    if isinstance(effect, NotAsserted):
        _check_wire(script, effect.wire)
        _check_test_exists(effect.run)
        return
    context = [c.format(prompts=request.getfixturevalue("prompts")) if "{prompts}" in c else c for c in effect.context]
    off = _run(script, context, monkeypatch, tmp_path)
    on = _run(script, [*context, f"--{flag}"], monkeypatch, tmp_path)
    assert off.code == 0, off.out
    if isinstance(effect, Refused):
        assert on.code == 2 and on.out.startswith("error: ") and f"--{flag}" in on.out, on.out
        return
    assert on.code == 0, on.out
    if isinstance(effect, Banner):
        said = [n for n in on.a["openrlhf"]["notes"] if n.startswith(f"--{flag}")]
        assert len(said) == 1 and not [n for n in off.a["openrlhf"]["notes"] if n.startswith(f"--{flag}")], on.a["openrlhf"]
        return
    if isinstance(effect, Numbers):
        import torch

        _check_wire(script, effect.wire)
        compute = globals()[effect.compute]
        before, after = compute(off.a), compute(on.a)
        assert not torch.equal(before, after), f"--{flag} leaves the first step's numbers as they were: {before}"
        return
    calls = VIEW_CALLS[effect.view]
    if isinstance(calls, dict):
        calls = calls.get(script) or calls.get("rl" if script in RL else "other")
    if calls:
        _check_wire(script, calls)
    before, after = view(effect.view, off, flag, monkeypatch), view(effect.view, on, flag, monkeypatch)
    assert before != after, f"--{flag} changes nothing in the {effect.view} view: {before}"


# Contradictory options of train_ppo.py (the same checks serve train_grpo.py), refused before training
# starts: exit 2 with the message. In-process, as the flags above; the two refusals decided once the run
# starts are spawned in tests/e2e/test_rl.py::test_flag_contradictions.
@pytest.mark.parametrize("flags,expect", [
    (["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "1"], "--n_samples_per_prompt 2 or more"),
    (["--zero_stage", "5"], "--zero_stage 5"),
    (["--rollout_batch_size", "3", "--train_batch_size", "64"], "multiple of --train_batch_size"),
    (["--vllm_enable_sleep", "--vllm_num_engines", "1"], "--colocate_all_models"),
    (["--vllm_enable_sleep"], "--vllm_enable_sleep needs vLLM engines"),
    (["--reward_func", "a.py", "--remote_rm_url", "http://127.0.0.1:1"], "one source"),
    (["--colocate_all_models", "--vllm_num_engines", "4", "--dry_run"], "must equal"),
    (["--static_kv_cache", "--zero_stage", "3"], "use --zero_stage 0, 1 or 2, or drop --static_kv_cache"),
    (["--static_kv_cache", "--vllm_num_engines", "1"], "--static_kv_cache is for the policy's own generation"),
    (["--torch_autocast"], "--torch_autocast is a way to run --bf16: add --bf16"),
    (["--bf16", "--torch_autocast", "--deepspeed_enable_sleep"], "with --torch_autocast it is not supported yet"),
    (["--torch_compile", "--zero_stage", "3"], "--torch_compile: ZeRO-3"),
    (["--share_prompt_prefix"], "with --n_samples_per_prompt 1 there is nothing to share"),
    (["--share_prompt_prefix", "--n_samples_per_prompt", "4", "--packing_samples"],
     "--share_prompt_prefix and --packing_samples are two ways"),
    (["--share_prompt_prefix", "--n_samples_per_prompt", "4", "--gradient_checkpointing"],
     "which transformers turns off under --gradient_checkpointing: drop one of them"),
    (["--share_prompt_prefix", "--n_samples_per_prompt", "4", "--flash_attn"],
     "not with flash-attention: drop --flash_attn or --share_prompt_prefix"),
])
def test_flag_contradictions_are_refused_before_training(tmp_path, monkeypatch, flags, expect):
    r = _run("train_ppo", flags, monkeypatch, tmp_path)
    assert r.code == 2 and expect in r.out and r.a is None, (r.code, r.out[-1500:])
