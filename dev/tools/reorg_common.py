"""One-off for the next step of the house: move common/ into concern folders (cli, data, training, algo, cluster,
rollout, rl) with `git mv` and rewrite every dotted and path reference across the tree. Run once on a clean tree:
    python dev/tools/reorg_common.py .
Left by hand after it: the four folds (run_info -> logger with run_outputs -> errors, cli_help -> cli/options,
engine_clock -> rollout/vllm_engine, hybrid_engine -> rl/run) and the circles (split_note -> rl/run, hf_generate and
left_pad -> rollout/decode, HEAD_CHUNK/PLAIN_HEAD -> algo/logprobs, guests.hosts/note -> cluster/resources).
dev/tools/imports.py prints the import edges between modules afterwards. Delete both once applied."""
import os, re, subprocess, sys
root = sys.argv[1]
os.chdir(root)
MOVES = {
 "options": "cli.options", "openrlhf_flags": "cli.openrlhf_flags", "openrlhf_table": "cli.openrlhf_table",
 "cli_help": "cli.options",                      # folded
 "data": "data.rows", "prompts": "data.prompts", "sft_data": "data.sft", "preferences": "data.preferences",
 "blend": "data.blend", "tasks": "data.tasks",
 "ds": "training.ds", "dist": "training.dist", "ds_sleep": "training.ds_sleep", "updates": "training.updates",
 "checkpoint": "training.checkpoint", "models": "training.models", "tiny": "training.tiny", "liger": "training.liger",
 "losses": "algo.losses", "advantages": "algo.advantages", "logprobs": "algo.logprobs", "packing": "algo.packing",
 "shared_prefix": "algo.shared_prefix",
 "ray_groups": "cluster.ray_groups", "ray_local": "cluster.ray_local", "resources": "cluster.resources",
 "memory_estimate": "cluster.memory_estimate", "memory_plan": "cluster.memory_plan", "gpu_memory": "cluster.gpu_memory",
 "rollout": "rollout.samples", "decode": "rollout.decode", "rollout_queue": "rollout.queue",
 "partial_rollout": "rollout.partial", "vllm_engine": "rollout.vllm_engine", "vllm_worker": "rollout.vllm_worker",
 "weight_sync": "rollout.weight_sync", "weight_sender": "rollout.weight_sender",
 "engine_clock": "rollout.vllm_engine",          # folded
 "rl_run": "rl.run", "hybrid_engine": "rl.run",  # folded
 "workers": "rl.workers", "guests": "rl.guests", "rl_checks": "rl.checks", "rl_eval": "rl.eval", "rewards": "rl.rewards",
 "run_info": "logger",                           # folded
}
FOLDED = {"cli_help", "engine_clock", "hybrid_engine", "run_info"}
FOLDERS = {"cli": "the flags; no torch, so --help is instant",
           "data": "rows to examples: datasets, prompts, preference pairs, SFT rows, the built-in tasks",
           "training": "one process's DeepSpeed model and its sleep, checkpoints, the tiny model",
           "algo": "what a loss is made of: losses, advantages, log-probs, packing",
           "cluster": "Ray actor groups, and what runs where and whether it fits (--dry_run)",
           "rollout": "samples, how they are generated, weights to the samplers",
           "rl": "what train_ppo.py and train_grpo.py share: the run, the workers, rewards, evaluation"}
names = "|".join(sorted(MOVES, key=len, reverse=True))

def sub_from_import(m):
    indent, items, tail = m.group(1), m.group(2), m.group(3)
    out = []
    for part in items.split(","):
        part = part.strip()
        if not part: continue
        bits = part.split()
        name, alias = bits[0], (bits[2] if len(bits) == 3 else bits[0])
        if name in MOVES:
            pkg, _, mod = MOVES[name].rpartition(".")
            src = f"common.{pkg}" if pkg else "common"
            out.append(f"{indent}from {src} import {mod}" + (f" as {alias}" if alias != mod else ""))
        else:
            out.append(f"{indent}from common import {part}")
    return "\n".join(out) + tail

dotted = re.compile(r"\bcommon\.(" + names + r")\b(?!/)")
pathy = re.compile(r"\bcommon/(" + names + r")\.py\b")
from_imp = re.compile(r"^([ \t]*)from common import ([\w ,]+?)([ \t]*(#.*)?)$", re.M)

files = subprocess.run(["git", "ls-files"], capture_output=True, text=True).stdout.split()
files += subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], capture_output=True, text=True).stdout.split()
for f in files:
    if not os.path.isfile(f) or f.startswith(("dev/results/", "tests/data/openrlhf_flags")): continue
    if not f.endswith((".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml")) and f != "Makefile": continue
    s = open(f).read(); t = s
    t = dotted.sub(lambda m: "common." + MOVES[m.group(1)], t)
    t = from_imp.sub(sub_from_import, t)
    t = pathy.sub(lambda m: "common/" + MOVES[m.group(1)].replace(".", "/") + ".py", t)
    if t != s:
        open(f, "w").write(t)
for pkg, doc in FOLDERS.items():
    os.makedirs(f"common/{pkg}", exist_ok=True)
    open(f"common/{pkg}/__init__.py", "w").write(f'"""{doc[0].upper() + doc[1:]}."""\n')
for old, new in MOVES.items():
    if old in FOLDED: continue
    subprocess.run(["git", "mv", f"common/{old}.py", "common/" + new.replace(".", "/") + ".py"], check=True)
for p in FOLDERS: subprocess.run(["git", "add", f"common/{p}/__init__.py"], check=True)
print("moved; folds left by hand:", FOLDED)
