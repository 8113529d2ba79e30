"""common/'s folders import down one stack, never up: a plain SFT run must not reach Ray, and `--help` must not
reach torch. Every import counts, those inside functions included (they are where circles used to hide)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Lower numbers sit lower: a module may import only from its own folder or from a lower level.
LEVEL = {"errors": 0, "cpu_threads": 0, "cli": 1, "data": 1, "logger": 1, "training": 2, "algo": 3, "cluster": 4,
         "rollout": 5, "rl": 6}


def _imports(path: Path):
    """(line, module) of every import in the file, `from common.x import y` as common.x.y."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)


def _folder(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _edges():
    for path in sorted((ROOT / "common").rglob("*.py")):
        src = _folder(path.relative_to(ROOT / "common"))
        for line, mod in _imports(path):
            parts = mod.split(".")
            if parts[0] == "common" and len(parts) > 1 and parts[1] in LEVEL and parts[1] != src:
                yield src, parts[1], f"{path.relative_to(ROOT)}:{line} imports {mod}"


def test_every_folder_is_on_the_stack_and_the_tree_has_its_shape():
    root_modules = sorted(p.stem for p in (ROOT / "common").glob("*.py") if p.stem != "__init__")
    folders = sorted(p.name for p in (ROOT / "common").iterdir() if (p / "__init__.py").is_file())
    assert set(root_modules + folders) == set(LEVEL), "a new folder or root module needs its level here"
    assert len(root_modules) <= 3, root_modules  # with __init__.py, at most four files at the root
    for f in folders:
        files = [p for p in (ROOT / "common" / f).glob("*.py") if p.name != "__init__.py"]
        assert 3 <= len(files) <= 9, (f, [p.name for p in files])
    assert (ROOT / "common" / "__init__.py").read_text().strip() == ""  # importing common loads nothing


def test_imports_run_down_the_stack_and_no_two_folders_import_each_other():
    edges = list(_edges())
    upward = [why for src, dst, why in edges if LEVEL[dst] > LEVEL[src] or (LEVEL[dst] == LEVEL[src])]
    pairs = {(s, d) for s, d, _ in edges}
    both = sorted({tuple(sorted(p)) for p in pairs if p[::-1] in pairs})
    assert not both, both
    assert not upward, "\n".join(upward)


def test_cli_loads_no_torch_so_help_is_instant():
    heavy = ("torch", "ray", "vllm", "deepspeed", "transformers")
    found = [f"{p.relative_to(ROOT)}:{line} {mod}" for p in (ROOT / "common" / "cli").glob("*.py")
             for line, mod in _imports(p) if mod.split(".")[0] in heavy]
    assert not found, found


def test_the_walk_sees_an_import_inside_a_function(tmp_path):
    """The checks above would pass vacuously if the walk missed function-level imports."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from common.rl.run import RLRun\n    import torch\n")
    assert list(_imports(f)) == [(2, "common.rl.run.RLRun"), (2, "common.rl.run"), (3, "torch")]


def test_options_stop_high():
    """The options bag (a script's parsed flags, passed as `a` or `options`) is read in cli/ and rl/; below them
    a function takes it only to build typed settings, and is then named `from_options` (DSSettings,
    EngineSpec, the memory plan): so a flag's walk from a script ends in a few files."""
    high = {"cli", "rl"}
    found = []
    for path in sorted((ROOT / "common").rglob("*.py")):
        if _folder(path.relative_to(ROOT / "common")) in high:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = {x.arg for x in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
                if names & {"a", "options", "opts"} and not node.name.endswith("from_options"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not found, found
