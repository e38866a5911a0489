"""Strict readers of the fields of a stored tuning entry: each returns the value with its type, or
raises ``EntryRejected`` naming the field and what was wrong.

A tuning entry is input like any other (a cache directory can be shared, a bundle mailed): the
family schemas (``cutlass_ops.gemms.gemm_entries``, ``cutlass_ops.gemms.grouped.grouped_entries``,
``custom_kernels.norms.tuned``) read every field they use through these, so that no string
passes for a time, no bool for an integer, and no number outside what a launcher can hold.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")

# The largest extent any launcher takes (int32 in the GEMM launcher's arguments): a stored
# problem beyond it cannot be one that was tuned here.
MAX_EXTENT = 2**31 - 1
MAX_TEXT = 512  # names, stages, strategies; an error text is allowed more
MAX_ERROR_TEXT = 2000
MAX_ENTRY_BYTES = 1024 * 1024  # a default tune's entry is 2-10 KB, failures included
MAX_LIST = 4096  # runners-up and failures kept per entry (an exhaustive tune's failures)


class EntryRejected(ValueError):
    """A stored or imported tuning entry (or its file's scope) that fails its schema."""


class StoredRecord:
    """What every family's record (a frozen dataclass with ``winner``, ``winner_ms``,
    ``torch_ms`` and ``stored`` fields) shares: ``stored`` is the entry as its schema accepted
    it, what is written back and exported; the rest of the code reads the typed fields."""

    @property
    def winner_name(self) -> str | None:
        return self.winner.name if self.winner is not None else None

    @property
    def speedup(self) -> float | None:
        """torch's time over the winner's: above 1, the tuned kernel is faster."""
        return self.torch_ms / self.winner_ms if self.winner_ms and self.torch_ms else None

    def field(self, name: str) -> Any:
        """A stored field the record does not type (``strategy``, ``tuned_at``, ...), checked
        for JSON-safety only: for display."""
        return self.stored.get(name)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.stored))


def own_key(key: str, problem: Any) -> None:
    """An entry is stored under its own problem's name: dispatch looks it up by the key, the
    CLI shows the problem, and the two must not tell different stories."""
    require(key == problem.name, f"its key is not its problem's name ({problem.name})")


def require(condition: bool, reason: str) -> None:
    if not condition:
        raise EntryRejected(reason)


def mapping(value: Any, what: str) -> Mapping[str, Any]:
    require(isinstance(value, Mapping) and all(isinstance(k, str) for k in value),
            f"{what} is not an object")
    return value


def entry_fields(raw: Any, known: set[str]) -> Mapping[str, Any]:
    """A stored entry's object: only ``known`` fields, JSON-safe (``json_safe``), and at most
    ``MAX_ENTRY_BYTES`` written out."""
    data = mapping(raw, "the entry")
    unknown = set(data) - known
    require(not unknown, f"unknown fields {sorted(unknown)[:5]}")
    json_safe(data, "the entry")
    require(len(json.dumps(data)) <= MAX_ENTRY_BYTES,
            f"the entry is larger than {MAX_ENTRY_BYTES // 1024} KiB")
    return data


def integer(data: Mapping[str, Any], name: str, low: int = 1, high: int = MAX_EXTENT,
            default: int | None = None) -> int:
    """An int field (bools are not ints here) in ``low..high``."""
    value = data.get(name, default)
    require(isinstance(value, int) and not isinstance(value, bool),
            f"{name} is not an integer ({_shown(value)})")
    require(low <= value <= high, f"{name} = {_shown(value)} is outside {low}..{high}")
    return value


def boolean(data: Mapping[str, Any], name: str, default: bool | None = None) -> bool:
    value = data.get(name, default)
    require(isinstance(value, bool), f"{name} is not true or false ({_shown(value)})")
    return value


def text(data: Mapping[str, Any], name: str, *, optional: bool = False,
         choices: tuple[str, ...] | None = None, limit: int = MAX_TEXT,
         default: str | None = None) -> str | None:
    value = data.get(name, default)
    if value is None and optional:
        return None
    require(isinstance(value, str), f"{name} is not a string ({_shown(value)})")
    require(len(value) <= limit, f"{name} is longer than {limit} characters")
    if choices is not None:
        require(value in choices, f"{name} = {_shown(value)} is not one of {list(choices)}")
    return value


def milliseconds(data: Mapping[str, Any], name: str, *, optional: bool = False) -> float | None:
    """A measured time: a finite number above zero (None where ``optional`` and absent)."""
    value = data.get(name)
    if value is None and optional:
        return None
    return positive(value, name)


def positive(value: Any, name: str) -> float:
    """A time or a ratio: a finite number above zero."""
    require(_is_number(value), f"{name} is not a number ({_shown(value)})")
    require(math.isfinite(value) and value > 0,
            f"{name} = {_shown(value)} is not a finite number above zero")
    return float(value)


