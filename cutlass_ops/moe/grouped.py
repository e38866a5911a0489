"""``grouped_mm``: one GEMM per group (a mixture-of-experts layer's experts) in one call, with
``torch._grouped_mm``'s semantics for the forms MoE needs, autograd, a fake implementation and
the custom op ``cutlass_ops::grouped_mm`` (so ``torch.compile(fullgraph=True)`` traces it).

The form follows the operands' dimensions; ``offs`` (int32, [G], on the operands' device) holds
the cumulative ends of the groups along the grouped extent: group g spans
``[offs[g-1], offs[g])`` (``offs[-1]`` ends the last group; a repeated value is an empty group):

- ``2d3d``: a [M, K] (the routed tokens, grouped by expert), b [G, K, N] (one weight each),
  offs over M -> [M, N]. The forward pass and dX. Rows past ``offs[-1]`` belong to no group and
  are left unspecified, as torch leaves them.
- ``2d2d``: a [M, K], b [K, N], offs over K -> [G, M, N]: the weight gradient
  (``x^T @ dY`` per expert, the tokens being K). A group with no K is zeros.
- ``3d2d``: a [G, M, K], b [K, N], offs over N -> [M, N]: what the ``2d2d`` form's backward
  needs.
- ``3d3d``: a [G, M, K], b [G, K, N], no offs -> [G, M, N]: a batched GEMM.

Operands are bf16 or fp16 (float32 accumulation; the output in their dtype) or float32; each is
row- or column-major (a transposed view is fine) with 16-byte aligned strides on CUDA (K and N
multiples of 8 bf16 elements), where a misaligned operand is refused by name. Every backward
GEMM is one of the four forms: for ``y = grouped_mm(x, w, offs)`` (``2d3d``),
``dx = grouped_mm(dy, w^T, offs)`` and ``dw = grouped_mm(x^T, dy, offs)`` (``2d2d``; computed as
``(dy^T x)^T`` when w is a transposed view, so the gradient comes out in w's own layout).

On CUDA the GEMMs run a tuned kernel where ``cutlass-tune tune --grouped`` stored a winner that
beat ``torch._grouped_mm`` on every routing it timed, for the call's key
(``cutlass_ops.gemms.grouped.grouped_build.GroupedProblem``): our CUTLASS sm90 grouped kernel, or with
``cutlass-ops[dsl]`` QuACK's variable-length DSL kernel (``cutlass_ops.gemms.grouped.dsl_grouped``);
else ``torch._grouped_mm`` (CUTLASS's two fixed sm90 configs); either way the offsets are never
read on the host (no sync; CUDA-graph
safe); nothing checks their values there (a
sync), so they must be non-decreasing and within the grouped extent. Off CUDA, ``reference``
runs a float32 loop over the groups and checks the offsets (the CPU rule,
``custom_kernels.core.fallback``). int64 offsets are converted (on the device, no sync).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from custom_kernels.core import fallback
from custom_kernels.core.eager import plain_eager
from custom_kernels.core.errors import UnsupportedInputError

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FORMS = ("2d3d", "2d2d", "3d2d", "3d3d")


def form_of(a: Tensor, b: Tensor, offs: Optional[Tensor]) -> str:
    """The form of a call (see the module docstring), or UnsupportedInputError naming why the
    operands make none."""
    for name, t in (("a", a), ("b", b), ("offs", offs)):
        if t is not None and not isinstance(t, Tensor):
            raise UnsupportedInputError(f"grouped_mm: {name} must be a tensor, got "
                                        f"{type(t).__name__}")
    form = f"{a.dim()}d{b.dim()}d"
    if form not in FORMS:
        raise UnsupportedInputError(f"grouped_mm takes 2-D or 3-D operands in the forms "
                                    f"{', '.join(FORMS)}; got {a.dim()}-D x {b.dim()}-D")
    if (form == "3d3d") != (offs is None):
        raise UnsupportedInputError("grouped_mm: offs is required for the 2d3d, 2d2d and 3d2d "
                                    "forms and not taken by 3d3d" if form != "3d3d" else
                                    "grouped_mm: 3-D x 3-D is a batched GEMM, without offs")
    if a.shape[-1] != b.shape[-2]:
        raise UnsupportedInputError(f"grouped_mm: a {tuple(a.shape)} and b {tuple(b.shape)} do "
                                    "not multiply (a's last extent must be b's second to last)")
    groups = offs.shape[0] if offs is not None and offs.dim() == 1 else None
    if offs is not None and (offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64)):
        raise UnsupportedInputError(f"grouped_mm: offs must be a 1-D int32 tensor, got "
                                    f"{offs.dtype} of shape {tuple(offs.shape)}")
    counts = {"2d3d": b.shape[0], "3d2d": a.shape[0], "3d3d": a.shape[0]}
    if form == "3d3d" and a.shape[0] != b.shape[0]:
        raise UnsupportedInputError(f"grouped_mm: a has {a.shape[0]} groups and b "
                                    f"{b.shape[0]}")
    if form in ("2d3d", "3d2d") and groups != counts[form]:
        raise UnsupportedInputError(f"grouped_mm: offs has {groups} groups and the 3-D operand "
                                    f"{counts[form]}")
    return form


def output_shape(form: str, a: Tensor, b: Tensor, offs: Optional[Tensor]) -> tuple:
    if form == "2d3d":
        return (a.shape[0], b.shape[-1])
    if form == "2d2d":
        return (offs.shape[0], a.shape[0], b.shape[-1])
    if form == "3d2d":
        return (a.shape[1], b.shape[-1])
    return (a.shape[0], a.shape[1], b.shape[-1])


def check(a: Tensor, b: Tensor, offs: Optional[Tensor], out_dtype) -> str:
    """Every rule but the offsets' values: the form, the dtypes, the devices and, on CUDA, the
    16-byte strides. Returns the form."""
    form = form_of(a, b, offs)
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise UnsupportedInputError(f"grouped_mm takes bf16, fp16 or float32 operands of one "
                                    f"dtype, got {a.dtype} and {b.dtype}")
    if out_dtype is not None and out_dtype != a.dtype:
        raise UnsupportedInputError(f"grouped_mm writes its output in the operands' dtype "
                                    f"({a.dtype}), not {out_dtype}")
    devices = {t.device for t in (a, b, offs) if t is not None}
    if len(devices) > 1:
        raise UnsupportedInputError(f"grouped_mm: tensors on different devices: "
                                    f"{sorted(map(str, devices))}")
    if a.is_cuda:
        for name, t in (("a", a), ("b", b)):
            _check_cuda_layout(name, t)
    return form


def _check_cuda_layout(name: str, t: Tensor, *, address: bool = False) -> None:
    """torch._grouped_mm's (and CUTLASS's) rule: one of the last two dimensions contiguous, the
    other strides multiples of 16 bytes, a 16-byte aligned address. The address is checked in
    the op itself (``address=True``): under torch.compile ``grouped_mm`` runs on fake tensors,
    which have none."""
    step = 16 // t.element_size()
    inner = [d for d in (-1, -2) if t.stride(d) == 1]
    others = [t.stride(d) for d in range(t.dim()) if not inner or d != t.dim() + inner[0]]
    if not inner or any(s % step for s in others) or (address and t.data_ptr() % 16):
        raise UnsupportedInputError(
            f"grouped_mm: {name} {tuple(t.shape)} with strides {t.stride()} is not row- or "
            f"column-major with 16-byte aligned strides (its extents along the strided "
            f"dimension must be multiples of {step}); pad it, or make it contiguous")


# ---- the custom op --------------------------------------------------------------------------

@torch.library.custom_op("cutlass_ops::grouped_mm", mutates_args=())
def grouped_mm_op(a: Tensor, b: Tensor, offs: Optional[Tensor],
                  offs_cover_all: bool = False) -> Tensor:
    """See the module docstring; ``grouped_mm`` checks the inputs first. ``offs_cover_all``:
    the backward's promise (``routed_grouped_mm``'s)."""
    return _run(a, b, offs)


def _run(a: Tensor, b: Tensor, offs: Optional[Tensor]) -> Tensor:
    """The op's implementation (no autograd)."""
    form = form_of(a, b, offs)
    if fallback.off_cuda({"a": a, "b": b, "offs": offs}, "cutlass_ops.grouped_mm",
                         "cutlass_ops.moe.grouped.reference"):
        return reference(a, b, offs)
    for name, t in (("a", a), ("b", b)):
        _check_cuda_layout(name, t, address=True)
    if offs is not None and offs.dtype != torch.int32:
        offs = offs.to(torch.int32)
    if 0 in output_shape(form, a, b, offs):
        return a.new_empty(output_shape(form, a, b, offs))
    if a.shape[-1] == 0:  # no K: every product is zero
        return a.new_zeros(output_shape(form, a, b, offs))
    config = _tuned(form, a, b, offs)
    if config is not None:
        from cutlass_ops.gemms.grouped import grouped_runtime

        out = a.new_empty(output_shape(form, a, b, offs))
        return grouped_runtime.launch(config, form, a, b, offs, out)
    return torch._grouped_mm(a, b, offs)


