"""Norm modules that are not torch's own: Hugging Face's ``LlamaRMSNorm`` and its copies in
Mistral, Qwen2 and Qwen3, or any module built the same way, recognised by what it holds (not by
its class) and swapped for ``cutlass_ops.nn.RMSNorm`` only after a numeric probe.

The structure: one parameter, a 1-D ``weight``; no buffers or submodules; an epsilon attribute
(``variance_epsilon``, as Hugging Face names it, or ``eps``). The probe runs a copy of the module
and ours, with the same random weight (never ones, which would hide a module that ignores it), on
the same random input, and accepts when they agree within the norms' tolerance for the dtype
(``custom_kernels.core.tolerances``). Gemma's ``x * rstd * (1 + weight)`` (its RMSNorm, weights
stored as offsets from one) is recognised the same way and gets ``OffsetRMSNorm``. A module that
computes something else stays, and the report says what.

Numerics: Hugging Face computes the statistics in float32 (as our kernels do), rounds the
normalized row to the input dtype, then multiplies by the weight; our kernels multiply in float32
and round once, which is within one rounding of theirs (the probe's tolerance covers it).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from custom_kernels.core.tolerances import relative_error, relative_tolerance
from custom_kernels.norms.modules import OffsetRMSNorm, RMSNorm

EPSILON_NAMES = ("variance_epsilon", "eps")
PROBE_ROWS = 8


def epsilon(module: nn.Module) -> float | None:
    for name in EPSILON_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float) and value > 0:
            return value
    return None


def structure_refusal(module: nn.Module) -> str | None:
    """Why ``module`` is not built like an RMSNorm with a weight, or None when it is."""
    params = dict(module.named_parameters(recurse=False))
    if list(params) != ["weight"] or params["weight"].dim() != 1:
        return "its parameters are not a single 1-D weight"
    if next(module.children(), None) is not None or next(module.buffers(recurse=False), None) \
            is not None:
        return "it holds submodules or buffers"
    if epsilon(module) is None:
        return f"no positive float epsilon ({' or '.join(EPSILON_NAMES)})"
    return None


def looks_like_rms_norm(module: nn.Module) -> bool:
    """An RMSNorm by structure that torch's own types do not cover (they convert directly)."""
    return not isinstance(module, (nn.RMSNorm, nn.LayerNorm, RMSNorm)) and \
        structure_refusal(module) is None


def drop_in(module: nn.Module, offset: bool = False) -> RMSNorm:
    """Our RMSNorm (``OffsetRMSNorm`` with ``offset``: Gemma's) sharing ``module``'s weight
    (same state_dict key and value; optimizer state stays valid)."""
    weight = module.weight
    ours = (OffsetRMSNorm if offset else RMSNorm)(weight.shape[0], eps=epsilon(module),
                                                  device="meta")
    ours.weight = weight
    ours.train(module.training)
    return ours


def probe(module: nn.Module) -> str | None:
    """None when our RMSNorm computes what ``module`` computes, else what differs (see
    ``match``, which also accepts Gemma's variant)."""
    offset, why = match(module)
    if why is None and offset:
        return ("it computes x * rstd * (1 + weight) (Gemma's RMSNorm): OffsetRMSNorm's, not "
                "RMSNorm's")
    return why


def match(module: nn.Module) -> tuple[bool, str | None]:
    """(offset, None) when ``RMSNorm`` (offset False) or ``OffsetRMSNorm`` (offset True)
    computes what ``module`` computes, else (False, what differs). Runs a copy of the module, so
    the model's weight is never touched."""
    theirs = copy.deepcopy(module)
    weight = theirs.weight
    generator = torch.Generator(device=weight.device).manual_seed(0)
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=generator, device=weight.device) + 1.0)
        # A mean far from zero: a LayerNorm (which subtracts it) must not pass for an RMSNorm.
        x = (1.0 + 3.0 * torch.randn(PROBE_ROWS, weight.shape[0], generator=generator,
                                     device=weight.device)).to(weight.dtype)
        expected = theirs(x)
        if not isinstance(expected, torch.Tensor) or expected.shape != x.shape:
            return False, "its forward does not return one tensor of the input's shape"
        tolerance = relative_tolerance(weight.dtype, "norms")
        errors = {}
        for offset in (False, True):
            ours = drop_in(theirs, offset)(x)
            errors[offset] = relative_error(ours, expected)
            if expected.dtype == ours.dtype and errors[offset] <= tolerance:
                return offset, None
    return False, (f"its output differs from an RMSNorm's by {errors[False]:.3g} and from "
                   f"Gemma's (1 + weight) by {errors[True]:.3g} (relative; the tolerance is "
                   f"{tolerance:g}) or in dtype ({expected.dtype} against {ours.dtype}): left "
                   "to torch")
