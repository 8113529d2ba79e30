"""Regenerate openrlhf_flags_76351db1.json: the flags of OpenRLHF's last flat-flag CLIs (commit 76351db1),
read with `ast` from the four files, so no OpenRLHF code runs (names, types, arity, defaults only):

    python tests/data/make_openrlhf_flags.py /path/to/OpenRLHF-git-dir > tests/data/openrlhf_flags_76351db1.json
"""
from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys

COMMIT = "76351db1"
CLIS = {"train_ppo_ray": ["train_ppo", "train_grpo"], "train_rm": ["train_rm"], "train_dpo": ["train_dpo"],
        "train_sft": ["train_sft"]}


def _value(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        text = ast.unparse(node)
        if text == "float('inf')":
            return "inf"
        if text.startswith("int("):
            return int(float(text[4:-1]))
        return None  # e.g. a date-stamped wandb run name


def flags(source: str) -> list[dict]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            name = node.args[0].value.lstrip("-")
            kw = {k.arg: k.value for k in node.keywords}
            action = _value(kw["action"]) if "action" in kw else None
            row = {"name": name,
                   "type": "bool" if action == "store_true" else ast.unparse(kw["type"]) if "type" in kw else "str",
                   "nargs": _value(kw["nargs"]) if "nargs" in kw else None,
                   "default": _value(kw["default"]) if "default" in kw else (False if action == "store_true" else None)}
            if "choices" in kw:
                row["choices"] = _value(kw["choices"])
            out.append(row)
    return out


def _show(git_dir: str, path: str) -> str:
    return subprocess.run(["git", "-C", git_dir, "show", f"{COMMIT}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def example_command(text: str) -> tuple[str, list[str]] | None:
    """(cli, flags) of the one `openrlhf.cli.<cli>` command in an example script, its bash arrays and
    variables expanded; None when the script runs none of the five CLIs."""
    text = re.sub(r"(?m)^\s*#.*$", "", text).replace("\\\n", " ")
    arrays = {m[1]: m[2] for m in re.finditer(r"(?s)(\w+)=\((.*?)\)", text)}
    variables = {m[1]: m[2].strip('"') for m in re.finditer(r'(?m)^(\w+)="?([^"(\n]*)"?\s*(#.*)?$', text)}
    m = re.search(r"openrlhf\.cli\.(train_ppo_ray|train_rm|train_dpo|train_sft)\b(.*)", text)
    if not m:
        return None
    rest = m[2]
    for name, body in arrays.items():
        rest = rest.replace(f"${{{name}[@]}}", body)
    for name, value in variables.items():
        rest = rest.replace(f"${{{name}}}", value).replace(f"${name}", value)
    rest = rest.replace('\\"', "").split("\" &>>")[0].split("\nEOF")[0]
    return m[1], shlex.split(rest, comments=True)


def main(git_dir: str) -> None:
    result = {"commit": COMMIT, "scripts": {}, "examples": {}}
    for cli, ours in CLIS.items():
        src = _show(git_dir, f"openrlhf/cli/{cli}.py")
        for script in ours:
            result["scripts"][script] = {"openrlhf_cli": f"openrlhf/cli/{cli}.py", "flags": flags(src)}
    names = subprocess.run(["git", "-C", git_dir, "ls-tree", "--name-only", COMMIT, "examples/scripts/"], check=True,
                           capture_output=True, text=True).stdout.split()
    for path in names:
        found = example_command(_show(git_dir, path)) if path.endswith(".sh") else None
        if found:
            result["examples"][path.rsplit("/", 1)[1]] = {"cli": found[0], "args": found[1]}
    json.dump(result, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
