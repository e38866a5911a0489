"""A gradient's amax handed from the backward kernel that wrote the gradient to the backward
that quantizes it (quantization where the data already is).

A tensorwise FP8 GEMM's backward quantizes its output gradient dy with one scale for the whole
tensor, so it needs ``max|dy|`` before any value: a pass of its own over dy, unless the kernel
that wrote dy reduced it as it wrote (``custom_kernels.swiglu``'s backward does, for the
gate+up GEMM's dy, the largest gradient of a decoder layer). Autograd passes gradients alone,
so the amax goes beside it, in a ``GradAmax`` both sides were given in the forward:

    slot = GradAmax()
    gate_up = fp8_linear(x, weights, recipe="tensorwise", grad_amax=slot)   # reads it
    y, amax = swiglu_with_amax(gate_up, grad_amax=slot)                     # writes it

The writer takes a zeroed word (``buffer``), launches its kernel into it and names the tensor
it wrote (``record``); the reader asks ``amax_of(dy)``, which answers only for that very tensor
object, unchanged since (its version counter), and None for anything else: a gradient summed
from several uses, changed in place by a hook, or a slot whose writer did not run (torch.compile,
tensors off a GPU). None means "compute it yourself", so a slot never gives a wrong amax.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch


class GradAmax:
    """One gradient's amax, written by its producer's backward and read by its consumer's."""

    __slots__ = ("_buffer", "_of", "_version")

    def __init__(self):
        self._buffer: Optional[torch.Tensor] = None
        self._of = None
        self._version = -1

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A zeroed float32 word on ``like``'s device for the writer's kernel (atomicMax of
        |value| bits); what an earlier backward recorded is forgotten."""
        self._of = None
        self._buffer = torch.zeros((), dtype=torch.float32, device=like.device)
        return self._buffer

    def record(self, grad: torch.Tensor) -> None:
        """The writer's kernel has reduced ``grad``'s amax into ``buffer()``'s word."""
        self._of = weakref.ref(grad)
        self._version = grad._version

    def amax_of(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """``max|grad|`` (float32 scalar on the device) if ``grad`` is the tensor recorded,
        unchanged since; else None."""
        of = self._of() if self._of is not None else None
        if of is None or of is not grad or grad._version != self._version:
            return None
        return self._buffer


__all__ = ["GradAmax"]
