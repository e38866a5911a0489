"""Module drop-ins and ``convert``.

``cutlass_ops.nn.Linear`` is a ``torch.nn.Linear`` (same parameters, same state_dict, loads and
saves interchangeably) whose forward runs ``cutlass_ops::linear``. ``convert(model)`` swaps
Linear layers in place where our kernels apply and reports every decision with its reason.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from cutlass_ops import ops

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    """torch.nn.Linear on tuned CUTLASS kernels (forward and backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear_fast(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Linear:
        """A Linear sharing ``layer``'s parameters (no copy: optimizers keep working)."""
        new = cls(layer.in_features, layer.out_features, bias=layer.bias is not None,
                  device="meta")
        new.weight = layer.weight
        new.bias = layer.bias
        new.train(layer.training)
        return new


@dataclasses.dataclass(frozen=True)
class Decision:
    name: str
    kind: str
    converted: bool
    reason: str


@dataclasses.dataclass
class ConversionReport:
    decisions: list[Decision]

    @property
    def converted(self) -> list[str]:
        return [d.name for d in self.decisions if d.converted]

    @property
    def skipped(self) -> dict[str, str]:
        return {d.name: d.reason for d in self.decisions if not d.converted}

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} of {len(self.decisions)} layers"]
        lines += [f"  {'+' if d.converted else '-'} {d.name or '<root>'} ({d.kind}): {d.reason}"
                  for d in self.decisions]
        return "\n".join(lines)


def _why_not(layer: nn.Linear) -> str | None:
    """Why this Linear stays torch's, or None if ours applies."""
    if type(layer) is not nn.Linear:
        return f"{type(layer).__name__} subclasses Linear; its forward may differ, left alone"
    weight = layer.weight
    if weight.device.type != "cuda":
        return f"weights on {weight.device}: move the model to a CUDA device first"
    if weight.dtype not in _SUPPORTED_DTYPES:
        return (f"{weight.dtype} weights: our kernels are bf16/fp16 (fp32 would run as tf32 and "
                "change the numbers)")
    if torch.cuda.get_device_capability(weight.device) != (9, 0):
        return f"{torch.cuda.get_device_name(weight.device)} is not an sm90 GPU"
    if layer.in_features % 8 or layer.out_features % 8:
        return (f"{layer.in_features}x{layer.out_features}: both must be multiples of 8 for "
                "16-byte aligned rows (TMA)")
    return None


def convert(model: nn.Module, *, include=None, exclude=()) -> ConversionReport:
    """Swaps the model's torch.nn.Linear layers for cutlass_ops.nn.Linear in place (sharing
    parameters), leaving unsupported ones alone. ``include``: names to consider (default all);
    ``exclude``: names to leave alone. Returns what was done and why, per layer."""
    decisions = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, Linear):
            continue
        kind = type(module).__name__
        if include is not None and name not in include or name in exclude:
            decisions.append(Decision(name, kind, False, "excluded by the caller"))
            continue
        reason = _why_not(module)
        if reason is not None:
            decisions.append(Decision(name, kind, False, reason))
            continue
        replacement = Linear.from_linear(module)
        if name:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, replacement)
            decisions.append(Decision(name, kind, True, "bf16/fp16 on an sm90 GPU"))
        else:
            decisions.append(Decision(name, kind, False, "the model itself is a Linear: wrap "
                                      "it or use cutlass_ops.nn.Linear.from_linear"))
    return ConversionReport(decisions)


__all__ = ["Linear", "convert", "ConversionReport"]
