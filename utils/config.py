"""Named YAML configs with command-line overrides.

``load_params(yaml_path, name, overrides)`` reads one named config from a YAML file
(anchors and ``<<:`` merge keys allowed, parsed with ruamel.yaml), applies
``--<key> <value>`` overrides (also ``--key=value``; a bare ``--flag`` means true for
booleans), checks every key against the config's own keys, coerces each value to the
type of its default, and checks enumerated choices.
"""

from __future__ import annotations

import difflib
import io
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from utils.errors import UserError

# Enumerated options: value must be one of these.
CHOICES = {
    "amp_mode": ("none", "fp16", "bf16"),
    "data_loader_config": ("pytorch", "dali", "synthetic"),
    "lr_schedule": ("cosine", "constant"),
    "activation_checkpointing": ("none", "full", "selective"),
    "fsdp": ("none", "zero2", "zero3", "hsdp"),
    "fsdp_reduce_dtype": ("fp32", "param"),
    "attention_backend": ("auto", "cudnn", "flash", "efficient", "math"),
    "compile_mode": ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"),
    "parallel_order": ("tp-cp-dp", "cp-tp-dp", "tp-dp-cp", "cp-dp-tp", "dp-tp-cp", "dp-cp-tp"),
}
# Keys that may be null in YAML and then take this type when set from the command line.
NULLABLE_TYPES = {"limit_nsamples": int, "limit_nsamples_val": int, "local_batch_size": int,
                  "plot_channel": str}


class Params(dict):
    """A config: a dict whose keys are also attributes (``params.lr`` == ``params["lr"]``)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def to_yaml(self) -> str:
        """The config as YAML text (plain types only)."""
        yaml = YAML()
        yaml.default_flow_style = None
        buf = io.StringIO()
        yaml.dump({k: _plain(v) for k, v in self.items()}, buf)
        return buf.getvalue()


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _closest(key: str, valid) -> str:
    near = difflib.get_close_matches(key, list(valid), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(near)}?" if near else ""


def read_yaml(path: str | Path) -> dict:
    """Parse a YAML file of named configs. Raises UserError if missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} not found; pass --yaml_config config/ViT.yaml")
    try:
        data = YAML(typ="safe", pure=True).load(path.read_text())
    except YAMLError as exc:
        raise UserError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must map config names to settings")
    return data


def _coerce(key: str, raw: Any, default: Any) -> Any:
    """Convert a command-line string (or YAML value) to the type of ``default``."""
    want = type(default) if default is not None else NULLABLE_TYPES.get(key)
    if isinstance(raw, str):
        if raw.lower() in ("null", "none") and (default is None or key in NULLABLE_TYPES):
            return None
        if want is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise UserError(f"--{key} expects true or false, got {raw!r}")
        if want in (list, tuple):
            try:
                raw = YAML(typ="safe", pure=True).load(raw if raw.startswith("[") else f"[{raw}]")
            except YAMLError:
                raise UserError(f"--{key} expects a list like [360,720], got {raw!r}") from None
    if want is None or raw is None:
        return raw
    if want in (list, tuple):
        if not default:  # free-length list (e.g. key_channels): items kept as given
            if not isinstance(raw, (list, tuple)):
                raise UserError(f"--{key} expects a list like [a,b], got {raw!r}")
            return [str(r) for r in raw]
        if not isinstance(raw, (list, tuple)) or len(raw) != len(default):
            raise UserError(f"--{key} expects a list of {len(default)} values like {default}, got {raw!r}")
        return [_coerce(key, r, d) for r, d in zip(raw, default)]
    if want is float and isinstance(raw, (int, float, str)) and not isinstance(raw, bool):
        try:
            return float(raw)
        except ValueError:
            pass
    elif want is int and not isinstance(raw, bool):
        try:
            value = float(raw) if isinstance(raw, str) else raw
            if float(value).is_integer():
                return int(value)
        except (TypeError, ValueError):
            pass
    elif want is str:
        return str(raw)
    elif isinstance(raw, want):
        return raw
    raise UserError(f"--{key} expects {want.__name__} (like {default!r}), got {raw!r}")


def parse_overrides(argv: list[str]) -> dict[str, str]:
    """``["--lr", "1e-3", "--enable_fused", "--x=y"]`` -> ``{"lr": "1e-3", "enable_fused": "true", "x": "y"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise UserError(f"unexpected argument {arg!r}; options look like --<key> <value>")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                value = "true"
        out[key] = value
        i += 1
    return out


def load_params(yaml_path: str | Path, name: str, overrides: dict[str, Any] | None = None) -> Params:
    """Load config ``name`` from ``yaml_path`` and apply ``overrides``.

    Raises:
        UserError: unknown config name, unknown key (naming the closest valid keys),
            value of the wrong type, or a value outside the key's choices.
    """
    configs = read_yaml(yaml_path)
    if name not in configs:
        raise UserError(f"config {name!r} not in {yaml_path}{_closest(name, configs)} "
                        f"(available: {', '.join(configs)})")
    params = Params(configs[name])
    for key, raw in (overrides or {}).items():
        if key not in params:
            raise UserError(f"unknown config key --{key}{_closest(key, params)}")
        params[key] = _coerce(key, raw, params[key])
    for key, options in CHOICES.items():
        if key in params and params[key] not in options:
            raise UserError(f"--{key} must be one of {', '.join(options)}, got {params[key]!r}")
    params["config"] = name
    return params
