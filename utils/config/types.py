"""Key types of the config schema: how a value from YAML or the command line becomes the declared type.

Each key is declared with :func:`key` (a default, a one-line doc and an optional per-value :class:`Check`);
:func:`coerce` converts a raw value to the key's annotation (``int``, ``float``, ``bool``, ``str``,
``Literal``, ``Optional``, ``Union`` and tuples), whatever its YAML spelling, and :func:`type_name`
writes the type for ``--help``. Nothing here knows the project's keys (``utils/config/schema.py``).
"""

from __future__ import annotations

import functools
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union


@dataclass(frozen=True)
class Check:
    """A per-value constraint: ``ok(value)`` must hold; ``text`` says what is required (``>= 1``)."""

    text: str
    ok: typing.Callable[[Any], bool]


AT_LEAST_1 = Check(">= 1", lambda v: v >= 1)


NON_NEGATIVE = Check(">= 0", lambda v: v >= 0)


POSITIVE = Check("> 0", lambda v: v > 0)


UNIT_INTERVAL = Check("in [0, 1)", lambda v: 0 <= v < 1)


CLOSED_UNIT_INTERVAL = Check("in [0, 1]", lambda v: 0 <= v <= 1)


SEED_RANGE = Check("in [0, 2**32)", lambda v: 0 <= v < 2**32)


AUTO = "auto"


BATCH_OR_AUTO = Check(">= 1 or auto", lambda v: v == AUTO or v >= 1)


def key(default: Any, doc: str, check: Check | None = None) -> Any:
    """A config key: its ``default``, a one-line ``doc`` and an optional per-value ``check``."""
    return field(default=default, metadata={"doc": doc, "check": check})


def plain(value: Any) -> Any:
    """Tuples as lists, for YAML and JSON."""
    return [plain(v) for v in value] if isinstance(value, tuple) else value


@dataclass(frozen=True)
class KeySpec:
    """One key of the schema: its section attribute, type annotation, default, doc and check."""

    name: str
    section: str
    type: Any
    default: Any
    doc: str
    check: Check | None


def choices(tp: Any) -> tuple | None:
    """The allowed values of a ``Literal`` (also inside ``Optional``), else None."""
    tp = _strip_optional(tp)[0]
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else Union[rest]), True
    return tp, False


