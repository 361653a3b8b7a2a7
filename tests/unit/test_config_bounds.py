"""Config parsing does bounded work with one-line errors whatever the file or command line holds: aliases are
walked once, nesting is bounded before the recursive composer runs, an integer never passes through a float,
names that become folders are plain names, and flags that need a value get one."""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.config.command_line import cli_config
from utils.config.loading import MAX_DEPTH, load_config, read_yaml, show_value
from utils.config.types import FLOAT_INT_MAX, INT_MAX, coerce
from utils.core.errors import UserError


def alias_bomb(levels: int = 12, width: int = 10) -> str:
    """``levels`` anchors, each a list of ``width`` aliases of the one before: about width**levels items when
    expanded, in a few hundred bytes (the issue's 845-byte file hung the duplicate-key check)."""
    lines = ["l0: &l0 [" + ",".join(["1"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_nested_aliases_are_walked_once(tmp_path):
    with pytest.raises(UserError, match="must map config names to settings"):
        read_yaml(write(tmp_path, alias_bomb()))


def test_an_alias_bomb_as_a_value_is_refused_with_a_short_line(tmp_path):
    text = "bomb:\n" + "".join(f"  {line}\n" for line in alias_bomb().splitlines()) + "a:\n  img_size: *l11\n"
    with pytest.raises(UserError) as err:
        load_config(write(tmp_path, text), "a")
    assert "img_size expects" in str(err.value) and len(str(err.value)) < 400, str(err.value)[:500]


def test_a_self_referring_anchor_is_named(tmp_path):
    with pytest.raises(UserError, match=r"line 1 has an anchor that refers to itself \(\*a inside &a\)"):
        read_yaml(write(tmp_path, "a: &a\n  b: *a\n"))


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000])
def test_deep_nesting_is_named_as_such(tmp_path, depth):
    with pytest.raises(UserError, match=f"nested more than {MAX_DEPTH} levels deep") as err:
        read_yaml(write(tmp_path, "a:\n  b: " + "[" * depth + "]" * depth + "\n"))
    assert "anchor" not in str(err.value)


def test_shipped_configs_still_parse():
    assert "tiny" in read_yaml("config/ViT.yaml")


@pytest.mark.parametrize("raw", ["1.0e100", 1.0e100, 2.0 ** 60, str(10 ** 30), 10 ** 30, "9" * 5000, "1e400"])
def test_integers_never_pass_through_a_float(raw):
    with pytest.raises(ValueError, match="expects an integer"):
        coerce(raw, int)


@pytest.mark.parametrize("raw,want", [("1e3", 1000), (2.0, 2), (str(INT_MAX), INT_MAX), (FLOAT_INT_MAX * 1.0,
                                                                                      FLOAT_INT_MAX), ("-7", -7)])
def test_integers_that_are_exact(raw, want):
    value = coerce(raw, int)
    assert value == want and type(value) is int


def test_num_iters_1e100_is_one_line():
    with pytest.raises(UserError, match=r"--num_iters expects an integer \(write it in digits"):
        load_config("config/ViT.yaml", "tiny", {"num_iters": "1.0e100"})


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".", "a\nb"])
def test_config_names_are_plain_names(name):
    with pytest.raises(UserError, match="--config"):
        load_config("config/ViT.yaml", name)


@pytest.mark.parametrize("argv", [["--config"], ["--config", "--lr", "1"], ["--yaml_config"],
                                  ["--config", "tiny", "--yaml_config", "--depth", "2"]])
def test_a_bare_config_flag_is_an_error(argv):
    with pytest.raises(UserError, match="needs a value"):
        cli_config(argv, "tiny")


def test_show_value_is_bounded():
    nested = [[list(range(1000))] * 1000] * 1000  # a billion items if walked whole
    assert len(show_value(nested)) < 100
    assert show_value("x") == "'x'" and show_value([1, 2]) == "[1,2]" and show_value(None) == "null"
