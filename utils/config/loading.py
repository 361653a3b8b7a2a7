"""Named YAML configs and command-line overrides -> a typed :class:`utils.config.schema.Config`.

``config/ViT.yaml`` maps config names to flat ``key: value`` settings (anchors and ``<<:`` merge keys
allowed). The command line overrides any key as ``--key value``, ``--key=value``, a bare ``--flag``
(true) or a list ``--img_size [360,720]``. Every value is converted to the type the schema declares,
whatever its YAML spelling, and checked; a bad one is a :class:`UserError` naming the key, the place
it came from and the fix. ``--help [KEY]``, ``--list-configs`` and ``--print-config`` are answered by
:func:`cli_config` (``utils/config/command_line.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from utils.config.schema import KEYS, SECTIONS, Config
from utils.config.types import check_value, coerce, safe_yaml, type_name
from utils.core.errors import UserError, closest, note_repeated
from utils.core.files import check_output_path, read_bounded

DEFAULT_YAML = "config/ViT.yaml"
REPO = Path(__file__).resolve().parents[2]


def read_yaml(path: str | Path, follow: bool = True) -> dict[str, dict]:
    """Parse a YAML file of named configs (merge keys resolved); ``follow=False`` for a run directory's own
    ``config.yaml``, which is never read through a symbolic link.

    Raises:
        UserError: missing or unreadable file, not a regular file or over :data:`MAX_YAML_BYTES`, text that is
            not UTF-8 (binary, UTF-16), invalid YAML, nesting deeper than :data:`MAX_DEPTH`, an anchor that
            contains itself, a key repeated inside one mapping (which YAML merge keys would otherwise resolve
            silently), or a document that is not ``name: {setting: value}`` with names.
    """
    from ruamel.yaml.error import YAMLError
    path = Path(path)
    if not path.is_file() and not path.is_absolute() and (REPO / path).is_file():
        path = REPO / path  # the shipped configs, wherever the run is started from
    if not os.path.lexists(path):
        raise UserError(f"config file {path} not found; pass --yaml_config config/ViT.yaml")
    text = _read_text(path, follow)
    yaml = safe_yaml()  # numbers in decimal digits only: lr: 0x10 is not 16
    try:
        _check_depth(yaml.parse(text), path)
        _reject_duplicate_keys(yaml.compose(text), path, set(), ())
        data = yaml.load(text)
    except YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", "") or exc).split())
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"config file {path} is not valid YAML ({problem}{where}); fix the file") from None
    _check_shape(data, path)
    return data


MAX_YAML_BYTES = 1 << 20  # a config file is a few kB
MAX_DEPTH = 8  # nesting of a config file: names -> settings -> a list value (3); more is not a config


def _check_depth(events, path: Path) -> None:
    """Refuse a document nested deeper than :data:`MAX_DEPTH` from its parser events (linear in the text, before
    the recursive composer could run out of stack)."""
    from ruamel.yaml.events import CollectionEndEvent, CollectionStartEvent
    depth = 0
    for event in events:
        depth += isinstance(event, CollectionStartEvent) - isinstance(event, CollectionEndEvent)
        if depth > MAX_DEPTH:
            raise UserError(f"config file {path} line {event.start_mark.line + 1}: nested more than {MAX_DEPTH} "
                            "levels deep; a config file is name: {key: value} with lists like [a, b]")


def _read_text(path: Path, follow: bool = True) -> str:
    """The file's text (UTF-8, with or without a byte-order mark), read bounded (:data:`MAX_YAML_BYTES`), from a
    regular file, through a symbolic link only with ``follow``. Raises UserError for anything else."""
    try:
        raw = read_bounded(path, MAX_YAML_BYTES, follow=follow)
    except OSError as exc:
        raise UserError(f"config file {path} cannot be read ({exc.strerror}); check its permissions") from None
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise UserError(f"config file {path} is UTF-16 text; save it as UTF-8")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"config file {path} is not UTF-8 text (byte {exc.start}: binary or another encoding); "
                        "save it as UTF-8") from None
    if "\x00" in text:
        raise UserError(f"config file {path} contains NUL bytes (a binary file?); pass a YAML text file")
    return text


def _check_shape(data: Any, path: Path) -> None:
    """``data`` maps config names (strings) to settings (string keys). Raises UserError naming what is not."""
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise UserError(f"config file {path} must map config names to settings (name: {{key: value, ...}})")
    for name, settings in data.items():
        if not isinstance(name, str):
            raise UserError(f"config file {path}: config name {name!r} is not a string; "
                            "quote it or use letters")
        bad = [k for k in settings if not isinstance(k, str)]
        if bad:
            raise UserError(f"config file {path}, config {name}: key {bad[0]!r} is not a "
                            "setting name (a string, like lr: 0.001)")


def _reject_duplicate_keys(node, path: Path, done: set[int], inside: tuple[int, ...]) -> None:
    """Raise UserError for a key repeated inside one mapping, or an anchor that contains itself. Each node is
    checked once (``done``): an alias re-uses its anchor's node, so re-walking it would make nested aliases
    exponential; ``inside`` holds the nodes on the way down, to find an alias of one of them."""
    from ruamel.yaml.nodes import MappingNode, SequenceNode
    if id(node) in inside:
        raise UserError(f"config file {path} line {node.start_mark.line + 1} has an anchor that refers to itself "
                        f"(*{node.anchor} inside &{node.anchor}); merge anchors of other configs only")
    if id(node) in done:
        return
    done.add(id(node))
    inside = (*inside, id(node))
    if isinstance(node, MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            name = getattr(k, "value", None)
            if isinstance(name, str) and name != "<<":
                if name in seen:
                    raise UserError(f"config file {path} line {k.start_mark.line + 1}: key '{name}' repeats the "
                                    f"one on line {seen[name]} in the same mapping; keep one of them")
                seen[name] = k.start_mark.line + 1
            _reject_duplicate_keys(v, path, done, inside)
    elif isinstance(node, SequenceNode):
        for item in node.value:
            _reject_duplicate_keys(item, path, done, inside)


def load_config(yaml_path: str | Path, name: str, overrides: dict[str, Any] | None = None) -> Config:
    """Config ``name`` of ``yaml_path`` with ``overrides`` (``{key: str or typed value}``) applied.

    Raises:
        UserError: a config name that is not a plain name (``../x``: it names the run's folder under
            ``--expdir``), unknown config name or key (naming the closest), a value of the wrong type or
            outside its choices or range.
    """
    check_output_path("--config", name, name=True)  # the run directory's name under --expdir, like --run_num
    configs = read_yaml(yaml_path)
    if name not in configs:
        raise UserError(f"config {name!r} not in {yaml_path}{closest(name, configs)} "
                        f"({list_configs_command(yaml_path)} lists them all)")
    cfg = Config(name=name, yaml_config=str(yaml_path))
    for key, raw in configs[name].items():
        _set(cfg, key, raw, f"{yaml_path}, config {name}: ")
    for key, raw in (overrides or {}).items():
        _set(cfg, key, raw, "")
    cfg.overrides = tuple(overrides or ())
    for spec in KEYS.values():
        try:
            check_value(spec, getattr(getattr(cfg, spec.section), spec.name))
        except ValueError as exc:
            value = getattr(getattr(cfg, spec.section), spec.name)
            raise UserError(f"--{spec.name} {exc}, got {show_value(value)}") from None
    return cfg


def list_configs_command(yaml_path: str | Path) -> str:
    """The command that lists the configs of ``yaml_path`` (an error names it rather than every config: a file
    may hold thousands)."""
    default = Path(yaml_path) in (Path(DEFAULT_YAML), REPO / DEFAULT_YAML)
    return "python train.py --list-configs" + ("" if default else f" --yaml_config {yaml_path}")


def configs_for_data(yaml_path: str | Path, data_path: str) -> list[str]:
    """The named configs of ``yaml_path`` whose ``data_path`` is ``data_path`` (as paths: ``./data/x`` is
    ``data/x``); none when the file cannot be read."""
    try:
        configs = read_yaml(yaml_path)
    except UserError:
        return []
    return [n for n, c in configs.items() if "data_path" in c and Path(str(c["data_path"])) == Path(data_path)]


# evaluate.py's options, which a training command is sometimes given: where training has the like (the nearest
# config key by spelling, --lead_steps -> tune_steps, would mislead)
EVALUATE_OPTIONS = {"lead_steps": "train.py's validation scores N leads with --valid_rollout_steps N",
                    "init_every": "train.py's validation starts forecasts at every n-th time step with "
                                  "--valid_init_every N",
                    "run_dir": "train.py names its run with --run_num NAME under --expdir",
                    "save_forecasts": "train.py writes no forecasts"}


def _set(cfg: Config, key: str, raw: Any, where: str) -> None:
    if key in EVALUATE_OPTIONS:
        raise UserError(f"{where}--{key} is an option of evaluate.py (python evaluate.py --help lists them), not a "
                        f"config key; {EVALUATE_OPTIONS[key]}")
    if key not in KEYS:
        raise UserError(f"{where}unknown config key {'--' if not where else ''}{key}{closest(key, KEYS)} "
                        "(python train.py --help lists the keys)")
    try:
        cfg.set(key, coerce(raw, KEYS[key].type))
    except ValueError as exc:
        raise UserError(f"{where}{'--' if not where else ''}{key} {exc} ({type_name(KEYS[key].type)}), "
                        f"got {show_value(raw)}") from None


def show_value(value: Any, limit: int = 80) -> str:
    """A value as the messages show it: strings quoted, lists and numbers as JSON, cut at about ``limit``
    characters (a list of aliases in a YAML file can stand for millions of items: only what is shown is
    visited)."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, (list, tuple)):
        parts, used = [], 0
        for item in value:
            if used > limit:
                parts.append("...")
                break
            parts.append(show_value(item, limit - used))
            used += len(parts[-1]) + 1
        text = "[" + ",".join(parts) + "]"
    elif isinstance(value, dict):
        text = "{...}"
    else:
        text = json.dumps(value) if isinstance(value, (bool, int, float)) or value is None else repr(value)
    return text if len(text) <= limit + 3 else text[:limit] + "..."