def figure(data: Mapping[str, Any], name: str) -> float | None:
    """A derived figure (TFLOP/s, GB/s, seconds): absent, or a finite number of at least 0."""
    value = data.get(name)
    if value is None:
        return None
    require(_is_number(value) and math.isfinite(value) and value >= 0,
            f"{name} = {_shown(value)} is not a finite number of at least 0")
    return float(value)


def display_fields(data: Mapping[str, Any], figures: tuple[str, ...],
                   texts: tuple[str, ...]) -> None:
    """Fields stored for display only (derived figures, notes), each checked for its kind."""
    for name in figures:
        figure(data, name)
    for name in texts:
        text(data, name, optional=True)


def short_ratios(data: Mapping[str, Any], name: str, most: int = 8) -> None:
    """An optional short list of ratios (per-routing speedups), each above zero."""
    value = data.get(name)
    if value is not None:
        require(isinstance(value, list) and len(value) <= most, f"{name} is not a short list")
        for item in value:
            positive(item, f"an item of {name}")


def items(data: Mapping[str, Any], name: str, read: Callable[[Mapping[str, Any]], T]) -> tuple[T, ...]:
    """A list of objects (absent: empty), each read by ``read``."""
    value = data.get(name)
    if value is None:
        return ()
    require(isinstance(value, list), f"{name} is not a list")
    require(len(value) <= MAX_LIST, f"{name} holds more than {MAX_LIST} items")
    return tuple(read(mapping(item, f"an item of {name}")) for item in value)


def measured_alternative(name_field: str) -> Callable[[Mapping[str, Any]], tuple[str, float]]:
    """The reader of a runner-up ``{name_field: ..., "ms": ...}``: (name, ms)."""
    def read(item: Mapping[str, Any]) -> tuple[str, float]:
        milliseconds(item, "torch_ms", optional=True)
        text(item, "backend", optional=True)
        return text(item, name_field), milliseconds(item, "ms")
    return read


def failure(name_field: str) -> Callable[[Mapping[str, Any]], tuple[str, str, str]]:
    """The reader of a failure ``{name_field, stage, error}``: (name, stage, error)."""
    def read(item: Mapping[str, Any]) -> tuple[str, str, str]:
        return (text(item, name_field), text(item, "stage"),
                text(item, "error", limit=MAX_ERROR_TEXT))
    return read


def measured(data: Mapping[str, Any], winner: Any, name_field: str) -> tuple:
    """What a tuned family's entry stores beside its winner, read and checked: (winner_ms,
    torch_ms, runners_up, failures, complete); a winner's time only with a winner."""
    winner_ms = milliseconds(data, "winner_ms", optional=winner is None)
    require(winner is not None or winner_ms is None, "a time without a winner")
    return (winner_ms, milliseconds(data, "torch_ms"),
            items(data, "runners_up", measured_alternative(name_field)),
            items(data, "failures", failure(name_field)), boolean(data, "complete", default=True))


def json_safe(value: Any, what: str, depth: int = 0) -> None:
    """Every number in ``value`` finite, nesting shallow: a field the schema does not read is
    still kept and exported, so it must not carry NaN or a structure that breaks a reader."""
    require(depth <= 8, f"{what} is nested too deeply")
    if isinstance(value, Mapping):
        for key, item in value.items():
            require(isinstance(key, str), f"{what} has a key that is not a string")
            json_safe(item, what, depth + 1)
    elif isinstance(value, list):
        for item in value:
            json_safe(item, what, depth + 1)
    elif isinstance(value, float):
        require(math.isfinite(value), f"{what} holds a number that is not finite")
    elif isinstance(value, int) and not isinstance(value, bool):
        require(abs(value) <= 2**63, f"{what} holds an integer beyond 64 bits")
    else:
        require(value is None or isinstance(value, (str, bool)),
                f"{what} holds a {type(value).__name__}")


def parsed(what: str, parse: Callable[[], T]) -> T:
    """``parse()``, its ValueError / TypeError / KeyError (a config's own checks) as a
    rejection naming ``what``."""
    try:
        return parse()
    except EntryRejected:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise EntryRejected(f"{what}: {exc}"[:MAX_TEXT]) from None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A field's value for a message, cut short: a crafted entry must not flood the log."""
    try:
        shown = repr(value)
    except ValueError:  # an integer of more digits than Python will print
        return "a huge integer"
    return shown if len(shown) <= 40 else shown[:37] + "..."


def require_canonical(stored: Any, canonical: Any, what: str) -> None:
    """``stored`` (read from JSON) says what ``canonical`` (the parsed value written back) says,
    field by field and with the same JSON types: a config's constructor converts "128" to 128
    and True to 1, and a record must not accept what the tuner would never have written. Fields
    absent from ``stored`` take the parsed value's defaults (entries from before a field)."""
    if isinstance(stored, Mapping) and isinstance(canonical, Mapping):
        for key, value in stored.items():
            require(key in canonical, f"{what} has an unknown field {str(key)[:40]!r}")
            require_canonical(value, canonical[key], f"{what}.{key}")
        return
    require(_json(stored) == _json(canonical),
            f"{what} = {_shown(stored)} is not in its stored form ({_shown(canonical)})")


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
