"""Element types: the one table of their facts. Every module that names an element type, sizes one,
maps it to torch or CUTLASS, or passes it to a kernel reads this table; adding an element type
(FP8's e4m3 and e5m2 are here already) touches it and the kernels that take the new type.

Each element has:
- ``name``: ours, as configs, tuning keys and the CLI write it (``bf16``);
- ``torch_name``: the torch dtype's attribute name (``bfloat16``; the norm family's keys);
- ``bytes``: its size;
- ``cutlass``: the ``cutlass_library.DataType`` member that names it;
- ``code``: the value our CUDA sources take for it (``-DNORM_IN=2``, ``GROUPED_ELEMENT``, ...;
  ``csrc/*.cu`` switch on these).

Importing this module loads no torch: ``torch_dtype`` imports it on first use.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Element:
    name: str
    torch_name: str
    bytes: int
    cutlass: str
    code: int

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.torch_name)

    @property
    def is_fp8(self) -> bool:
        return self.bytes == 1


ELEMENTS: tuple[Element, ...] = (
    Element("bf16", "bfloat16", 2, "bf16", 2),
    Element("f16", "float16", 2, "f16", 1),
    Element("f32", "float32", 4, "f32", 0),
    Element("e4m3", "float8_e4m3fn", 1, "e4m3", 3),
    Element("e5m2", "float8_e5m2", 1, "e5m2", 4),
)

# The 16- and 32-bit floats every NVRTC family of custom_kernels takes (their sources switch on
# these three codes).
FLOATS: tuple[Element, ...] = ELEMENTS[:3]

_BY_KEY: dict[str, Element] = {**{e.name: e for e in ELEMENTS},
                               **{e.torch_name: e for e in ELEMENTS},
                               "half": ELEMENTS[1], "float": ELEMENTS[2]}


def element(kind: Any) -> Element:
    """The element a name (``bf16``, ``bfloat16``), a torch dtype, an enum whose value is a name
    (``config.DType``) or an ``Element`` names; ValueError for anything else."""
    if isinstance(kind, Element):
        return kind
    key = getattr(kind, "value", kind)
    if not isinstance(key, str):  # a torch.dtype: torch.bfloat16 prints as "torch.bfloat16"
        key = str(key).removeprefix("torch.")
    found = _BY_KEY.get(key)
    if found is None:
        raise ValueError(f"unknown element type {kind!r}; known: "
                         f"{', '.join(e.name for e in ELEMENTS)}")
    return found


def from_code(code: int) -> Element:
    """The element a kernel code stands for."""
    found = next((e for e in ELEMENTS if e.code == code), None)
    if found is None:
        raise ValueError(f"no element type has kernel code {code}")
    return found


def float_codes() -> dict:
    """{torch dtype: kernel code} of ``FLOATS``: what the NVRTC families look a tensor's dtype
    up in (imports torch)."""
    return {e.torch_dtype: e.code for e in FLOATS}


def float_code(kind: Any) -> int | None:
    """The kernel code of a 16- or 32-bit float (what the NVRTC families take), else None."""
    try:
        found = element(kind)
    except ValueError:
        return None
    return found.code if found in FLOATS else None


__all__ = ["ELEMENTS", "FLOATS", "Element", "element", "float_code", "float_codes", "from_code"]
