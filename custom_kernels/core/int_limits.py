"""Whether Python integers fit the C integer types a launcher or a kernel takes them in.

ctypes stores a Python int in a fixed-width field modulo 2**bits without a word
(``ctypes.c_int32(2**32 + 16).value == 16``), and a kernel that narrows a 64-bit argument to
``int`` does the same on the device: an extent or a stride that does not fit would run another
problem, a wrong answer with no error. So each launch path checks its integers here before the
call, against the C types it declares (ctypes integer types: a launcher's ``Structure`` fields or a
kernel's parameters), and refuses, or sends to torch, what does not fit. Pure arithmetic on Python
ints: no torch, no device, nothing to cache.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Mapping


@functools.cache
def c_range(c_type: Any) -> tuple[int, int]:
    """The least and the greatest value of a ctypes integer type: (-2**31, 2**31 - 1) for
    ``c_int32``, (0, 2**32 - 1) for ``c_uint32``."""
    bits = 8 * ctypes.sizeof(c_type)
    if c_type(-1).value < 0:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def c_name(c_type: Any) -> str:
    """``int32``, ``uint64``...: the type as the messages name it."""
    signed = c_type(-1).value < 0
    return f"{'' if signed else 'u'}int{8 * ctypes.sizeof(c_type)}"


def fits(value: int, c_type: Any) -> bool:
    low, high = c_range(c_type)
    return low <= value <= high


def misfit(values: Mapping[str, int], c_types: Any, holder: str = "a C") -> str | None:
    """Why the first of ``values`` (name -> int) that its C type cannot hold does not fit, naming
    the value and the limit ("M = 4294967312 does not fit the launcher's int32 (at most
    2147483647)" with ``holder`` "the launcher's"); None when every value fits. ``c_types``: one
    ctypes integer type for all, or a mapping name -> type."""
    for name, value in values.items():
        c_type = c_types[name] if isinstance(c_types, Mapping) else c_types
        low, high = c_range(c_type)
        if not low <= value <= high:
            bound = f"at most {high}" if value > high else f"at least {low}"
            return f"{name} = {value} does not fit {holder} {c_name(c_type)} ({bound})"
    return None


def field_types(structure: Any) -> dict[str, Any]:
    """A ctypes ``Structure``'s field name -> C type: a launcher's integer types, read where its
    ABI is declared."""
    return {field[0]: field[1] for field in structure._fields_}