def parse_overrides(argv: list[str]) -> dict[str, str]:
    """``["--lr", "1e-3", "--enable_fused", "--x=y"]`` -> ``{"lr": "1e-3", "enable_fused": "true", "x": "y"}``.

    A key given twice takes its last value, so a launcher's defaults (``submit_pm.sh`` passes ``--data_path`` and
    ``--expdir`` first) can be overridden by the arguments after them; a note on stderr names the values when they
    differ (:func:`utils.core.errors.note_repeated`).

    Raises:
        UserError: an argument that is not an option, a value that looks like an option (``--run_num -x``), or a
            bare ``--key`` of a key that is not true/false (``--run_num --lr 1e-3``).
    """
    given: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise UserError(f"unexpected argument {arg!r}; options look like --<key> <value> (see --help)")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = _option_value(name, argv[i + 1])
                i += 1
            else:
                value = _bare_flag(name)
        given.setdefault(f"--{name}", []).append(value)
        i += 1
    note_repeated(given)
    return {flag[2:]: values[-1] for flag, values in given.items()}


PLACEHOLDERS = {"config": "NAME", "yaml_config": "FILE"}  # the command line's own options, not config keys


def _placeholder(name: str) -> str:
    """What ``--name`` takes, for a message: ``NAME``, ``INT``, ``[INT,INT]``..."""
    return PLACEHOLDERS.get(name) or (type_name(KEYS[name].type) if name in KEYS else "VALUE")


