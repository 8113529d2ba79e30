"""OpenRLHF's flat flags (commit 76351db1) on our Typer scripts: one decorator per script's `main`.

    @app.command(help=...)
    @openrlhf_flags("train_rm")
    def main(...):
        a = options(locals())

The decorator extends `main`'s signature with a Typer option for every OpenRLHF flag the script
does not declare (`common.cli.openrlhf_table.EXTRA`), with OpenRLHF's type and arity, so that an
OpenRLHF command parses. Before the real `main` runs it asks click which flags the user gave and
  - translates the ones with the same meaning here (`--param_dtype bf16` -> `--bf16`,
    `--attn_implementation`, `--max_len`/`--max_new_tokens`, `--use_wandb KEY`, ...),
  - refuses, with exit code 2 and what to use instead, the ones asking for a capability we lack,
  - and, when a model is given (`--pretrain`), puts OpenRLHF's default in place of the demo default
    of every option the user left alone (`common.cli.openrlhf_table.DEFAULTS`); --help shows both.
`options(locals())` returns the script's options plus the extra flags' values and, under
"openrlhf", where each default came from (the banner prints it, common.logger). Light: no torch.
"""
from __future__ import annotations

import copy
import functools
import inspect
import os
import typing
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from common.errors import UserError, exit_on_user_error, require
from common.cli.openrlhf_table import DEFAULTS, EXTRA

PANEL = "OpenRLHF flags"
_SCALARS = {"int": int, "float": float, "str": str}
_current: dict | None = None  # the translation of the command being run (one per process)


class Command(TyperCommand):
    """A script's command: OpenRLHF's nargs='*' flags take several values after one flag (`--target_modules
    q_proj v_proj`), where click takes one value per flag; the values after such a flag are spread over
    repeated flags (`--target_modules q_proj --target_modules v_proj`) before click parses them."""

    def parse_args(self, ctx, args):
        multi = {name for p in self.params if getattr(p, "multiple", False) for name in p.opts}
        return super().parse_args(ctx, spread_values(list(args), multi))


def spread_values(args: list[str], flags: set[str]) -> list[str]:
    """`args` with each extra value after a flag in `flags` given its own copy of the flag."""
    out, current, taken = [], None, 0
    for arg in args:
        if arg.startswith("-"):
            current, taken = (arg if arg in flags else None), 0
        elif current is not None:
            if taken:
                out.append(current)
            taken += 1
        out.append(arg)
    return out


def _type(kind: str):
    if kind == "bool":
        return bool
    if kind == "float2":
        return Optional[tuple[float, float]]
    if kind == "list":  # OpenRLHF's nargs='*': here one value per flag (`--target_modules q --target_modules v`)
        return Optional[list[str]]
    return Optional[_SCALARS[kind]]


def _extra_parameter(name: str, row: tuple) -> inspect.Parameter:
    kind, default, how, text = row
    # Refused and no-op flags stay out of --help (docs/openrlhf.md lists them); working ones get a panel.
    hidden = how in ("refuse", "accept")
    value = default if kind in ("bool", "int", "float", "str") else None
    show = f"OpenRLHF's {default}" if kind in ("float2", "list") and default is not None else True
    if name in _HANDLERS:  # translated onto our options, whose defaults --help shows
        show = False
    info = typer.Option(f"--{name}", help=f"OpenRLHF's --{name}: {text}.", rich_help_panel=PANEL, hidden=hidden,
                        show_default=show)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=value,
                             annotation=Annotated[_type(kind), info])


def _with_openrlhf_default(annotation, ours, theirs):
    """The same option, its --help default saying both values."""
    base, *meta = typing.get_args(annotation)
    meta = [copy.copy(m) for m in meta]
    for m in meta:
        if isinstance(m, typer.models.OptionInfo):
            m.show_default = f"{_show(ours)}; with --pretrain OpenRLHF's {_show(theirs)}"
    return Annotated[(base, *meta)]


def _show(v) -> str:
    return "none" if v is None else str(v)


