"""Nothing of ours lands on other programs' import path: installing the project installs no package of its own,
so a generic name (``distributed``, ``utils``) stays another package's, dask's ``distributed`` included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("utils", "distributed", "training", "tools", "networks", "kernels")
MARKER = "DASK_DISTRIBUTED = True  # stands for dask's package\n"


def _where(module: str, path: str, cwd: Path) -> str:
    """The file ``import module`` finds with ``path`` on PYTHONPATH, run from ``cwd`` ("" when none)."""
    code = (f"import importlib.util as u; s = u.find_spec({module!r}); "
            "print(s.origin if s else '')")
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_an_install_beside_dask_distributed_changes_nothing(tmp_path):
    site = tmp_path / "site"
    dask = site / "distributed"
    dask.mkdir(parents=True)
    (dask / "__init__.py").write_text(MARKER)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(site), str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (dask / "__init__.py").read_text() == MARKER  # not overwritten
    installed = {p.name for p in site.iterdir()}
    assert not installed & set(OURS) - {"distributed"}, installed
    assert any(name.startswith("era5_vit") for name in installed)  # the project did install (metadata)
    assert _where("distributed", str(site), tmp_path) == str(dask / "__init__.py")


def test_the_projects_environment_exposes_none_of_our_packages(tmp_path):
    """From outside the repository, in the environment the tests run in, our package names find nothing of ours."""
    for name in OURS:
        found = _where(name, "", tmp_path)
        assert not found.startswith(str(ROOT)), f"{name} -> {found}"


def test_a_script_saved_outside_the_repository_imports_the_project_the_documented_ways(tmp_path):
    """docs/python-api.md: from the root with ``PYTHONPATH=.``, or from anywhere with the root put on sys.path; plain
    ``python script.py`` puts the script's folder on sys.path instead, and does not find the project."""
    body = "from training import evaluation\nprint(evaluation.__file__)\n"  # the package of the Forecaster
    (tmp_path / "plain.py").write_text(body)
    (tmp_path / "inserted.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n{body}")

    def run(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
        clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return subprocess.run([sys.executable, str(tmp_path / script)], cwd=cwd, env={**clean, **env},
                              capture_output=True, text=True)
    for done in (run("plain.py", ROOT, PYTHONPATH="."), run("inserted.py", tmp_path)):
        assert done.returncode == 0, done.stderr[-2000:]
        assert Path(done.stdout.strip()) == ROOT / "training" / "evaluation" / "__init__.py"
    assert "No module named 'training'" in run("plain.py", ROOT).stderr


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (rootdir-relative ``importmode=prepend``, no ``__init__.py`` in the
    test folders): two files of one name in different folders stop the whole suite's collection with "import file
    mismatch" (it happened twice, unit/multiprocess and multiprocess/gpu), so this fails first and names them."""
    seen: dict[str, list[str]] = {}
    for f in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(f.name, []).append(f.relative_to(ROOT).as_posix())
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
