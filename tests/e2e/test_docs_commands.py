"""Every command of the docs that can run on a CPU, run as the docs show it.

The shell commands of the ```bash blocks of ``README.md`` and ``docs/*.md`` run, page by page and in order, in a
working copy of the repository (symlinks to its code and configs, a copy of the ``tiny_data`` fixture as
``data/tiny``, ``../shared`` beside it): the README's from a fresh copy, the other pages' from one where
``make train`` already ran, as their text assumes. A trailing comment steers the test:

* a comment that starts with a tag (``GPU``, ``SLURM``, ``server``, ``long``, ``input``, ``edits``; see
  :data:`SKIP_TAGS`) skips the command, and says why in the docs too;
* ``exit N`` (or ``exit status N``) is the status the command must end with (default 0; a command sent to
  the background with ``&`` is not checked);
* ``says "TEXT"`` is a text its output must hold.

To keep the runs short: every ``train.py``/``train_mp.py`` run trains ``--num_iters`` scaled by
:data:`SCALE` (tiny's 800 iterations become 8; appended where the command gives none), on the fixture's
small dataset; ``make train`` runs the Makefile's training line without the set-up; a ``sleep`` waits at most
:data:`MAX_SLEEP` seconds (a signal sent then still lands during the run: its start-up alone takes longer).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.dist_utils import free_port, subprocess_env

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP_TAGS = {"GPU": "needs a GPU", "SLURM": "needs a SLURM cluster", "server": "runs until stopped",
             "long": "takes minutes to hours", "input": "needs a file the reader supplies",
             "edits": "changes files of the repository"}
SCALE = 8 / 800  # iterations of a documented training command that the test trains: one epoch of the fixture
MAX_SLEEP = 2  # seconds
MIN_RUN = 35  # commands run over all pages at least: a parser that stops finding them fails here
# what the working copy does not link to: outputs of the commands, and what they must not change
NOT_LINKED = {"runs", "data", "compare_runs", "site", ".git", ".venv", "build", "__pycache__", ".pytest_cache"}
TRAIN = re.compile(r"\b(?:train|train_mp)\.py\b")
NO_TRAINING = ("--help", "-h", "--list-configs", "--list_configs", "--print-config", "--print_config")


@dataclass
class Command:
    """One documented command: where it is, what runs, and what the test expects of it."""

    page: str
    line: int
    text: str
    skip: str | None = None
    status: int | None = 0
    says: list[str] = field(default_factory=list)


def split_comment(line: str) -> tuple[str, str]:
    """``line`` as (command, trailing comment without ``#``): a ``#`` outside quotes that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def page_commands(path: Path) -> list[Command]:
    """The commands of the ```bash blocks of ``path``, continuation lines joined."""
    out, block, pending, start = [], False, "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            block = stripped == "```bash"
            continue
        if not block or not stripped:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text, comment = split_comment(pending + stripped)
        pending = ""
        if text:
            out.append(command(path.relative_to(REPO).as_posix(), start, text, comment))
    return out


def command(page: str, line: int, text: str, comment: str) -> Command:
    cmd = Command(page, line, " ".join(text.split()))
    tag = re.match(r"(\w+)\b", comment)
    if tag and tag.group(1) in SKIP_TAGS:
        cmd.skip = f"{tag.group(1)}: {SKIP_TAGS[tag.group(1)]}"
    elif re.match(r"make\b", cmd.text) and cmd.text != "make train":
        cmd.skip = "make: sets up the environment"
    elif "../shared/" in cmd.text and not (REPO.parent / "shared").is_dir():
        cmd.skip = "no ../shared beside the repository"
    status = re.search(r"\bexit (?:status )?(\d+)", comment)
    cmd.status = None if cmd.text.endswith("&") else int(status.group(1)) if status else 0
    cmd.says = re.findall(r'says "([^"]+)"', comment)
    return cmd


def makefile_training() -> str:
    """The command ``make train`` runs once set up, as a user types it."""
    recipe = re.search(r"^train:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe, "Makefile has no train target"
    lines = [line.strip() for line in recipe.group(1).splitlines()]
    assert len(lines) == 1, lines
    return lines[0].replace("$(BIN)/python", "python")


def runnable(cmd: Command) -> str:
    """The shell text the test runs for ``cmd``: shortened as the module docstring says."""
    text = makefile_training() if cmd.text == "make train" else cmd.text
    text = re.sub(r"\bsleep (\d+)", lambda m: f"sleep {min(int(m.group(1)), MAX_SLEEP)}", text)
    if not TRAIN.search(text) or any(flag in text.split() for flag in NO_TRAINING) or cmd.status == 2:
        return text  # nothing trains (an expected error stops before)
    assert not re.search(r";|&&|\|", text), f"{cmd.page}:{cmd.line}: keep a training command alone on its line"
    if re.search(r"--num_iters[ =]\d+", text):
        return re.sub(r"--num_iters([ =])(\d+)",
                      lambda m: f"--num_iters{m.group(1)}{max(1, round(int(m.group(2)) * SCALE))}", text)
    body, background = (text[:-1].rstrip(), " &") if text.endswith("&") else (text, "")
    return f"{body} --num_iters {round(800 * SCALE)}{background}"


def script(commands: list[Command], logs: Path) -> str:
    """A bash script running ``commands`` in order in one shell (so ``$!`` reaches the next line), checking each
    one's status and output; it prints ``ran N (S s)`` after each command that passed."""
    lines = ["set -u"]
    for n, cmd in enumerate(commands):
        log = logs / f"{n}.log"
        lines += [f"export PET_MASTER_PORT={free_port()} MASTER_PORT={free_port()}",
                  f"echo '$ {cmd.page}:{cmd.line}: '{quote(runnable(cmd))}",
                  "t0=$SECONDS", "{", runnable(cmd), f"}} > {log} 2>&1", "status=$?", f"cat {log}"]
        if cmd.status is not None:
            lines.append(f'[ $status -eq {cmd.status} ] || {{ echo "FAILED: exit status $status, not {cmd.status}"; '
                         "exit 1; }")
        for text in cmd.says:
            lines.append(f"grep -qF -- {quote(text)} {log} || {{ echo FAILED: no {quote(text)} in the output; exit 1; }}")
        lines.append(f'echo "ran {n + 1} ($((SECONDS - t0)) s)"')
    return "\n".join(lines) + "\n"


def quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def working_copy(root: Path, data: Path) -> Path:
    """A checkout under ``root`` whose code, configs and docs are links to the repository's, with its own
    ``data/tiny`` (a copy of ``data``), and ``../shared`` beside it."""
    checkout = root / "checkout"
    checkout.mkdir(parents=True)
    for item in REPO.iterdir():
        if item.name not in NOT_LINKED and not item.name.endswith(".egg-info"):
            (checkout / item.name).symlink_to(item)
    shutil.copytree(data, checkout / "data" / "tiny")
    if (REPO.parent / "shared").is_dir():
        (root / "shared").symlink_to(REPO.parent / "shared")
    return checkout


def run_page(commands: list[Command], checkout: Path, logs: Path) -> subprocess.CompletedProcess:
    logs.mkdir(parents=True, exist_ok=True)
    env = subprocess_env(PATH=f"{Path(sys.executable).parent}:{subprocess_env()['PATH']}")
    return subprocess.run(["bash", "-c", script(commands, logs)], cwd=checkout, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)


@pytest.fixture(scope="session")
def trained_runs(tiny_data, tmp_path_factory) -> Path:
    """``runs/`` after ``make train`` in a working copy: the state every page but the README starts from."""
    root = tmp_path_factory.mktemp("docs_seed")
    checkout = working_copy(root, tiny_data)
    result = run_page([Command("Makefile", 0, "make train")], checkout, root / "logs")
    assert result.returncode == 0, result.stdout[-3000:]
    return checkout / "runs"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_documented_commands_run(page, tiny_data, tmp_path, request):
    commands = [c for c in page_commands(page) if c.skip is None]
    if not commands:
        pytest.skip(f"{page.name}: no command runs on a CPU")
    checkout = working_copy(tmp_path, tiny_data)
    if page.name != "README.md":
        shutil.copytree(request.getfixturevalue("trained_runs"), checkout / "runs")
    result = run_page(commands, checkout, tmp_path / "logs")
    ran = re.findall(r"^ran (\d+) ", result.stdout, re.M)
    assert result.returncode == 0 and ran and int(ran[-1]) == len(commands), result.stdout[-6000:]


def test_enough_documented_commands_run():
    """The parser finds the commands (a broken one would let every page pass with nothing run), and every
    command it skips says why."""
    commands = [c for page in PAGES for c in page_commands(page)]
    run = [c for c in commands if c.skip is None]
    assert len(run) >= MIN_RUN, [f"{c.page}:{c.line}" for c in run]
    assert any(c.text == "make train" for c in run) and any(c.status == 75 for c in run)
    assert all(c.skip for c in commands if c not in run)
