"""The package's layers import one way (docs/concepts/internals.md, "Layers"): every import in `optim/`, those
inside functions too, read from the source. A layer may import the layers below it and modules of its own; no
two modules import each other, directly or through others."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "optim"
# Bottom to top. The top is the package itself: `optim/__init__.py`, `_info.py` and `__main__.py`.
LAYERS = ("_base", "_rules", "_engine", "_core", "_io", "_interop", "")
RANK = {"_base": 0, "_rules": 1, "_engine": 2, "_core": 3, "_io": 4, "_interop": 4, "": 5}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else ""


def imports(path: Path) -> set[str]:
    """The optim modules `path` imports (`from . import x` names module `x` where it is one)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "optim"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "optim":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if _exists(sub) else target)
    out.discard(module)
    return out


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


GRAPH = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_is_in_a_layer():
    assert {layer(m) for m in GRAPH} == set(LAYERS)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_down(module):
    up = sorted(t for t in GRAPH[module] if layer(t) != layer(module) and RANK[layer(t)] >= RANK[layer(module)])
    assert not up, f"{module} ({layer(module) or 'optim'}) imports from a layer above or beside it: {up}"


def test_no_import_cycles():
    """Depth-first search for a cycle in the module graph (a package importing its own modules, as
    `optim/__init__.py` does, is not one: its modules do not import the package back)."""
    cycles, state = [], {}

    def visit(m, path):
        state[m] = 1
        for t in sorted(GRAPH.get(m, ())):
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_finds_an_upward_import(tmp_path):
    """The reader sees what a module imports, function-level imports included."""
    src = tmp_path / "optim" / "_rules" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from .._core.state import State\n    from . import protocol\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "optim"
    try:
        assert imports(src) == {"optim._core.state", "optim._rules"}
    finally:
        PACKAGE = saved
