"""The option checks every script runs before anything heavy loads: output folders, prompt templates.

Each reads the script's parsed options (`a`: flag names to values) and raises `UserError` naming the flag.
"""
from __future__ import annotations

import json
import os

from common.errors import UserError, one_line, run_outputs


def check_output_folders(a: dict) -> None:
    """--save_path, --ckpt_path and --use_tensorboard must be folders this process can create or write, and
    --save_path must not hold another run: a second run there is refused (it would overwrite that run's
    metrics and model), unless --load_checkpoint continues that run. Refused, not moved to a new folder:
    the next stage of a pipeline reads the model from the path it was given."""
    save = a.get("save_path")
    found = run_outputs(save) if save and not dry_run_only(a) and not a.get("load_checkpoint") else []
    if found:
        try:
            with open(os.path.join(save, "config.json")) as f:
                cfg = json.load(f).get("hybridrl", {})
            by = f" of {cfg['script']}" if cfg.get("script") else ""
        except (OSError, ValueError, AttributeError):
            by = ""
        raise UserError(f"--save_path {save} already holds a run{by} ({', '.join(found)}), which this one would "
                        "overwrite: give another --save_path, add --load_checkpoint to continue that run from its "
                        "newest checkpoint, or remove the folder")
    for flag in ("save_path", "ckpt_path", "use_tensorboard"):
        path = a.get(flag)
        if not path or dry_run_only(a):
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            raise UserError(f"--{flag} {path}: a file is there, and this is where the run's folder goes; "
                            "give another path or move the file")
        parent = path
        while parent and not os.path.exists(parent):  # the nearest folder that exists gets the new ones
            parent = os.path.dirname(parent.rstrip("/")) or "."
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UserError(f"--{flag} {path}: {os.path.abspath(parent)} cannot be written by this user; give a "
                            "folder you can write")


def dry_run_only(a: dict) -> bool:
    return bool(a.get("dry_run"))  # a dry run writes nothing


def template_notes(a: dict, prompt_flag: str | None = None) -> list[str]:
    """Check --input_template and --tokenizer_chat_template (a script's parsed options); notes for the banner.

    OpenRLHF drops a template without '{}' and ignores both flags where they do not apply, with a
    printed warning at most; here each of those is an error naming the flag. `prompt_flag`: the
    flag that names the prompt column (RM/DPO's --prompt_key), the template's only target there.
    """
    t, chat, builtin = a.get("input_template"), a["apply_chat_template"], a.get("dataset", a.get("prompt_data")) is None
    notes = []
    if t is not None:
        if builtin:
            raise UserError("--input_template: the built-in task's prompts are chat messages; give your data too")
        if "{}" not in t:
            raise UserError(f"--input_template {t!r} has no '{{}}' where the prompt goes; add it")
        try:
            t.format("")
        except (IndexError, KeyError, ValueError) as e:
            raise UserError(f"--input_template {t!r}: not a str.format template with one '{{}}' ({one_line(e)}); "
                            "write other braces as '{{' and '}}'") from None
        if chat:
            raise UserError("--input_template wraps plain-text prompts; with --apply_chat_template the chat "
                            "template renders them (OpenRLHF then ignores --input_template): drop one of the two")
        if prompt_flag and a.get(prompt_flag.lstrip("-")) is None:
            raise UserError(f"--input_template wraps the prompt column: set {prompt_flag} (without it the rows' "
                            "texts are whole and OpenRLHF ignores the template)")
        if "\\n" in t:
            notes.append("--input_template holds a backslash and an 'n', not a newline (kept as given); in bash "
                         "write $'Q: {}\\nA: ' for a newline")
    ct = a.get("tokenizer_chat_template")
    if ct is not None and not (chat or builtin):
        raise UserError("--tokenizer_chat_template replaces the template that --apply_chat_template uses: add "
                        "--apply_chat_template, or drop the flag")
    return notes


def check_lora(a: dict) -> None:
    """The LoRA flags (common.training.lora): those that shape an adapter need one (--lora_rank), as does 4-bit."""
    if a.get("lora_rank"):
        return
    for flag, default in (("load_in_4bit", False), ("target_modules", None), ("lora_alpha", 16), ("lora_dropout", 0.0)):
        if a.get(flag, default) not in (default, ["all-linear"]):
            raise UserError(f"--{flag} shapes a LoRA adapter, and this run trains every weight: add --lora_rank "
                            "(e.g. 16) to train an adapter, or drop it")