_tuned_by_signature: dict = {}


def _tuned(form: str, a: Tensor, b: Tensor, offs: Optional[Tensor]):
    """The tuned CUTLASS kernel for this call (``tuning.grouped_search`` stored it, verified,
    and it beat torch._grouped_mm), or None; remembered per shapes, strides and dtype. None
    too, logged once, where the launcher's integers cannot hold the group count, an extent or
    a stride (``grouped_runtime.integer_refusal``): torch._grouped_mm runs the call."""
    key = (form, a.device, a.dtype, a.shape, a.stride(), b.shape, b.stride(),
           None if offs is None else offs.shape)
    if key not in _tuned_by_signature:
        from cutlass_ops.gemms.grouped import grouped_build, grouped_entries
        from cutlass_ops.gemms.grouped.grouped_runtime import (element_name, group_starts_aligned,
                                                        integer_refusal, layout)

        config = None
        element = element_name(a.dtype)
        too_large = integer_refusal(form, a, b, offs)
        if too_large is not None:
            fallback.log_once("cutlass_ops.grouped_mm uses torch._grouped_mm", too_large)
        elif element is not None and group_starts_aligned(form, a, b):
            problem = grouped_build.GroupedProblem.of(form, a, b, offs, element, layout(a),
                                                      layout(b))
            config = grouped_entries.tuned_config(problem, a.device.index)
        _tuned_by_signature[key] = config
    return _tuned_by_signature[key]


