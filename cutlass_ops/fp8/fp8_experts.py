"""FP8 experts (issue 53): a converted mixture-of-experts layer's expert GEMMs in FP8 with
DeepSeek-V3's blockwise recipe, forward and input gradient; the weight gradient in bf16.

For the routed rows ``x`` [M, K] (bf16, sorted by expert, ``offs`` covering every row) and an
expert weight ``w`` [E, N, K] (bf16, each expert's ``nn.Linear`` layout: ``gate_up_proj``,
``down_proj``):

- forward ``y = x w[e]^T`` an expert: ``x`` quantized 1x128 (a scale a row and 128 columns),
  ``w`` 128x128 (``custom_kernels.fp8.fp8_quant.quantize_pair``: one read of ``w`` gives it and
  its transpose), ``cutlass_ops.scaled_grouped_mm`` (our CUTLASS blockwise grouped kernel);
- ``dx = dy w[e]`` an expert: ``dy`` quantized 1x128 along N, the same kernel with ``w``'s
  quantized transpose (each expert's [K, N] block of it, N contiguous: no copy, the launcher
  takes the strides) and the transposed 128x128 scales (a 128x128 block's scale is its
  transpose's);
- ``dw = dy^T x`` an expert: bf16 ``grouped_mm`` (2d-2d), whose grouped dimension is the
  tokens: FP8 would need a scale a 128-token block inside each expert's rows, a kernel form
  not built yet.

A call that trains nothing (prefill, decoding) quantizes only the forward orientation, and
keeps it per weight until the weight changes (``cutlass_ops.fp8.weight_versions``: an optimizer
step, ``load_state_dict``, an in-place write; a write through ``.data`` escapes it: call
``clear_weight_copies()``).

bf16 only (the kernel writes bf16); K and N multiples of 128; the master weights stay bf16 and
the ``state_dict`` is unchanged. Off CUDA the same quantization runs in torch and the products
in float32 (the CPU rules), so a converted model can be checked on a CPU.

``convert(model, fp8="blockwise")`` makes a converted model's ``GroupedExperts`` FP8 while
``ENABLED`` is on (the default since its GPU tests passed: docs/measurements.md); a user who
wants bf16 experts under an FP8 recipe turns it off.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from cutlass_ops.fp8.scaled_grouped_mm_op import scaled_grouped_mm
from cutlass_ops.fp8.weight_versions import weights_key
from cutlass_ops.moe.experts import GroupedExperts
from cutlass_ops.moe.grouped import grouped_mm
from custom_kernels.fp8.fp8_quant import quantize, quantize_pair

BLOCK = 128
# On since tests/gpu/moe/test_fp8_experts_gpu.py passed (H200); off: convert leaves the experts
# in bf16 and says so.
ENABLED = True


def refusal(experts: nn.Module) -> Optional[str]:
    """Why ``experts``' GEMMs cannot run FP8 blockwise, or None."""
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, name)
        if weight.dtype != torch.bfloat16:
            return f"{name} is {weight.dtype}: the FP8 grouped kernel writes bf16"
        _, n, k = weight.shape
        if n % BLOCK or k % BLOCK:
            return f"{name} is [E, {n}, {k}]: blockwise FP8 wants N and K multiples of {BLOCK}"
    return None


