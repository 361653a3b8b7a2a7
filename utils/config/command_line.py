"""The command line of the entry points: ``--help [KEY]``, ``--list-configs``, ``--print-config`` and key
overrides (:func:`cli_config`); the help texts and the docs' flag table are generated from the schema."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from utils.config.loading import DEFAULT_YAML, REPO, load_config, parse_overrides, read_yaml, to_yaml
from utils.config.schema import KEYS, SECTIONS, Config
from utils.config.types import choices, plain, type_name
from utils.core.errors import UserError, closest, run_cli

WIDTH = 80


def cli_config(argv: list[str], default_config: str, prog: str = "train.py") -> Config | None:
    """The config a command line asks for, or None after printing help, the config list or the config.

    Handles ``--help [KEY]`` / ``-h``, ``--list-configs`` and ``--print-config``; everything else is
    ``--yaml_config FILE --config NAME`` plus key overrides.

    Raises:
        UserError: any bad option or value.
    """
    if "--help" in argv or "-h" in argv:
        i = argv.index("--help" if "--help" in argv else "-h")
        topic = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else None
        yaml_path = parse_overrides([a for a in argv if a not in ("--help", "-h", topic)]).get(
            "yaml_config", DEFAULT_YAML)
        print(key_help(topic.lstrip("-").replace("-", "_"), yaml_path) if topic else full_help(prog, default_config))
        return None
    flags = {a for a in ("--list-configs", "--list_configs", "--print-config", "--print_config") if a in argv}
    overrides = parse_overrides([a for a in argv if a not in flags])
    yaml_path = overrides.pop("yaml_config", DEFAULT_YAML)
    name = overrides.pop("config", default_config)
    if flags & {"--list-configs", "--list_configs"}:
        print(config_list(yaml_path))
        return None
    cfg = load_config(yaml_path, name, overrides)
    if flags:
        print(to_yaml(cfg), end="")
        return None
    return cfg


def full_help(prog: str = "train.py", default_config: str = "tiny") -> str:
    """``--help``: every key by section with type, default and doc (``--config``'s too: ``default_config``, the
    entry point's), at most 80 columns wide."""
    lines = [f"usage: python {prog} [--config NAME] [--yaml_config FILE] [--KEY VALUE ...]",
             f"       python {prog} --help [KEY] | --list-configs | --print-config",
             "",
             *textwrap.wrap("Values: --key value or --key=value; a bare --flag means true (true/false keys); "
                            "numbers in decimal digits; lists as [a,b]; null where the type allows it; a key given "
                            "twice takes its last value. Keys can also be set in the YAML config.", WIDTH),
             "",
             f"  --config NAME          named config (default {default_config}; --list-configs lists them)",
             f"  --yaml_config FILE     named configs (default {DEFAULT_YAML})"]
    for attr, (_, title) in SECTIONS.items():
        lines += ["", f"{title}:"]
        for spec in (s for s in KEYS.values() if s.section == attr):
            head, doc = f"  --{spec.name} {type_name(spec.type)}  (default {_show_plain(spec.default)})", spec.doc
            if len(head) > WIDTH:  # long choice lists go below the key
                head = f"  --{spec.name} CHOICE  (default {_show_plain(spec.default)})"
                doc += f"; one of {', '.join(map(str, choices(spec.type)))}"
            lines.append(head)
            lines += textwrap.wrap(doc, WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                   break_on_hyphens=False)
    return "\n".join(lines)


def key_help(name: str, yaml_path: str | Path = DEFAULT_YAML) -> str:
    """``--help KEY``: one key's section, type, default, doc and the named configs that change it.

    Raises:
        UserError: unknown key (naming the closest).
    """
    if name not in KEYS:
        raise UserError(f"--help {name}: unknown config key{closest(name, KEYS)}")
    spec = KEYS[name]
    lines = [f"--{name} {type_name(spec.type)}", f"  section: {SECTIONS[spec.section][1]}",
             f"  default: {_show_plain(spec.default)}"]
    if spec.check is not None:
        lines.append(f"  allowed: {spec.check.text}")
    lines += textwrap.wrap(spec.doc, WIDTH, initial_indent="  ", subsequent_indent="  ")
    try:
        configs = read_yaml(yaml_path)
    except UserError:
        configs = {}
    changed = [f"{n} {_show_plain(v)}" for n, v in ((n, c.get(name, spec.default)) for n, c in configs.items())
               if plain(v) != plain(spec.default)]
    if changed:
        lines += textwrap.wrap(f"set by named configs: {', '.join(changed)}", WIDTH, initial_indent="  ",
                               subsequent_indent="    ")
    return "\n".join(lines)


def config_list(yaml_path: str | Path = DEFAULT_YAML) -> str:
    """``--list-configs``: each named config with its one-line description."""
    configs = read_yaml(yaml_path)
    width = max(map(len, configs)) + 2
    return "\n".join(n.ljust(width) + textwrap.shorten(str(c.get("description", "")), WIDTH - width, placeholder="...")
                     for n, c in configs.items())


def _show_plain(value: Any) -> str:
    value = plain(value)
    return "null" if value is None else json.dumps(value) if isinstance(value, (list, bool)) else str(value)


def markdown_flags() -> str:
    """The flag table of ``docs/configs.md``, generated from the schema (``tests/unit/test_config.py`` keeps them
    equal)."""
    rows = ["| flag | type | default | meaning |", "|---|---|---|---|"]
    for attr, (_, title) in SECTIONS.items():
        rows.append(f"| **{title}** | | | |")
        for spec in (s for s in KEYS.values() if s.section == attr):
            kind = type_name(spec.type).replace("|", "\\|")
            rows.append(f"| `--{spec.name}` | `{kind}` | `{_show_plain(spec.default)}` | {spec.doc} |")
    return "\n".join(rows)


FLAGS_DOC = REPO / "docs" / "configs.md"  # the page holding the generated flag table
FLAGS_START, FLAGS_END = "<!-- flags:start -->", "<!-- flags:end -->"


def update_docs(path: Path = FLAGS_DOC) -> None:
    """Replace the generated flag table of ``path`` (between the ``flags:start``/``flags:end`` markers).

    Raises:
        UserError: ``path`` lacks one of the markers, or has either more than once.
    """
    text = path.read_text()
    if text.count(FLAGS_START) != 1 or text.count(FLAGS_END) != 1:
        raise UserError(f"{path} needs one {FLAGS_START} and one {FLAGS_END} line around the flag table")
    head, rest = text.split(FLAGS_START)
    tail = rest.split(FLAGS_END)[1]
    path.write_text(f"{head}{FLAGS_START}\n{markdown_flags()}\n{FLAGS_END}{tail}")


def update_docs_command(argv: list[str]) -> None:
    """``python -m utils.config.command_line --update-docs``: :func:`update_docs` of docs/configs.md.

    Raises:
        UserError: other arguments, or the page's markers (:func:`update_docs`).
    """
    if argv != ["--update-docs"]:
        raise UserError(f"unknown arguments {' '.join(argv) or '(none)'}; the one command is python -m "
                        "utils.config.command_line --update-docs")
    update_docs()


if __name__ == "__main__":
    sys.exit(run_cli(update_docs_command))