@grouped_mm_op.register_fake
def _(a, b, offs, offs_cover_all=False):
    form = form_of(a, b, offs)
    return a.new_empty(output_shape(form, a, b, offs))


def _setup(ctx, inputs, output) -> None:
    a, b, offs = inputs[:3]
    ctx.save_for_backward(a, b, offs)
    ctx.offs_cover_all = len(inputs) > 3 and inputs[3]


def _backward(ctx, grad: Tensor):
    """Every form's two gradients are grouped GEMMs of the same offsets:
    ``da = grouped_mm(grad, b^T)`` and ``db = grouped_mm(a^T, grad)``. For 2d3d they are 2d3d
    and 2d2d; for 2d2d, 3d2d and 2d3d; for 3d2d, 2d2d and 3d2d; 3d3d stays batched. A gradient
    whose grouped extent runs past ``offs[-1]`` (entries no group reads) has that part zeroed,
    on the device: the grouped GEMM leaves it unspecified; not where the caller promised that
    ``offs[-1]`` is the whole grouped extent (``offs_cover_all``: a full pass saved)."""
    a, b, offs = ctx.saved_tensors
    form = form_of(a, b, offs)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = _call(grad, b.transpose(-1, -2), offs)
        if form in ("2d3d", "2d2d") and not ctx.offs_cover_all:  # a's rows or columns grouped
            grad_a = _zero_past(grad_a, offs, 0 if form == "2d3d" else 1)
    if ctx.needs_input_grad[1]:
        if form in ("2d3d", "3d3d") and b.stride(-2) == 1 and b.stride(-1) != 1:
            # b is column-major per group: the experts' [E, N, K] weights seen as [E, K, N].
            # Computed as (grad^T a)^T, the gradient comes out in the weight's own layout, so
            # AccumulateGrad adds it in place instead of copying a transposed [E, N, K] (a
            # strided copy of every expert's weight gradient; docs/measurements.md).
            grad_b = _call(grad.transpose(-1, -2), a, offs).transpose(-1, -2)
        else:
            grad_b = _call(a.transpose(-1, -2), grad, offs)
        if form in ("2d2d", "3d2d") and not ctx.offs_cover_all:  # b's rows or columns grouped
            grad_b = _zero_past(grad_b, offs, 0 if form == "2d2d" else 1)
    return grad_a, grad_b, None, None