def type_name(tp: Any) -> str:
    """Short type text for help: ``INT``, ``FLOAT or null``, ``[INT,INT]``, ``{a,b}``, ``[STR,...]``."""
    inner, optional = _strip_optional(tp)
    if typing.get_origin(inner) is Union:
        text = " or ".join(type_name(a) for a in typing.get_args(inner))
    elif typing.get_origin(inner) is Literal:
        text = "{" + ",".join(map(str, typing.get_args(inner))) + "}"
    elif typing.get_origin(inner) is tuple:
        args = typing.get_args(inner)
        text = (f"[{type_name(args[0])},...]" if len(args) == 2 and args[1] is Ellipsis
                else "[" + ",".join(type_name(a) for a in args) + "]")
    else:
        text = {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR"}[inner]
    return text + (" or null" if optional else "")


def coerce(raw: Any, tp: Any) -> Any:
    """Convert ``raw`` (a command-line string or a YAML value) to type ``tp``.

    Raises:
        ValueError: with a short reason, when ``raw`` does not fit ``tp``.
    """
    inner, optional = _strip_optional(tp)
    if raw is None or (isinstance(raw, str) and raw.lower() in ("null", "none") and optional):
        if optional:
            return None
        raise ValueError("null is not allowed")
    origin = typing.get_origin(inner)
    if origin is Union:  # the first alternative that takes the value (Literal["auto"] before int)
        alternatives = sorted(typing.get_args(inner), key=lambda a: typing.get_origin(a) is not Literal)
        for alternative in alternatives:
            try:
                return coerce(raw, alternative)
            except ValueError:
                pass
        raise ValueError("expects " + " or ".join(_expected(a) for a in alternatives))
    if origin is Literal:
        options = typing.get_args(inner)
        if raw not in options:
            raise ValueError(f"must be one of {', '.join(map(str, options))}")
        return raw
    if origin is tuple:
        return _coerce_tuple(raw, typing.get_args(inner))
    return _coerce_scalar(raw, inner)


def _expected(tp: Any) -> str:
    """``an integer``, ``a number``, ``a string`` or a Literal's options joined by ``or``."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(str, typing.get_args(tp)))
    return {int: "an integer", float: "a number", bool: "true or false"}.get(tp, "a string")


def _coerce_tuple(raw: Any, args: tuple) -> tuple:
    if isinstance(raw, str):
        raw = _parse_list(raw)
    if not isinstance(raw, (list, tuple)):
        raise ValueError("expects a list like [a,b]")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce_scalar(r, args[0]) for r in raw)
    if len(raw) != len(args):
        raise ValueError(f"expects a list of {len(args)} values")
    return tuple(_coerce_scalar(r, a) for r, a in zip(raw, args))


def _parse_list(text: str) -> list:
    """``"[360,720]"``, ``"360,720"``, ``"[t850, z500]"`` or ``"[]"`` -> list of YAML scalars."""
    from ruamel.yaml.error import YAMLError
    text = text.strip()
    try:
        value = safe_yaml().load(text if text.startswith("[") else f"[{text}]")
    except YAMLError:
        raise ValueError("expects a list like [a,b]") from None
    if not isinstance(value, list):
        raise ValueError("expects a list like [a,b]")
    return value


# A number as the config takes it, on the command line and in YAML alike: decimal digits with an optional sign,
# point and exponent. Python's int()/float() and YAML also read 0x10, 0b11, 0o17 and 1_0, which would silently
# give another value than the one meant (lr: 0x10 is 16).
DECIMAL = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
NON_FINITE = ("nan", "inf", "infinity", ".nan", ".inf")  # read as numbers, so that the check says "finite"


def safe_yaml():
    """A safe, pure-Python ruamel.yaml reader whose numbers are decimal only: a scalar YAML would read as an
    integer or float in another spelling (``0x10``, ``0b11``, ``1_0``) stays the text it is, which a number key
    refuses and a string key keeps as written."""
    from ruamel.yaml import YAML
    yaml = YAML(typ="safe", pure=True)
    yaml.Constructor = _decimal_constructor()
    return yaml


@functools.cache
def _decimal_constructor() -> type:
    """ruamel.yaml's safe constructor with :func:`_decimal` numbers (made on first use: ruamel is imported only by
    the commands that read YAML)."""
    from ruamel.yaml.constructor import SafeConstructor

    class DecimalConstructor(SafeConstructor):
        def construct_yaml_int(self, node):
            return super().construct_yaml_int(node) if _decimal(node.value) else self.construct_scalar(node)

        def construct_yaml_float(self, node):
            return super().construct_yaml_float(node) if _decimal(node.value) else self.construct_scalar(node)

    DecimalConstructor.add_constructor("tag:yaml.org,2002:int", DecimalConstructor.construct_yaml_int)
    DecimalConstructor.add_constructor("tag:yaml.org,2002:float", DecimalConstructor.construct_yaml_float)
    return DecimalConstructor


def _decimal(text: str) -> bool:
    """Whether ``text`` spells a number in decimal digits (or NaN/infinity: see :data:`NON_FINITE`)."""
    text = text.strip()
    return DECIMAL.fullmatch(text) is not None or text.lower().lstrip("+-") in NON_FINITE


def _check_decimal(raw: Any, expected: str) -> None:
    """Raise ValueError when the string ``raw`` is not a decimal number, saying so when Python would have read it
    as one in another base or with underscores."""
    if not isinstance(raw, str) or _decimal(raw):
        return
    try:
        int(raw.strip(), 0) if "." not in raw else float(raw)
    except ValueError:
        raise ValueError(f"expects {expected}") from None
    raise ValueError(f"expects {expected} in plain decimal digits")


def _coerce_scalar(raw: Any, tp: type) -> Any:
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError("expects true or false")
    if tp is str:
        if isinstance(raw, (list, dict, bool)):
            raise ValueError("expects a string")
        return str(raw)
    if isinstance(raw, bool) or isinstance(raw, (list, dict)):
        raise ValueError(f"expects {'an integer' if tp is int else 'a number'}")
    _check_decimal(raw, "an integer" if tp is int else "a number")
    if tp is int:
        return _coerce_int(raw)
    try:
        number = float(raw)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("expects a number") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError("expects a finite number")
    return number


INT_MAX = 2**63 - 1  # an integer setting must fit a signed 64-bit integer (what tensors and C libraries take)
FLOAT_INT_MAX = 2**53  # above it a float spelling (1.0e100) no longer names one integer exactly


def _coerce_int(raw: Any) -> int:
    """An int from an int, a decimal string, or a float spelling of a whole number up to :data:`FLOAT_INT_MAX`
    (``1e3``); never through a float that would change it. Raises ValueError."""
    if isinstance(raw, int):
        value = raw
    else:
        text = str(raw).strip()
        if len(text) > 40:  # more digits than any int64: int() of a huge string is quadratic
            raise ValueError(f"expects an integer of at most {INT_MAX}")
        try:
            value = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                raise ValueError("expects an integer") from None
            if not number.is_integer() or abs(number) > FLOAT_INT_MAX:
                raise ValueError("expects an integer" + (f" (write it in digits: a float spelling above {FLOAT_INT_MAX}"
                                                         " is not exact)" if number.is_integer() else "")) from None
            value = int(number)
    if abs(value) > INT_MAX:
        raise ValueError(f"expects an integer of at most {INT_MAX}")
    return value


def check_value(spec: KeySpec, value: Any) -> None:
    """Apply the key's per-value check (element-wise for lists). Raises ValueError."""
    if spec.check is None or value is None:
        return
    for v in (value if isinstance(value, tuple) else (value,)):
        if not spec.check.ok(v):
            raise ValueError(f"must be {spec.check.text}")
