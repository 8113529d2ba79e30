"""Print the import edges between common/ modules (imports inside functions included): python dev/tools/imports.py ."""
import ast, os, sys, collections
root = sys.argv[1] if len(sys.argv) > 1 else "/work/main"
edges = collections.defaultdict(set)
for dp, dn, fn in os.walk(os.path.join(root, "common")):
    for f in fn:
        if not f.endswith(".py"): continue
        p = os.path.join(dp, f); mod = os.path.relpath(p, root)[:-3].replace("/", ".")
        if mod.endswith(".__init__"): mod = mod[:-9]
        for node in ast.walk(ast.parse(open(p).read())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("common"):
                if node.module == "common":
                    for a in node.names: edges[mod].add("common." + a.name)
                else:
                    sub = [node.module + "." + a.name for a in node.names]
                    edges[mod].update(x for x in sub if os.path.exists(os.path.join(root, x.replace(".", "/") + ".py")))
                    if not any(os.path.exists(os.path.join(root, x.replace(".", "/") + ".py")) for x in sub):
                        edges[mod].add(node.module)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("common"): edges[mod].add(a.name)
for m in sorted(edges): print(m, "->", " ".join(sorted(x.replace("common.", "") for x in edges[m])))