def _given(names) -> set[str]:
    """The options the user set on the command line (or the environment), as click saw them."""
    try:  # typer >= 0.2x parses with its own copy of click
        from typer import _click as click
    except ImportError:
        import click

    ctx = click.globals.get_current_context(silent=True)
    if ctx is None:
        return set()
    default = (click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP, None)
    return {n for n in names if ctx.get_parameter_source(n) not in default}


def openrlhf_flags(script: str):
    extra_rows, defaults = EXTRA[script], DEFAULTS[script]

    def decorate(main):
        sig = inspect.signature(main, eval_str=True)
        declared = dict(sig.parameters)
        params = [p.replace(annotation=_with_openrlhf_default(p.annotation, p.default, defaults[n]))
                  if n in defaults and defaults[n] != p.default else p for n, p in declared.items()]
        extras = {n: r for n, r in extra_rows.items() if n not in declared}
        params += [_extra_parameter(n, r) for n, r in extras.items()]

        @functools.wraps(main)
        def wrapper(**kw):
            global _current
            with exit_on_user_error():
                given = _given(kw)
                ours = {n: kw[n] for n in declared}
                _current = translate(ours, {n: kw[n] for n in extras}, given, extras,
                                     {n: declared[n].default for n in defaults if n in declared}, defaults)
                from common.cli.checks import check_output_folders

                check_output_folders(ours)  # every script's main runs through here: checked before torch loads
            return main(**ours)

        wrapper.__signature__ = sig.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


def options(local_vars: dict) -> dict:
    """The script's options (its `locals()` at the top of main) plus the OpenRLHF flags' values."""
    a = dict(local_vars)
    if _current is not None:
        a.update(_current["values"])
        a["openrlhf"] = _current["info"]
    return a


def translate(ours: dict, extra: dict, given: set, rows: dict, demo: dict, openrlhf: dict) -> dict:
    """Apply OpenRLHF's defaults and flags to `ours` (in place); return the values and the banner's notes."""
    info: dict = {"defaults": {}, "derived": {}, "notes": []}
    with_model = bool(ours.get("pretrain"))
    for name, theirs in openrlhf.items():  # defaults first: a translated flag below overrides them
        if name not in demo or name in given or demo[name] == theirs:
            continue
        if with_model:
            ours[name] = theirs
            info["defaults"][name] = f"{_show(theirs)} (OpenRLHF's, with --pretrain)"
        else:
            info["defaults"][name] = f"{_show(demo[name])} (demo; with --pretrain OpenRLHF's {_show(theirs)})"
    values = dict(extra)
    for name in [n for n in rows if n in given]:
        kind, default, how, text = rows[name]
        v = extra[name]
        if name in _HANDLERS:
            _HANDLERS[name](v, ours, given, info)
        elif how == "refuse" and v != default and not (kind == "list" and v == default):
            raise UserError(f"--{name}: {text}")
        elif how == "accept":
            info["notes"].append(text)
        elif how.startswith("alias:"):
            target = how.split(":", 1)[1]
            require(target not in given, f"--{name} and --{target} are two spellings of one option: give one")
            ours[target] = v
    if "use_wandb" in given:
        _use_wandb(ours)
    if "reward_func" in ours and "remote_rm_url" in given:
        _remote_rm_file(ours, given, info)
    if "generate_max_len" in ours:
        _lengths(ours, extra, given, info, with_model)
    return {"values": values, "info": info}


def _param_dtype(v, ours, given, info):
    # fp32 is ours (OpenRLHF has bf16 and fp16 only): with --pretrain bf16 is the default, this turns it off.
    require(v in ("bf16", "fp32"), f"--param_dtype {v}: fp16 training (with loss scaling) is not supported; use "
            "--param_dtype bf16 (or --bf16), or --param_dtype fp32")
    ours["bf16"] = v == "bf16"


def _attn(v, ours, given, info):
    impl = {"flash_attention_2": True, "sdpa": False, "eager": "eager"}
    require(v in impl, f"--attn_implementation {v}: choose flash_attention_2, sdpa or eager")
    require("flash_attn" not in given or impl[v] is True, f"--flash_attn and --attn_implementation {v} ask for two "
            "attention implementations: give one")
    ours["flash_attn"] = impl[v]  # common.training.models.attn_implementation takes True, False or "eager"


