"""Named YAML configs and command-line overrides -> a typed :class:`utils.schema.Config`.

``config/ViT.yaml`` maps config names to flat ``key: value`` settings (anchors and ``<<:`` merge keys
allowed). The command line overrides any key as ``--key value``, ``--key=value``, a bare ``--flag``
(true) or a list ``--img_size [360,720]``. Every value is converted to the type the schema declares,
whatever its YAML spelling, and checked; a bad one is a :class:`UserError` naming the key, the place
it came from and the fix. ``--help [KEY]``, ``--list-configs`` and ``--print-config`` are generated
from the schema (:func:`cli_config`).
"""

from __future__ import annotations

import difflib
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from utils.errors import UserError
from utils.schema import KEYS, SECTIONS, Config, check_value, choices, coerce, plain, type_name

DEFAULT_YAML = "config/ViT.yaml"
REPO = Path(__file__).resolve().parents[1]
CLI_ONLY = ("config", "yaml_config")  # choose the named config; not part of it
WIDTH = 80


def closest(name: str, valid) -> str:
    """``"; did you mean a, b?"`` for the nearest of ``valid`` to ``name``, or ``""``."""
    near = difflib.get_close_matches(name, list(valid), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(near)}?" if near else ""


# ---------------------------------------------------------------- YAML
def read_yaml(path: str | Path) -> dict[str, dict]:
    """Parse a YAML file of named configs (merge keys resolved).

    Raises:
        UserError: missing file, invalid YAML, a key repeated inside one mapping (which YAML merge
            keys would otherwise resolve silently), or a document that is not ``name: {settings}``.
    """
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError
    path = Path(path)
    if not path.is_file() and not path.is_absolute() and (REPO / path).is_file():
        path = REPO / path  # the shipped configs, wherever the run is started from
    if not path.is_file():
        raise UserError(f"config file {path} not found; pass --yaml_config config/ViT.yaml")
    text = path.read_text()
    yaml = YAML(typ="safe", pure=True)
    try:
        _reject_duplicate_keys(yaml.compose(text), path)
        data = yaml.load(text)
    except YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", "") or exc).split())
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"config file {path} is not valid YAML ({problem}{where}); fix the file") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise UserError(f"config file {path} must map config names to settings (name: {{key: value, ...}})")
    return data


