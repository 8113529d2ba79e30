"""Print the per-script flag tables of docs/openrlhf.md from the checked-in flag lists, our scripts'
signatures and common/cli/openrlhf_table.py:  python tests/data/make_openrlhf_docs.py
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from common.cli.openrlhf_table import DEFAULTS, EXTRA  # noqa: E402

DATA = json.load(open(os.path.join(ROOT, "tests", "data", "openrlhf_flags_76351db1.json")))
WORD = {"impl": "implemented", "accept": "accepted, no effect", "refuse": "refused"}


def main() -> None:
    for name in ("train_ppo", "train_grpo", "train_rm", "train_dpo", "train_sft"):
        try:
            declared = inspect.signature(importlib.import_module(name).main.__wrapped__).parameters
        except (ImportError, AttributeError):
            declared = {}
        print(f"\n### {name}.py ({DATA['scripts'][name]['openrlhf_cli']})\n")
        print("| flag | OpenRLHF default | here |\n|---|---|---|")
        for f in DATA["scripts"][name]["flags"]:
            n = f["name"]
            if n in declared:
                ours = declared[n].default
                if n in DEFAULTS.get(name, {}) and DEFAULTS[name][n] != ours:
                    status = f"same; default {ours!r} without --pretrain, OpenRLHF's with it"
                elif ours != f["default"] and f["type"] != "bool":
                    status = f"same; default {ours!r} (see Defaults that differ)"
                else:
                    status = "same"
            elif n in EXTRA.get(name, {}):
                kind, _, how, text = EXTRA[name][n]
                status = f"alias: {text}" if how.startswith("alias") else f"{WORD[how]}: {text}"
            elif not declared:
                status = "ours, once the script exists"
            else:
                status = "**missing** (not declared yet)"
            print(f"| `--{n}` | `{f['default']}` | {status.replace('|', '/')} |")


if __name__ == "__main__":
    main()
