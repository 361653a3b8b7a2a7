"""The documentation builds: ``mkdocs build --strict`` (a broken link, a missing anchor or a page left out of the
navigation fails), every page of ``docs/`` is in the navigation, and the README stays short with links that
resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify
from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README_MAX_LINES = 250


def nav_pages(nav) -> list[str]:
    """The page paths of an mkdocs ``nav`` (nested lists of ``{title: path or list}``)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in nav_pages(item)]
    return [p for value in nav.values() for p in nav_pages(value)]


def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    config = YAML(typ="safe", pure=True).load((REPO / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["strict"] is True
    nav = nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages, f"not in the nav: {set(pages) - set(nav)}; missing: {set(nav) - set(pages)}"


def headings(path: Path) -> set[str]:
    """The anchors mkdocs gives ``path``'s headings (Python-Markdown's toc slugs)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slugify(m.group(1).strip(), "-") for m in re.finditer(r"^#+\s+(.+)$", text, re.M)}


def test_readme_is_short_and_its_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "|---|" not in text.split("## Map of the code")[0].split("## Documentation")[0], \
        "measurement tables belong in docs/speed.md"
    links = re.findall(r"\]\((?!https?:)([^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert links
    for target, anchor in links:
        path = REPO / target
        assert path.exists(), f"README links to a missing {target}"
        if anchor:
            assert anchor in headings(path), f"README links to #{anchor}, which {target} lacks"


def test_readme_and_the_config_list_give_tiny_the_same_time():
    """``make train``'s time in the README is what ``--list-configs`` says of tiny (they once said half a minute
    and 20 s), and where the README lists a run's checkpoints it names how many are kept."""
    from utils.config.command_line import config_list
    from utils.config.schema import KEYS
    text = (REPO / "README.md").read_text()
    claim = re.search(r"trains the tiny ViT \(([^)]*)\)", text).group(1)
    assert claim in config_list(), (claim, config_list())
    assert f"the newest {KEYS['keep_checkpoints'].default} kept: `--keep_checkpoints`" in text


NUMBERED_RUN = re.compile(r"runs/[\w.-]+/\d+(?:CPU|GPU)/(\d+)\b")  # <expdir>/<config>/<N>CPU/<run_num>


def test_documented_commands_name_their_runs():
    """A command of the docs reads a run by its number only when it is the tour's ``00`` (what ``make train`` leaves);
    a recipe names its runs with ``--run_num``: the next free number depends on the runs made before it (after the
    tour, ``runs/tiny/1CPU/01`` is the tour's lr 1e-3 run, not the recipe's)."""
    numbered = []
    for page in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        in_bash = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_bash = line.strip() == "```bash"
            elif in_bash:
                numbered += [f"{page.name}:{number}: {m.group(0)}" for m in NUMBERED_RUN.finditer(line)
                             if m.group(1) != "00"]
    assert not numbered, numbered
