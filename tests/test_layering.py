"""The package layering, read from the source with ``ast``: ``pipelines/`` and ``reward_models/``
never import ``flowalign``, and no import cycle exists among the modules of the three packages.

Imports are those executed when a module loads (module level, including ``if`` / ``try``
blocks); imports inside functions are deferred and may point upward. A cycle among deferred
imports would not fail at import time, and the layering rule covers them too."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flowalign", "pipelines", "reward_models")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(path: Path, module: str, top_level_only: bool, known: dict) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = []

    def visit(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                nodes.append(node)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue  # only read by type checkers, never executed
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])

    if top_level_only:
        visit(tree.body)
    else:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:  # relative import
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
        # ``from package import submodule`` loads the submodule; ``from module import name`` the module
        names |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return {n for n in names if n.split(".")[0] in PACKAGES}


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = _modules()
    return {m: {n for n in _imports(p, m, top_level_only, modules) if n in modules and n != m}
            for m, p in modules.items()}


def test_pipelines_and_reward_models_never_import_flowalign():
    crossings = [f"{m} imports {n}" for m, targets in _graph(top_level_only=False).items()
                 if m.split(".")[0] in ("pipelines", "reward_models") for n in targets if n.startswith("flowalign")]
    assert not crossings, "the lower layers import the RL core:\n" + "\n".join(crossings)


def test_no_import_cycles():
    graph = _graph(top_level_only=True)
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" → ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
