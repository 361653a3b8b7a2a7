"""Every repository path and module a source file, a doc or a config comment cites exists (moved files leave no
stale references behind)."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("utils", "distributed", "networks", "kernels", "training", "tools", "benchmarks", "tests", "docs", "config")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w/.-]*?\.(?:py|md|yaml|yml|sh|json|toml))\b" % "|".join(TOPS))
MODULE = re.compile(r"(?<![\w./-])((?:utils|distributed|networks|kernels|training|tools|benchmarks)(?:\.\w+)+)")
CITING = ["*.py", "*.md", "*.yaml", "*.yml", "Makefile", "*.sh", "*.toml"]


def citing_files() -> list[Path]:
    skip = {".venv", "site", ".git", "runs", "data", "__pycache__", ".pytest_cache"}
    files = [p for pattern in CITING for p in ROOT.rglob(pattern) if not skip & set(p.relative_to(ROOT).parts)]
    return sorted(set(files))


@lru_cache(maxsize=None)
def module_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level (what ``module.name`` may cite)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_exists(dotted: str) -> bool:
    """``pkg.module[.name[.attr]]``: the longest module prefix exists, and the first name after it is defined there."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        found = module_file(parts[:n])
        if found is not None:
            return n == len(parts) or parts[n] in module_names(found)
    return False


def is_output(cited: str, f: Path) -> bool:
    """A benchmark's own result file, which it writes (and which exists once it has been run on a GPU)."""
    return cited.startswith("benchmarks/results/") and f.parent.name == "benchmarks"


def stale_citations() -> list[str]:
    stale = []
    for f in citing_files():
        if f == Path(__file__):  # its examples are stale on purpose
            continue
        text = f.read_text(errors="replace")
        for m in PATH.finditer(text):
            if not (ROOT / m.group(1)).exists() and not is_output(m.group(1), f):
                stale.append(f"{f.relative_to(ROOT)}: {m.group(1)}")
        if f.suffix in (".py", ".md"):
            for m in MODULE.finditer(text):
                if not module_exists(m.group(1).rstrip(".")):
                    stale.append(f"{f.relative_to(ROOT)}: {m.group(1)}")
    return stale


def test_every_cited_path_and_module_exists():
    stale = stale_citations()
    assert not stale, f"{len(stale)} stale citations:\n" + "\n".join(stale)


def test_the_check_sees_a_stale_path():
    assert PATH.search("see ``utils/data_loader.py``").group(1) == "utils/data_loader.py"
    assert not module_exists("utils.schema") and module_exists("utils.config.schema.Config")
    assert PATH.search("https://x.org/docs/env.html") is None and MODULE.search("torch.distributed.checkpoint") is None


def test_the_readme_map_names_every_package_of_the_tree():
    """The README's map of the code lists each library package, and each folder it lists exists."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Map of the code"):].split("\n## ")[0]
    listed = set(re.findall(r"^\| `([\w/]+/)`", table, re.M))
    packages = {f"{p.parent.relative_to(ROOT).as_posix()}/" for top in ("utils", "distributed", "training", "networks",
                                                                    "kernels")
                for p in (ROOT / top).rglob("__init__.py")} - {"utils/", "training/"}
    assert packages - listed == set(), f"packages missing from the README's map: {sorted(packages - listed)}"
    assert all((ROOT / folder).is_dir() for folder in listed), sorted(f for f in listed if not (ROOT / f).is_dir())
