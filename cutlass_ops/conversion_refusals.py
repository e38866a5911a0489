"""Why ``convert`` leaves a layer alone, for the reasons every swap shares, each phrased once: a
tensor-parallel (DTensor) weight, weights off a CUDA device, a dtype other than bf16/fp16, a GPU
other than sm90, rows that are not 16-byte aligned. Each function returns the reason, or None
when it does not apply; none of them changes a module. (Modules called at run time follow the CPU
rule instead: ``custom_kernels.core.fallback``.)
"""

from __future__ import annotations

import torch

SIXTEEN_BIT = (torch.bfloat16, torch.float16)  # the dtypes of the kernels convert swaps in


def sharded(weight) -> str | None:
    """A DTensor weight: a new module would lose the hooks its tensor-parallel plan put on the
    one it replaces."""
    if hasattr(weight, "to_local"):
        return "a tensor-parallel (DTensor) weight: left to its plan"
    return None


def off_cuda(tensor, what: str = "weights") -> str | None:
    """``tensor`` (the module's ``what``) is not on a CUDA device, where the probes and the
    kernels run."""
    if tensor.device.type != "cuda":
        return f"{what} on {tensor.device}: move the model to a CUDA device first"
    return None


def not_sixteen_bit(dtype: torch.dtype, kernels: str, note: str = "") -> str | None:
    """``dtype`` is not one that ``kernels`` (named in the reason) compute in."""
    if dtype not in SIXTEEN_BIT:
        return f"{dtype} weights: {kernels} are bf16/fp16{note}"
    return None


def not_sm90(device: torch.device, note: str = "") -> str | None:
    """The CUDA ``device`` is not an sm90 GPU (asks the driver: a CUDA device only)."""
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"{torch.cuda.get_device_name(device)} is not an sm90 GPU{note}"
    return None


def unaligned(sizes: str, first: int, second: int, note: str = "") -> str | None:
    """``first`` or ``second`` (named by ``sizes``) is not a multiple of 8 elements: 16-byte rows
    in bf16/fp16, as TMA and the vectorized loads need."""
    if first % 8 or second % 8:
        return f"{sizes}: both must be multiples of 8 for 16-byte aligned rows{note}"
    return None


def weight_refusal(weight, *, kernels: str | None = None, dtype_note: str = "",
                   sm90: bool = False, dtensor: bool = False) -> str | None:
    """The first of the shared refusals that applies to a layer's ``weight``, in the order the
    conversions check them: a DTensor (with ``dtensor``), off a CUDA device, not bf16/fp16 (when
    ``kernels`` names what needs it), not an sm90 GPU (with ``sm90``; last, since asking the
    driver needs a CUDA device)."""
    why = sharded(weight) if dtensor else None
    why = why or off_cuda(weight)
    if why is None and kernels is not None:
        why = not_sixteen_bit(weight.dtype, kernels, dtype_note)
    if why is None and sm90:
        why = not_sm90(weight.device)
    return why


__all__ = ["SIXTEEN_BIT", "weight_refusal", "sharded", "off_cuda", "not_sixteen_bit", "not_sm90",
           "unaligned"]