def _sync_with_ray(v, ours, given, info):
    if v:
        require("vllm_sync_backend" not in given, "--vllm_sync_with_ray and --vllm_sync_backend are two spellings "
                "of one option: give --vllm_sync_backend ray")
        ours["vllm_sync_backend"] = "ray"


def _generate_batch(v, ours, given, info):
    if v is None:
        return
    require(v <= ours["rollout_batch_size"], f"--vllm_generate_batch_size {v} above --rollout_batch_size "
            f"{ours['rollout_batch_size']} generates several steps' prompts in one vLLM call (OpenRLHF's async over-sampling), "
            "which is not supported; drop it (--async_train generates each step's rollout ahead, one call per step)")
    info["notes"].append("--vllm_generate_batch_size: all prompts of a step go to the engines at once here (they "
                         "batch them themselves); the flag changes nothing")


def _use_wandb(ours):
    # OpenRLHF's --use_wandb takes the API key. It goes to the environment wandb reads, never into the
    # options (config.json, metrics, the banner); `--use_wandb env` uses WANDB_API_KEY as it is.
    v = ours["use_wandb"]
    if v and v.lower() not in ("env", "true", "1"):
        os.environ["WANDB_API_KEY"] = v
    ours["use_wandb"] = "env" if v else None


def _remote_rm_file(ours, given, info):
    v = ours["remote_rm_url"]
    if not v or v.startswith(("http://", "https://")) or not v.endswith(".py"):
        return
    require("reward_func" not in given, f"--remote_rm_url {v} is OpenRLHF's spelling of a local reward function, "
            "and --reward_func gives one too: give one")
    ours["reward_func"], ours["remote_rm_url"] = v, None
    info["notes"].append(f"--remote_rm_url {v}: a local Python file, run as --reward_func {v}; it must define "
                         "reward_func(prompts, completions, labels) -> list[float] (OpenRLHF's takes queries)")


def _lengths(ours, extra, given, info, with_model):
    """OpenRLHF's --max_len (prompt + response) and --max_new_tokens onto our two fixed budgets."""
    if "max_new_tokens" in given and extra["max_new_tokens"] is not None:
        require("generate_max_len" not in given, "--max_new_tokens and --generate_max_len are two spellings of one "
                "limit: give one")
        ours["generate_max_len"] = extra["max_new_tokens"]
        given = given | {"generate_max_len"}
    if "max_len" in given and extra["max_len"] is not None:
        total, where = extra["max_len"], f"--max_len {extra['max_len']}"
    elif with_model:
        total, where = 2048, "OpenRLHF's --max_len 2048"
    else:
        return
    p, g = "prompt_max_len" in given, "generate_max_len" in given
    if p and g:
        require("max_len" not in given, "--max_len is prompt + response tokens: give two of --max_len, "
                "--prompt_max_len and --generate_max_len (or --max_new_tokens), not all three")
        return
    if g:
        ours["prompt_max_len"] = total - ours["generate_max_len"]
        info["derived"]["prompt_max_len"] = f"{ours['prompt_max_len']} ({where} - {ours['generate_max_len']} new tokens)"
    elif p:
        ours["generate_max_len"] = total - ours["prompt_max_len"]
        info["derived"]["generate_max_len"] = f"{ours['generate_max_len']} ({where} - --prompt_max_len)"
    else:  # OpenRLHF lets each response fill what its prompt leaves; ours has one budget: half and half
        ours["prompt_max_len"], ours["generate_max_len"] = total // 2, total - total // 2
        info["derived"]["prompt_max_len / generate_max_len"] = f"{total // 2} / {total - total // 2} ({where}, halved)"
    require(ours["prompt_max_len"] >= 1 and ours["generate_max_len"] >= 1,
            f"{where} leaves no room: it must exceed the response (or prompt) budget")


_HANDLERS = {"param_dtype": _param_dtype, "attn_implementation": _attn, "vllm_sync_with_ray": _sync_with_ray,
             "vllm_generate_batch_size": _generate_batch}
