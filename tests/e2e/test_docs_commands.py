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

A ```text block after ``<!-- output -->`` quotes the output of the ```bash block just above it; after
``<!-- output of: COMMAND -->``, that of the page's earlier command COMMAND. Every line it quotes must be a
line of that output, in order, the first one its first line unless the quote opens with ``...``
(:func:`compare_quoted`), compared as far as it is the same on every machine:
every word (file names, integers: counts, lead times) exactly; every number with a decimal point or an exponent
to a relative tolerance of :data:`RTOL` (3 %), each number on its own (``|a - b| <= RTOL * max(|a|, |b|)``);
and the values that differ from run to run not at all (:data:`VOLATILE`: timestamps, durations, throughput,
memory, the iteration a signal lands at). A line ``...`` stands for lines left out, and ``...`` in a line for
text left out.

Why 3 %: float32 sums come out in another order on another CPU (ATen's vector kernels per
``ATEN_CPU_CAPABILITY``, MKL's per instruction set) or thread count. Measured on the README's tour (one AVX-512
machine, under ``ATEN_CPU_CAPABILITY`` ``avx512``, ``avx2`` and ``default``, MKL and oneDNN limited to AVX2 and
SSE4.2, against the README's quotes from another machine): the quoted losses, RMSE, ACC, persistence,
climatology and blurring differ at most by one unit of their last digit (relative 1.04e-3: ``0.961`` for
``0.962``), while the model's bias, the mean of errors that nearly cancel (0.0054 where the RMSE is 1.38),
moves by up to 2.7 % (``0.00539`` quoted, ``0.00554`` printed under ``avx2``). 3 % is the tightest round figure
above that; a quoted number off by more, or any word changed, fails (:func:`test_quoted_output_is_compared`).

To keep the runs short: every ``train.py``/``train_mp.py`` run of ``docs/`` draws no TensorBoard figures
(``--figure_every 0`` appended where the command does not set it: matplotlib takes about 0.5 s a validation, and
``tests/multiprocess/test_training.py`` tests the figures) and trains ``--num_iters`` scaled by
:data:`SCALE` (tiny's 800 iterations become 8; appended where the command gives none), on the fixture's
small dataset; ``make train`` runs the Makefile's training line without the set-up; a ``sleep`` waits at most
:data:`MAX_SLEEP` seconds. A run sent to the background (to be signalled), and the same command run again to
resume it, train by :data:`BACKGROUND_SCALE` instead (400 iterations, seconds), so that the signal lands while
the run is still going.
The README runs as written, on the Makefile's data, so that its quoted numbers are the ones it produces.

The ``python`` of every command is :mod:`tests.forked_python`'s: the run forks from a server that has torch,
dynamo and matplotlib imported (seconds of CPU a command, most of a short command's time) and otherwise behaves
as a fresh interpreter to the shell (status, output, signals, ``$!``); so do the workers torchrun starts (its
``PYTHON_EXEC``).
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
from tests.forked_python import ForkingPython

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP_TAGS = {"GPU": "needs a GPU", "SLURM": "needs a SLURM cluster", "server": "runs until stopped",
             "long": "takes minutes to hours", "input": "needs a file the reader supplies",
             "edits": "changes files of the repository"}
SCALE = 8 / 800  # iterations of a documented training command that the test trains: one epoch of the fixture
BACKGROUND_SCALE = 400 / 800  # the same for a run sent to the background: it outlasts MAX_SLEEP (80 did not
# always: a CI run finished them inside the 2 s sleep, and the signal found no process)
MAX_SLEEP = 2  # seconds
MIN_RUN = 35  # commands run over all pages at least: a parser that stops finding them fails here
# what the working copy does not link to: outputs of the commands, and what they must not change
NOT_LINKED = {"runs", "data", "compare_runs", "site", ".git", ".venv", "build", "__pycache__", ".pytest_cache"}
TRAIN = re.compile(r"\b(?:train|train_mp)\.py\b")
NO_TRAINING = ("--help", "-h", "--list-configs", "--list_configs", "--print-config", "--print_config")
OUTPUT_MARK = re.compile(r"<!-- output(?: of: (.+?))? -->")
# values that differ from run to run, masked in quoted and produced lines alike
VOLATILE = [(re.compile(p), r) for p, r in (
    (r"^\d\d:\d\d:\d\d ", ""),  # the log's timestamps (the docs leave them out)
    (r"\b\d+(?:\.\d+)? s\b", "# s"), (r"\b[\d.]+ samples/s", "# samples/s"), (r"data wait \d+%", "data wait #%"),
    (r"peak RSS [\d.]+ GiB", "peak RSS # GiB"), (r"\biteration \d+", "iteration #"), (r"step_\d+", "step_#"),
    (r"\(epoch \d+, step \d+ of it\)", "(epoch #, step # of it)"))]
VOLATILE_COLUMNS = ("samples/s", "GiB")  # of compare_runs' table: throughput and memory of a busy machine
RTOL = 3e-2  # relative tolerance of a quoted number with a decimal point or exponent (module docstring: why)
NUMBER = r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"


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


@dataclass
class Quote:
    """A ```text block quoting the output of the commands ``of`` (indices into the page's commands)."""

    page: str
    line: int
    of: list[int]
    lines: list[str] = field(default_factory=list)


def page_commands(path: Path) -> list[Command]:
    """The commands of the ```bash blocks of ``path``, continuation lines joined."""
    return parse_page(path)[0]


def parse_page(path: Path) -> tuple[list[Command], list[Quote]]:
    """The commands of the ```bash blocks of ``path`` (continuation lines joined) and its quoted outputs."""
    out, quotes, block, pending, start = [], [], "", "", 0
    last_block: list[int] = []  # the commands of the latest ```bash block
    marked: Quote | None = None  # a quote announced by an output mark, its ```text block next
    page = path.relative_to(REPO).as_posix()
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        mark = OUTPUT_MARK.fullmatch(stripped)
        if mark and not block:
            of = [i for i, c in enumerate(out) if c.text == mark.group(1)][:1] if mark.group(1) else last_block
            assert of, f"{page}:{number}: no command {mark.group(1) or 'above'} to quote"
            marked = Quote(page, number, list(of))
            continue
        if stripped.startswith("```"):
            if block == "text" and marked:
                quotes.append(marked)
                marked = None
            opening = stripped[3:] if not block else ""
            block = opening if opening else ""
            if block == "bash":
                last_block = []
            continue
        if block == "text" and marked:
            marked.lines.append(raw)
            continue
        if block != "bash" or not stripped:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text, comment = split_comment(pending + stripped)
        pending = ""
        if text:
            last_block.append(len(out))
            out.append(command(page, start, text, comment))
    return out, quotes


def normalized(lines: list[str]) -> list[str]:
    """``lines`` with :data:`VOLATILE` values masked, spaces collapsed, and the :data:`VOLATILE_COLUMNS` of a
    table (the tokens under those headers) masked."""
    out, columns = [], None
    for line in lines:
        for pattern, repl in VOLATILE:
            line = pattern.sub(repl, line)
        tokens = line.split()
        if any(c in tokens for c in VOLATILE_COLUMNS):
            columns = (len(tokens), [i for i, t in enumerate(tokens) if t in VOLATILE_COLUMNS])
        elif columns and len(tokens) == columns[0]:
            tokens = ["#" if i in columns[1] else t for i, t in enumerate(tokens)]
        else:
            columns = None if not tokens else columns
        out.append(" ".join(tokens))
    return out


def line_pattern(want: str) -> tuple[re.Pattern, list[str]]:
    """A pattern matching the lines that have the words of the (normalized) quoted line ``want`` (``...`` for any
    text) with any numbers where it has numbers, capturing them; and ``want``'s numbers, in order."""
    parts, numbers = [], []
    for segment in want.split("..."):
        pieces, at = [], 0
        for number in re.finditer(NUMBER, segment):
            pieces += [re.escape(segment[at:number.start()]), f"({NUMBER})"]
            numbers.append(number.group())
            at = number.end()
        parts.append("".join(pieces) + re.escape(segment[at:]))
    return re.compile(".*".join(parts)), numbers


def numbers_agree(quoted: str, printed: str, rtol: float = RTOL) -> bool:
    """Whether a printed number is the quoted one: integers (counts) exactly, others to ``rtol`` relative."""
    if not re.search(r"[.eE]", quoted + printed):
        return quoted == printed
    a, b = float(quoted), float(printed)
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def compare_quoted(quote: Quote, produced: str, rtol: float = RTOL) -> str | None:
    """Why ``quote`` is not ``produced`` (its lines in order, as the module docstring says), or None."""
    have = normalized(produced.splitlines())
    at = next((i for i, line in enumerate(have) if line), 0)
    first = True  # a quote that does not open with "..." opens with the output's first line
    for raw, want in zip(quote.lines, normalized(quote.lines)):
        if want == "...":
            first = False
        if want in ("", "..."):
            continue
        pattern, numbers = line_pattern(want)
        match, near = None, None
        for i in range(at, at + 1 if first else len(have)):
            found = pattern.fullmatch(have[i])
            if not found:
                continue
            off = [(q, p) for q, p in zip(numbers, found.groups()) if not numbers_agree(q, p, rtol)]
            if not off:
                match = i
                break
            near = near or (i, off)
        if match is None and first and near is None:
            shown = have[at] if at < len(have) else "(nothing)"
            return f"{quote.page}:{quote.line}: the quote opens with {raw.strip()!r}, but the output with {shown!r}: " \
                "quote the first line too, or open the quote with a line '...'"
        if match is None:
            why = "" if near is None else f"; its line {near[0]} has its words, but " + ", ".join(
                f"{p} for {q}" for q, p in near[1]) + f" (beyond the relative tolerance {rtol:g})"
            return f"{quote.page}:{quote.line}: the quoted line {raw.strip()!r} is not in the output (after line " \
                f"{at} of it){why}"
        at, first = match + 1, False
    return None


def command(page: str, line: int, text: str, comment: str) -> Command:
    cmd = Command(page, line, " ".join(text.split()))
    tag = re.match(r"(\w+)\b", comment)
    if tag and tag.group(1) in SKIP_TAGS:
        cmd.skip = f"{tag.group(1)}: {SKIP_TAGS[tag.group(1)]}"
    elif re.match(r"make\b", cmd.text) and cmd.text != "make train":
        cmd.skip = "make: sets up the environment"
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


def runnable(cmd: Command, scaled: bool = True, scale: float = SCALE) -> str:
    """The shell text the test runs for ``cmd``: shortened as the module docstring says, its iterations by
    ``scale`` (as written: not ``scaled``)."""
    text = makefile_training() if cmd.text == "make train" else cmd.text
    if not scaled:
        return text
    text = re.sub(r"\bsleep (\d+)", lambda m: f"sleep {min(int(m.group(1)), MAX_SLEEP)}", text)
    if not TRAIN.search(text) or any(flag in text.split() for flag in NO_TRAINING) or cmd.status == 2:
        return text  # nothing trains (an expected error stops before)
    assert not re.search(r";|&&|\|", text), f"{cmd.page}:{cmd.line}: keep a training command alone on its line"
    body, background = (text[:-1].rstrip(), " &") if text.endswith("&") else (text, "")
    added = "" if "--figure_every" in body else " --figure_every 0"
    if re.search(r"--num_iters[ =]\d+", body):
        body = re.sub(r"--num_iters([ =])(\d+)",
                      lambda m: f"--num_iters{m.group(1)}{max(1, round(int(m.group(2)) * scale))}", body)
    else:
        added += f" --num_iters {round(800 * scale)}"
    return f"{body}{added}{background}"


def script(commands: list[Command], logs: Path, scaled: bool = True) -> str:
    """A bash script running ``commands`` in order in one shell (so ``$!`` reaches the next line), checking each
    one's status and output; it prints ``ran N (S s)`` after each command that passed."""
    lines = ["set -u"]
    background = {c.text[:-1].rstrip() for c in commands if c.text.endswith("&")}
    for n, cmd in enumerate(commands):
        scale = BACKGROUND_SCALE if cmd.text.removesuffix("&").rstrip() in background else SCALE
        log, text = logs / f"{n}.log", runnable(cmd, scaled, scale)
        lines += [f"export PET_MASTER_PORT={free_port()} MASTER_PORT={free_port()}",
                  f"echo '$ {cmd.page}:{cmd.line}: '{quote(text)}",
                  "t0=$SECONDS", "{", text, f"}} > {log} 2>&1", "status=$?", f"cat {log}"]
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
    ``data/tiny`` (a copy of ``data``), and nothing beside it (the project ships what its docs use)."""
    checkout = root / "checkout"
    checkout.mkdir(parents=True)
    for item in REPO.iterdir():
        if item.name not in NOT_LINKED and not item.name.endswith(".egg-info"):
            (checkout / item.name).symlink_to(item)
    shutil.copytree(data, checkout / "data" / "tiny")
    return checkout


def run_page(commands: list[Command], checkout: Path, logs: Path, python: ForkingPython,
             scaled: bool = True) -> subprocess.CompletedProcess:
    """Run ``commands`` (:func:`script`) in ``checkout`` with the forking ``python``."""
    logs.mkdir(parents=True, exist_ok=True)
    env = python.env(subprocess_env(PATH=f"{Path(sys.executable).parent}:{subprocess_env()['PATH']}"))
    return subprocess.run(["bash", "-c", script(commands, logs, scaled)], cwd=checkout, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1200 if not scaled else 600)


@pytest.fixture(scope="session")
def makefile_data(tmp_path_factory) -> Path:
    """The data ``make train`` trains on (the Makefile's data target), for the README's run as written."""
    from utils.preprocess.synthetic_dataset import make_synthetic_dataset
    return make_synthetic_dataset(tmp_path_factory.mktemp("make_data") / "tiny", channels=4, img_size=(32, 64),
                                  train_years=4, steps_per_year=128, seed=0)


@pytest.fixture(scope="session")
def trained_runs(tiny_data, tmp_path_factory, forking_python) -> Path:
    """``runs/`` after ``make train`` in a working copy: the state every page but the README starts from."""
    root = tmp_path_factory.mktemp("docs_seed")
    checkout = working_copy(root, tiny_data)
    result = run_page([Command("Makefile", 0, "make train")], checkout, root / "logs", forking_python)
    assert result.returncode == 0, result.stdout[-3000:]
    return checkout / "runs"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_documented_commands_run(page, tiny_data, tmp_path, request, forking_python):
    every, quotes = parse_page(page)
    commands = [c for c in every if c.skip is None]
    if not commands:
        pytest.skip(f"{page.name}: no command runs on a CPU")
    readme = page.name == "README.md"  # run as written: its quoted numbers are checked
    checkout = working_copy(tmp_path, request.getfixturevalue("makefile_data") if readme else tiny_data)
    if not readme:
        shutil.copytree(request.getfixturevalue("trained_runs"), checkout / "runs")
    result = run_page(commands, checkout, tmp_path / "logs", forking_python, scaled=not readme)
    ran = re.findall(r"^ran (\d+) ", result.stdout, re.M)
    assert result.returncode == 0 and ran and int(ran[-1]) == len(commands), result.stdout[-6000:]
    logs = {id(c): tmp_path / "logs" / f"{n}.log" for n, c in enumerate(commands)}
    for q in quotes:
        assert all(every[i].skip is None for i in q.of), f"{q.page}:{q.line} quotes a command the test skips"
        problem = compare_quoted(q, "".join(logs[id(every[i])].read_text() for i in q.of))
        assert problem is None, problem


def test_quoted_output_is_compared():
    """The comparison lets volatile values differ and numbers move within the tolerance (as another CPU prints
    them), and finds a quoted number beyond it, a changed word, a changed count or a lost line."""
    quote = Quote("p", 1, [0], ["epoch 13/13 | 1.08 s | 325.8 samples/s | data wait 15% | valid loss 0.0931 | sp 56.07",
                               "...", "skill over 120 initial times ..."])
    produced = ("12:00:01 epoch 13/13 | 2.50 s | 99.0 samples/s | data wait 3% | valid loss 0.0931 | sp 56.07\n"
                "x\nskill over 120 initial times (RMSE and bias in channel units)\n")
    assert compare_quoted(quote, produced) is None
    # what another CPU prints: a last digit, a bias 2.7 % off (README's 0.00539, 0.00554 under avx2)
    assert compare_quoted(quote, produced.replace("56.07", "56.06").replace("0.0931", "0.0935")) is None
    assert compare_quoted(Quote("p", 1, [0], ["036h 1.384 0.00539"]), "036h 1.384 0.00554\n") is None
    # a number beyond the tolerance: the message names it
    problem = compare_quoted(quote, produced.replace("0.0931", "0.0962"))  # 3.2 %
    assert problem and "valid loss 0.0931" in problem and "0.0962 for 0.0931" in problem, problem
    assert compare_quoted(quote, produced.replace("56.07", "57.9")) is not None
    assert compare_quoted(Quote("p", 1, [0], ["036h 1.384 0.00539"]), "036h 1.384 -0.00539\n") is not None
    # a word, a count (integers exactly), a lost line
    assert compare_quoted(quote, produced.replace("valid loss", "train loss")) is not None
    assert compare_quoted(quote, produced.replace("sp 56", "t2m 56")) is not None
    assert compare_quoted(quote, produced.replace("120 initial", "121 initial")) is not None
    assert compare_quoted(quote, produced.replace("epoch 13/13", "epoch 12/13")) is not None
    assert compare_quoted(quote, produced.replace("skill over", "skill at")) is not None
    # the output's first line left out of a quote that does not open with "..." (#45 item 17)
    problem = compare_quoted(quote, "model: tiny/1CPU/00 at step 800\n" + produced)
    assert problem and "the output with 'model: tiny/1CPU/00 at step 800'" in problem, problem
    assert compare_quoted(Quote("p", 1, [0], ["...", *quote.lines]), "model: tiny/1CPU/00\n" + produced) is None
    table = ["run lr samples/s MFU GiB retries loss", "00 0.002 9.9 - 0.51 - 0.07792"]
    assert compare_quoted(Quote("p", 1, [0], table), "run lr samples/s MFU GiB retries loss\n"
                                                      "00 0.002 12.5 - 0.47 - 0.07792\n") is None
    assert compare_quoted(Quote("p", 1, [0], table), "run lr samples/s MFU GiB retries loss\n"
                                                      "00 0.002 12.5 - 0.47 - 0.08100\n") is not None
    assert compare_quoted(Quote("p", 1, [0], table), "run lr samples/s MFU GiB retries loss\n"
                                                      "01 0.002 12.5 - 0.47 - 0.07792\n") is not None


def test_numbers_agree_to_the_relative_tolerance():
    """Each number on its own, relative to the larger of the two: the tolerance's edge, signs, exponents, and
    integers (counts) exactly."""
    assert RTOL == 3e-2
    assert numbers_agree("100.0", "97.0") and not numbers_agree("100.0", "96.9")
    assert numbers_agree("-6.57e-05", "-6.4e-05") and not numbers_agree("-6.57e-05", "6.57e-05")
    assert numbers_agree("0.961", "0.962") and numbers_agree("1", "0.999")  # a %g value printed as an integer
    assert numbers_agree("800", "800") and not numbers_agree("800", "801") and not numbers_agree("00", "0")
    assert not numbers_agree("0.961", "0.962", rtol=1e-3)


def test_enough_documented_commands_run():
    """The parser finds the commands (a broken one would let every page pass with nothing run), and every
    command it skips says why."""
    commands = [c for page in PAGES for c in page_commands(page)]
    run = [c for c in commands if c.skip is None]
    assert len(run) >= MIN_RUN, [f"{c.page}:{c.line}" for c in run]
    assert any(c.text == "make train" for c in run) and any(c.status == 75 for c in run)
    assert all(c.skip for c in commands if c not in run)
