"""No command line takes an abbreviated option (``--lead_step`` once ran as ``--lead_steps`` and overwrote
results), and a near miss gets the closest options, as ``train.py``'s keys do."""

import ast
from pathlib import Path

import pytest

from utils.core.errors import ArgumentParser
from training.evaluation.evaluate_run import build_parser

REPO = Path(__file__).resolve().parents[2]


def test_an_abbreviation_is_an_unknown_option_with_the_closest_named(capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["--run_dir", "runs/tiny/1CPU/00", "--lead_step", "8"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unrecognized arguments: --lead_step; did you mean --lead_steps") and \
        err.endswith("; see --help\n") and err.count("\n") == 1, err


def test_the_shared_parser_takes_whole_options_only(capsys):
    parser = ArgumentParser(allow_abbrev=True)  # asked for, and still refused
    parser.add_argument("--expdir")
    assert parser.parse_args(["--expdir", "x"]).expdir == "x"
    with pytest.raises(SystemExit):
        parser.parse_args(["--exp", "x"])
    assert capsys.readouterr().err == "error: unrecognized arguments: --exp; did you mean --expdir?; see --help\n"


def parsers_built(path: Path) -> list[tuple[int, bool]]:
    """(line, takes no abbreviation) of each ArgumentParser(...) call of ``path``: the project's own, or
    argparse's with ``allow_abbrev=False``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ArgumentParser":
            ours = isinstance(node.func, ast.Name)
            off = any(k.arg == "allow_abbrev" and getattr(k.value, "value", True) is False for k in node.keywords)
            out.append((node.lineno, ours or off))
    return out


def test_every_command_line_of_the_project_refuses_abbreviations():
    files = [p for p in REPO.rglob("*.py") if not {".venv", "tests"} & set(p.relative_to(REPO).parts)]
    built = {f"{p.relative_to(REPO)}:{line}": ok for p in files for line, ok in parsers_built(p)}
    assert len(built) >= 15, built  # the tools, evaluate.py, the benchmarks, the examples
    assert all(built.values()), [where for where, ok in built.items() if not ok]


def test_the_torchrun_wrapper_refuses_abbreviations(capsys):
    from tools.torchrun import launch
    with pytest.raises(SystemExit) as stop:
        launch(["--nproc", "1", "train.py"])  # torchrun itself would take it as --nproc_per_node
    assert stop.value.code == 2 and "unrecognized arguments: --nproc" in capsys.readouterr().err
