"""The package's shape in the figures issue 36 asks for: `python scripts/code_stats.py [--long]`.

Code lines leave out blank lines, comments and docstrings (PEP 257's: a body's first string and the attribute
docstring after an assignment, as each config field's one-line doc). Layers read top-down (docs/architecture.md);
an import of a higher layer is "upward". A monkey-patch is an assignment to an attribute of an imported upstream
module or class; a private reach is an import of an underscore name, or of a module path with an underscore part,
from an upstream library. Both are counted outside `compat/` only.
"""
from __future__ import annotations

import argparse
import ast
import io
import pathlib
import statistics
import tokenize

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "molt_hydra"
LAYER = {"config": 0, "compat": 1, "models": 2, "algorithm": 2, "data": 2, "logging": 2,
         "parallel": 3, "weight_sync": 3, "rollout": 3, "agents": 3, "runtime": 4, "cli": 5}
UPSTREAM = ("vllm", "transformers", "nemo_automodel", "torch", "ray", "peft", "hydra", "multiprocessing",
            "concurrent", "asyncio")
# vLLM's documented surfaces (engine, sampling, LoRA requests, parser plugins); any other vllm module is internal.
VLLM_PUBLIC = ("vllm", "vllm.sampling_params", "vllm.lora.request", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm",
               "vllm.tool_parsers", "vllm.reasoning", "vllm.inputs", "vllm.outputs")


def is_private(imported: str, names: list[str]) -> bool:
    if imported.split(".")[0] == "vllm" and imported not in VLLM_PUBLIC:
        return True
    if imported.startswith("transformers.models.") or imported.startswith("transformers.conversion_mapping"):
        return True
    return any(p.startswith("_") for p in imported.split(".")) or any(n.startswith("_") for n in names)


def code_lines(src: str, tree: ast.AST) -> int:
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for doc in docstrings(node.body):
                lines -= set(range(doc.lineno, doc.end_lineno + 1))
    return len(lines)


def docstrings(body: list[ast.stmt]):
    """PEP 257's docstrings of a body: its first string, and an attribute docstring after each assignment."""
    for i, stmt in enumerate(body):
        is_string = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and \
            isinstance(stmt.value.value, str)
        if is_string and (i == 0 or isinstance(body[i - 1], (ast.Assign, ast.AnnAssign))):
            yield stmt


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYER.get(parts[1]) if len(parts) > 1 else None


def imports(tree: ast.AST, module: str):
    """(imported module, is_top_level, node) for every import; relative imports resolved."""
    top = set(id(n) for n in getattr(tree, "body", []))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top, node, [alias.asname or alias.name.split(".")[0]]
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, id(node) in top, node, [a.asname or a.name for a in node.names]


def upstream_names(tree: ast.AST) -> set[str]:
    names = set()
    for mod, _, _, imported in imports(tree, ""):
        if mod.split(".")[0] in UPSTREAM:
            names.update(imported)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="list the functions over 60 lines and the findings")
    args = parser.parse_args()
    sizes, long_fns, upward, patches, private, graph, inner, total_imports = {}, [], [], [], [], {}, 0, 0
    for path in sorted(PACKAGE.rglob("*.py")):
        src = path.read_text()
        tree = ast.parse(src)
        mod, rel = module_name(path), path.relative_to(PACKAGE.parent)
        sizes[mod] = code_lines(src, tree)
        in_compat = mod.startswith("molt_hydra.compat")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long_fns.append(f"{rel}:{node.lineno} {node.name} {node.end_lineno - node.lineno + 1}")
        upstream = upstream_names(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                swap = isinstance(t, ast.Attribute) and t.attr == "__class__"
                if isinstance(t, ast.Attribute) and (swap or isinstance(t.value, ast.Name) and t.value.id in upstream) \
                        and not in_compat:
                    patches.append(f"{rel}:{node.lineno} {ast.unparse(t)}")
        graph[mod] = set()
        for imported, top_level, node, names in imports(tree, mod):
            total_imports += 1
            inner += not top_level
            root = imported.split(".")[0]
            if root == "molt_hydra":
                target = imported
                graph[mod].add(target)
                mine, theirs = layer_of(mod), layer_of(target)
                if mod == "molt_hydra.cli":
                    mine = LAYER["cli"]
                if mine is not None and theirs is not None and theirs > mine:
                    upward.append(f"{rel}:{node.lineno} imports {target}")
            elif root in UPSTREAM and not in_compat and root not in ("asyncio", "concurrent"):
                if is_private(imported, names):
                    private.append(f"{rel}:{node.lineno} {imported} {names}")
    cycles = find_cycles({m: {t for t in ts if t in graph} for m, ts in graph.items()})
    values = list(sizes.values())
    print(f"code lines {sum(values)}  files {len(values)}  median file {statistics.median(values):.0f}  "
          f"functions > 60 lines {len(long_fns)}  import cycles {len(cycles)}  upward imports {len(upward)}  "
          f"patches outside compat {len(patches)}  private reaches outside compat {len(private)}  "
          f"imports inside functions {inner} of {total_imports}")
    if args.long:
        for title, rows in (("long functions", long_fns), ("cycles", [" -> ".join(c) for c in cycles]),
                            ("upward imports", upward), ("patches", patches), ("private reaches", private)):
            print(f"\n## {title}\n" + "\n".join(rows))


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    main()