def _zero_past(t: Tensor, offs: Tensor, dim: int) -> Tensor:
    """``t`` with the entries at or past ``offs[-1]`` along ``dim`` zeroed (no host sync)."""
    if offs.shape[0] == 0:
        return torch.zeros_like(t)
    index = torch.arange(t.shape[dim], device=t.device)
    keep = (index < offs[-1]).to(t.dtype)
    return t * (keep[:, None] if dim == 0 else keep)


torch.library.register_autograd("cutlass_ops::grouped_mm", _backward, setup_context=_setup)


class _EagerGroupedMM(torch.autograd.Function):
    """The op's autograd without its dispatch (``_call``)."""

    @staticmethod
    def forward(ctx, a, b, offs, offs_cover_all):
        _setup(ctx, (a, b, offs, offs_cover_all), None)
        return _run(a, b, offs)

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx, grad)


def _call(a: Tensor, b: Tensor, offs: Optional[Tensor], offs_cover_all: bool = False) -> Tensor:
    """The custom op; eagerly with plain tensors its implementation (through
    ``_EagerGroupedMM`` when a gradient is wanted), since torch's Python custom-op dispatch
    costs about as much host time as the launch itself (at the start of a train step, where the
    GPU waits on the host: docs/measurements.md has the figures)."""
    if torch.compiler.is_compiling() or not plain_eager(a, b, offs):
        return grouped_mm_op(a, b, offs, offs_cover_all)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _EagerGroupedMM.apply(a, b, offs, offs_cover_all)
    return _run(a, b, offs)


# ---- the public function and the reference --------------------------------------------------

def grouped_mm(a: Tensor, b: Tensor, offs: Optional[Tensor] = None, *,
               out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """One GEMM per group (see the module docstring for the forms, ``offs`` and the layouts).
    ``out_dtype``: None or the operands' dtype (the accumulation is float32 either way)."""
    check(a, b, offs, out_dtype)
    return _call(a, b, offs)


def routed_grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``grouped_mm`` (2d3d) for a caller whose groups cover every row of ``a``, ``offs[-1] ==
    a.shape[0]``, by construction: ``cutlass_ops.moe``'s routed pairs, whose expert counts sum
    to the pairs. The backward then skips zeroing the gradient's rows past ``offs[-1]``, a full
    pass over it. Not checked (that would read offs on the host): not public API; anyone else
    calls ``grouped_mm``, whose backward zeroes those rows."""
    check(a, b, offs, None)
    return _call(a, b, offs, True)


def bounds(offs: Tensor, extent: int) -> list[tuple[int, int]]:
    """The groups' [start, end) on the host (a sync on CUDA: the reference's and the tests'),
    checked: non-decreasing, non-negative, ending within ``extent``."""
    ends = [int(v) for v in offs.tolist()]
    starts = [0] + ends[:-1]
    if any(e < s for s, e in zip(starts, ends)) or (ends and (ends[0] < 0 or
                                                             ends[-1] > extent)):
        raise UnsupportedInputError(f"grouped_mm: offs {ends} must be non-decreasing, from 0, "
                                    f"and end within the grouped extent {extent}")
    return list(zip(starts, ends))


def reference(a: Tensor, b: Tensor, offs: Optional[Tensor]) -> Tensor:
    """The groups one at a time in float32, rounded once to the operands' dtype: the path off
    CUDA and the tests' ground truth. Rows past ``offs[-1]`` (2d3d) are zeros here."""
    form = form_of(a, b, offs)
    # Each group's operands are widened to float32 on their own: whole float32 copies of every
    # expert's weights would double the memory of the largest MoE problems while the tuner
    # verifies against this.
    out = torch.zeros(output_shape(form, a, b, offs), dtype=torch.float32, device=a.device)
    if form == "3d3d":
        for g in range(a.shape[0]):
            out[g] = a[g].float() @ b[g].float()
    elif form == "2d3d":
        for g, (s, e) in enumerate(bounds(offs, a.shape[0])):
            out[s:e] = a[s:e].float() @ b[g].float()
    elif form == "2d2d":
        for g, (s, e) in enumerate(bounds(offs, a.shape[1])):
            out[g] = a[:, s:e].float() @ b[s:e].float()
    else:
        for g, (s, e) in enumerate(bounds(offs, b.shape[1])):
            out[:, s:e] = a[g].float() @ b[:, s:e].float()
    return out.to(a.dtype)


__all__ = ["grouped_mm", "grouped_mm_op", "reference", "check", "form_of", "bounds", "FORMS"]
