"""The architecture, checked: imports go one way, from the entry points down, with no cycles (``ast``, no import
runs), no source file over 500 lines, nothing private crosses a module boundary."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# bottom to top; a module may import its own layer's packages (without a cycle) and the layers below
LAYERS = [("utils.core",), ("utils.precision",), ("utils.config",),
          ("utils.data", "utils.preprocess", "networks", "kernels"), ("distributed",),
          ("training.monitor", "training.evaluation"), ("training.loop",), ("training.tuner",),
          ("train", "train_mp", "evaluate", "tools", "benchmarks")]
LIBRARY = ("utils", "distributed", "networks", "kernels", "training")
# the top-level packages, bottom to top: each imports only those before it
TOP_LEVEL = ("utils", "networks", "kernels", "distributed", "training")
MAX_LINES = 500


def package(module: str) -> str:
    """The layer entry ``module`` belongs to (``utils.data.dali`` -> ``utils.data``)."""
    return max((p for layer in LAYERS for p in layer if module == p or module.startswith(p + ".")), key=len)


def layer(module: str) -> int:
    return next(i for i, entries in enumerate(LAYERS) if package(module) in entries)


def sources() -> dict[str, Path]:
    """Module name -> file of every project source (tests excluded)."""
    files = [p for top in (*LIBRARY, "tools", "benchmarks") for p in (ROOT / top).rglob("*.py")]
    files += [ROOT / f"{name}.py" for name in ("train", "train_mp", "evaluate")]
    named = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in files}
    return {name: path for name, path in named.items() if name not in ("utils", "training")}  # maps only


def imports(path: Path, modules: set[str]) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` of each project module ``path`` imports (at any depth in the file)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            full = [f"{node.module}.{a.name}" for a in node.names]
            for name, alias in zip(full, node.names):  # `from pkg import module`
                if name in modules:
                    out.append((name, [], node.lineno))
            if node.module in modules:
                out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name in modules]
    return out


GRAPH = {name: imports(path, set(sources())) for name, path in sources().items()}


def test_imports_never_go_up_a_layer():
    upward = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)}) on line {line}"
              for m, edges in GRAPH.items() for t, _, line in edges if layer(t) > layer(m)]
    assert not upward, "\n".join(upward)


def test_library_never_imports_tools_or_entry_points():
    bad = [f"{m} imports {t}" for m, edges in GRAPH.items() if m.split(".")[0] in LIBRARY
           for t, _, _ in edges if t.split(".")[0] not in LIBRARY]
    assert not bad, "\n".join(bad)


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the directed graph ``edges``, or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_cycle_between_modules():
    cycle = _cycle({m: {t for t, _, _ in edges} for m, edges in GRAPH.items()})
    assert not cycle, " -> ".join(cycle)


def test_no_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for m, edges in GRAPH.items():
        packages.setdefault(package(m), set()).update(package(t) for t, _, _ in edges if package(t) != package(m))
    cycle = _cycle(packages)
    assert not cycle, " -> ".join(cycle)


def test_no_private_name_crosses_a_module_boundary():
    bad = [f"{m} line {line}: {t}.{n}" for m, edges in GRAPH.items() for t, names, line in edges
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def test_no_source_file_is_over_500_lines():
    long = {name: n for name, path in sources().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_checker_sees_a_violation():
    """The layer rule would catch an upward import (guards the check itself against matching nothing)."""
    assert layer("utils.core.errors") < layer("training.loop.trainer") < layer("train")
    assert package("distributed.checkpoint.manager") == "distributed"
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert any(t == "training.loop.trainer" for t, _, _ in GRAPH["training.tuner.auto"])


def test_top_level_packages_import_one_way():
    """``utils`` -> ``networks``/``kernels`` -> ``distributed`` -> ``training``: the tree's order is the layers'."""
    top = {p: i for i, p in enumerate(TOP_LEVEL)}
    back = [f"{m} imports {t} on line {line}" for m, edges in GRAPH.items() for t, _, line in edges
            if m.split(".")[0] in top and t.split(".")[0] in top and top[t.split(".")[0]] > top[m.split(".")[0]]]
    assert not back, "\n".join(back)


def test_no_two_modules_share_a_name():
    """A file name says what it holds once in the tree (``__init__.py`` aside)."""
    names: dict[str, list[str]] = {}
    for module, path in sources().items():
        if path.name != "__init__.py":
            names.setdefault(path.stem, []).append(module)
    shared = {name: modules for name, modules in names.items() if len(modules) > 1}
    assert not shared, shared


SOURCES = sources()


def _main_calls(tree: ast.Module) -> set[str]:
    """Names of the functions the ``if __name__ == "__main__":`` block calls."""
    blocks = [n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Compare)
              and isinstance(n.test.left, ast.Name) and n.test.left.id == "__name__"]
    return {c.func.id for b in blocks for c in ast.walk(b) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}


def _calls_run_cli(name: str, module: str, tree: ast.Module) -> bool:
    """Whether ``name`` in ``module`` is ``run_cli`` or a function that calls it, here or where it is imported."""
    if name == "run_cli":
        return True
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "run_cli"
                       for c in ast.walk(node))
        if isinstance(node, ast.ImportFrom) and node.module in SOURCES and any(a.name == name for a in node.names):
            return _calls_run_cli(name, node.module, ast.parse(SOURCES[node.module].read_text()))
    return False


def test_every_entry_point_exits_through_run_cli():
    """A command's bad input is one ``error:`` line, Ctrl-C one line and 130, a closed output pipe a quiet 0, and a
    failed rank exits at once: ``utils.core.errors.run_cli`` does all of it, so every ``__main__`` goes through it."""
    missing = []
    for module, path in SOURCES.items():
        tree = ast.parse(path.read_text())
        calls = _main_calls(tree)
        if calls and not any(_calls_run_cli(name, module, tree) for name in calls):
            missing.append(f"{path.relative_to(ROOT)}: its __main__ calls {sorted(calls)}")
    assert not missing, "\n".join(missing)