def _weight_operands(weight: torch.Tensor):
    """``weight`` [E, N, K] quantized 128x128 once, in the forward's orientation (b [E, K, N]
    K contiguous, scales [E, K/128, N/128]) and the input gradient's (b [E, N, K] N contiguous,
    scales [E, N/128, K/128]); views, no copies."""
    e, n, k = weight.shape
    (q, s), (qt, st) = quantize_pair(weight.reshape(e * n, k), "block_128x128")
    forward = (q.view(e, n, k).transpose(1, 2),
               s.view(e, n // BLOCK, k // BLOCK).transpose(1, 2))
    backward = (qt.view(k, e, n).permute(1, 2, 0),
                st.view(k // BLOCK, e, n // BLOCK).permute(1, 2, 0))
    return forward, backward


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, offs):
        a, scale_a = quantize(rows, "block_1x128")
        (b, scale_b), backward = _weight_operands(weight)
        ctx.save_for_backward(rows, offs, *backward)
        return scaled_grouped_mm(a, b, scale_a, scale_b, offs)

    @staticmethod
    def backward(ctx, grad):
        rows, offs, bt, scale_bt = ctx.saved_tensors
        grad_rows = grad_weight = None
        grad = grad.contiguous()
        if ctx.needs_input_grad[0]:
            g, scale_g = quantize(grad, "block_1x128")
            grad_rows = scaled_grouped_mm(g, bt, scale_g, scale_bt, offs)
        if ctx.needs_input_grad[1]:
            grad_weight = grouped_mm(grad.t(), rows, offs)  # [E, N, K], the weight's layout
        return grad_rows, grad_weight, None


# Each weight's forward operand kept for calls that do not train it (prefill, decoding), by the
# weight's id: (a weak reference to it, its weight_versions key, the operand); an entry goes when
# its weight does. A call that trains quantizes afresh. (Not a WeakKeyDictionary: its lookups
# compare tensors with ==.)
_FORWARD_OPERANDS: dict[int, tuple] = {}


def _kept(weight: torch.Tensor) -> Optional[tuple]:
    """(key, operand) kept for ``weight``, or None."""
    entry = _FORWARD_OPERANDS.get(id(weight))
    return entry[1:] if entry is not None and entry[0]() is weight else None


def _keep(weight: torch.Tensor, key, operand) -> None:
    if _kept(weight) is None:
        weakref.finalize(weight, _FORWARD_OPERANDS.pop, id(weight), None)
    _FORWARD_OPERANDS[id(weight)] = (weakref.ref(weight), key, operand)


def _forward_operand(weight: torch.Tensor):
    """``weight``'s forward operand (``_weight_operands``' first) for a call that does not train
    it: the kept one while ``weight_versions.weights_key`` says the weight has not changed, else
    made afresh (the forward orientation only) and kept. Not kept under torch.compile (its graph
    could not tell a stale copy) or inside a CUDA-graph capture (the graph's own memory)."""
    capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
    key = None if capturing or torch.compiler.is_compiling() else \
        weights_key((weight,), "blockwise")
    kept = _kept(weight) if key is not None else None
    if kept is not None and kept[0] == key:
        return kept[1]
    e, n, k = weight.shape
    q, s = quantize(weight.reshape(e * n, k), "block_128x128")
    operand = (q.view(e, n, k).transpose(1, 2), s.view(e, n // BLOCK, k // BLOCK).transpose(1, 2))
    if key is not None:
        _keep(weight, key, operand)
    return operand


def fp8_routed_gemm(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``rows @ weight[e]^T`` for each expert's rows (``experts_forward``'s ``gemm``): rows
    [M, K] bf16 sorted by expert with ``offs`` covering every row, ``weight`` [E, N, K] bf16.
    A call that trains nothing (no gradient wanted) reads the weight's kept forward operand."""
    if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
        return _Fp8GroupedLinear.apply(rows, weight, offs)
    a, scale_a = quantize(rows, "block_1x128")
    b, scale_b = _forward_operand(weight)
    return scaled_grouped_mm(a, b, scale_a, scale_b, offs)


def clear_weight_copies() -> None:
    """Drops every kept forward operand (after writing weights through ``.data``)."""
    _FORWARD_OPERANDS.clear()


class Fp8GroupedExperts(GroupedExperts):
    """``GroupedExperts`` with its two grouped GEMMs in FP8 (module docstring); the same
    parameters, the same ``state_dict``."""

    gemm = staticmethod(fp8_routed_gemm)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", FP8 blockwise GEMMs"


__all__ = ["ENABLED", "Fp8GroupedExperts", "clear_weight_copies", "fp8_routed_gemm", "refusal"]