def _option_value(name: str, text: str) -> str:
    """``text``, the argument after ``--name``, as its value. Raises UserError when it looks like an option
    (``-x``; a negative number is a value): a forgotten value would otherwise name a run ``-x``."""
    if text.startswith("-"):
        try:
            float(text)
        except ValueError:
            raise UserError(f"--{name} {text}: {text!r} looks like an option, not a value; give --{name} its value "
                            f"(--{name} {_placeholder(name)})") from None
    return text


def _bare_flag(name: str) -> str:
    """``"true"`` for ``--name`` without a value: a true/false key's flag (an unknown key too, whose error names
    the closest keys). Raises UserError for any other key: a run would be named ``true``."""
    spec = KEYS.get(name)
    if name in PLACEHOLDERS or (spec is not None and not _takes_true(spec.type)):
        raise UserError(f"--{name} needs a value: --{name} {_placeholder(name)}")
    return "true"


def _takes_true(tp: Any) -> bool:
    """Whether a key of type ``tp`` reads ``"true"`` as True (``bool``, ``Optional[bool]``)."""
    try:
        return coerce("true", tp) is True
    except ValueError:
        return False


def to_yaml(cfg: Config, exclude: tuple[str, ...] = ()) -> str:
    """The resolved config as a YAML file of one named config, loadable with ``--yaml_config``; the keys in
    ``exclude`` are left out (a run directory's ``config.yaml`` leaves out ``run_num``, so that it repeats the run
    elsewhere)."""
    values = cfg.flat()
    lines = [f"# resolved config {cfg.name!r} (from {cfg.yaml_config})", f"{cfg.name}:"]
    for attr, (_, title) in SECTIONS.items():
        lines.append(f"  # ---- {title}")
        lines += [f"  {s.name}: {json.dumps(values[s.name])}" for s in KEYS.values()
                  if s.section == attr and s.name not in exclude]
    return "\n".join(lines) + "\n"


RUN_DIR_HINT = "pass a run directory written by train.py (<expdir>/<config>/<N>GPU/<run_num>, <N>CPU on CPUs)"


def load_run_config(run_dir: Path) -> Config:
    """The resolved config a run was trained with (its ``config.yaml``: one named config).

    Raises:
        UserError: no such directory or file, or not a file of one named config.
    """
    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} not found; {RUN_DIR_HINT}")
    if not os.path.lexists(path):
        raise UserError(f"{run_dir} has no config.yaml; {RUN_DIR_HINT}")
    names = list(read_yaml(path, follow=False))
    if len(names) != 1:
        raise UserError(f"{path} holds {len(names)} configs ({', '.join(names)}); expected the one resolved config "
                        "that train.py writes: restore the run's file")
    return load_config(path, names[0])