def _reject_duplicate_keys(node, path: Path) -> None:
    from ruamel.yaml.nodes import MappingNode, SequenceNode
    if isinstance(node, MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            name = getattr(k, "value", None)
            if isinstance(name, str) and name != "<<":
                if name in seen:
                    raise UserError(f"config file {path} line {k.start_mark.line + 1}: key '{name}' repeats the "
                                    f"one on line {seen[name]} in the same mapping; keep one of them")
                seen[name] = k.start_mark.line + 1
            _reject_duplicate_keys(v, path)
    elif isinstance(node, SequenceNode):
        for item in node.value:
            _reject_duplicate_keys(item, path)


def load_config(yaml_path: str | Path, name: str, overrides: dict[str, Any] | None = None) -> Config:
    """Config ``name`` of ``yaml_path`` with ``overrides`` (``{key: str or typed value}``) applied.

    Raises:
        UserError: unknown config name or key (naming the closest), a value of the wrong type or
            outside its choices or range.
    """
    configs = read_yaml(yaml_path)
    if name not in configs:
        raise UserError(f"config {name!r} not in {yaml_path}{closest(name, configs)} "
                        f"(available: {', '.join(configs)})")
    cfg = Config(name=name, yaml_config=str(yaml_path))
    for key, raw in configs[name].items():
        _set(cfg, key, raw, f"{yaml_path}, config {name}: ")
    for key, raw in (overrides or {}).items():
        _set(cfg, key, raw, "")
    for spec in KEYS.values():
        try:
            check_value(spec, getattr(getattr(cfg, spec.section), spec.name))
        except ValueError as exc:
            value = getattr(getattr(cfg, spec.section), spec.name)
            raise UserError(f"--{spec.name} {exc}, got {_show(value)}") from None
    return cfg


def _set(cfg: Config, key: str, raw: Any, where: str) -> None:
    if key not in KEYS:
        raise UserError(f"{where}unknown config key {'--' if not where else ''}{key}{closest(key, KEYS)} "
                        "(python train.py --help lists the keys)")
    try:
        cfg.set(key, coerce(raw, KEYS[key].type))
    except ValueError as exc:
        raise UserError(f"{where}{'--' if not where else ''}{key} {exc} ({type_name(KEYS[key].type)}), "
                        f"got {_show(raw)}") from None


def _show(value: Any) -> str:
    return json.dumps(plain(value)) if not isinstance(value, str) else repr(value)


# ---------------------------------------------------------------- command line
def parse_overrides(argv: list[str]) -> dict[str, str]:
    """``["--lr", "1e-3", "--enable_fused", "--x=y"]`` -> ``{"lr": "1e-3", "enable_fused": "true", "x": "y"}``.

    A key given twice takes its last value, so a launcher's defaults (``submit_pm.sh`` passes
    ``--data_path`` and ``--expdir`` first) can be overridden by the arguments after them.

    Raises:
        UserError: an argument that is not an option.
    """
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise UserError(f"unexpected argument {arg!r}; options look like --<key> <value> (see --help)")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                value = "true"
        out[name] = value
        i += 1
    return out


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
        print(key_help(topic.lstrip("-").replace("-", "_"), yaml_path) if topic else full_help(prog))
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


# ---------------------------------------------------------------- generated text
def full_help(prog: str = "train.py") -> str:
    """``--help``: every key by section with type, default and doc, at most 80 columns wide."""
    lines = [f"usage: python {prog} [--config NAME] [--yaml_config FILE] [--KEY VALUE ...]",
             f"       python {prog} --help [KEY] | --list-configs | --print-config",
             "",
             *textwrap.wrap("Values: --key value or --key=value; a bare --flag means true; lists as [a,b]; "
                            "null where the type allows it. Keys can also be set in the YAML config.", WIDTH),
             "",
             "  --config NAME          named config of the YAML file (--list-configs)",
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


def to_yaml(cfg: Config) -> str:
    """The resolved config as a YAML file of one named config, loadable with ``--yaml_config``."""
    values = cfg.flat()
    lines = [f"# resolved config {cfg.name!r} (from {cfg.yaml_config})", f"{cfg.name}:"]
    for attr, (_, title) in SECTIONS.items():
        lines.append(f"  # ---- {title}")
        lines += [f"  {s.name}: {json.dumps(values[s.name])}" for s in KEYS.values() if s.section == attr]
    return "\n".join(lines) + "\n"


def markdown_flags() -> str:
    """The README's flag table, generated from the schema (tests/test_config.py keeps them equal)."""
    rows = ["| flag | type | default | meaning |", "|---|---|---|---|"]
    for attr, (_, title) in SECTIONS.items():
        rows.append(f"| **{title}** | | | |")
        for spec in (s for s in KEYS.values() if s.section == attr):
            kind = type_name(spec.type).replace("|", "\\|")
            rows.append(f"| `--{spec.name}` | `{kind}` | `{_show_plain(spec.default)}` | {spec.doc} |")
    return "\n".join(rows)


def update_readme(path: Path = REPO / "README.md") -> None:
    """Replace the README's generated flag table (between the ``flags:start``/``flags:end`` markers)."""
    text = path.read_text()
    start, end = "<!-- flags:start -->", "<!-- flags:end -->"
    if text.count(start) != 1 or text.count(end) != 1:
        raise UserError(f"{path} needs one {start} and one {end} line around the flag table")
    head, rest = text.split(start)
    tail = rest.split(end)[1]
    path.write_text(f"{head}{start}\n{markdown_flags()}\n{end}{tail}")


if __name__ == "__main__":  # python -m utils.config --update-readme
    if sys.argv[1:] != ["--update-readme"]:
        sys.exit("usage: python -m utils.config --update-readme")
    update_readme()
