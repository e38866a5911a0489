"""Mixture-of-experts combine in one launch (``csrc/moe_combine.cu``), forward and backward.

``combine(rows, inverse, weights)`` sums each token's expert outputs with its routing weights:
``out[t] = sum_j weights[t, j] * rows[inverse[t, j]]``, accumulated in float32 and rounded once
to ``rows``' dtype. ``rows`` [P, H] are the experts' outputs in expert-sorted order (the second
grouped GEMM's output), ``inverse`` [T, k] (int64 or int32) the row holding token t's j-th slot,
``weights`` [T, k] the routing weights (float32 or ``rows``' dtype), P = T * k. Torch's chain for
it (``cutlass_ops.moe`` before this: a zero fill, ``index_copy`` back to pair order, a float32
[T, k, H] product, a sum, a cast, and as much again backward) becomes one kernel each way.

Precondition, not checked (it would take a host sync): ``inverse`` flattened is a permutation of
``range(P)``, the inverse of the sort that put the pairs in expert order: with ``order =
argsort(top_k_index.flatten())``, ``inverse[order] = arange(P)``. The backward pass writes every
row of the rows' gradient exactly once on that account (it is allocated without a fill). An
entry outside [0, P) is neither read nor written (it contributes nothing; its weight's gradient
is 0), so that a broken routing gives a wrong result instead of a memory fault; a repeated entry
leaves some gradient rows unwritten.

Backward (one kernel): ``d_rows[inverse[t, j]] = weights[t, j] * dout[t]`` (the float32 product
rounded once to ``rows``' dtype) and ``d_weights[t, j] = sum_h dout[t, h] * rows[inverse[t, j],
h]`` (float32, returned in ``weights``' dtype), each only when autograd needs it.

Values: ``rows`` fp32, fp16 or bf16, 2-D with a unit last stride and any row stride (a strided
view is read in place); 16-byte accesses when H, the row strides and the pointers allow, else
one element an access. ``inverse`` and ``weights`` are read contiguous (copied when not: they
are small). At most ``MAX_TOP_K`` slots a token.

Input refused on every device, with UnsupportedInputError: a wrong number of dimensions, a dtype
outside those above, P != T * k, a ``weights`` shape other than ``inverse``'s, k above
``MAX_TOP_K``, a non-contiguous last dimension of ``rows`` (``.contiguous()`` is left to the
caller, who sees the copy; the custom ops copy instead). T = 0 gives an empty [0, H] result.

Everything runs on torch's current stream with memory from torch's allocator and no host sync:
eagerly, under ``torch.compile(fullgraph=True)`` (the custom ops ``custom_kernels::
moe_combine_fwd`` / ``moe_combine_bwd`` with their fakes and autograd) and in CUDA graphs (run
once before capturing: the kernel is compiled and loaded on first use). Tensors off a CUDA device
run ``torch_combine`` (the CPU rule, ``custom_kernels.core.fallback``).

Read top-down: the launcher, the compile function, the custom ops, the public function, then the
torch fallback and the reference.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from custom_kernels import jit
from custom_kernels.core import elements, fallback
from custom_kernels.core.eager import plain_eager
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.launch import launch

SOURCE = "moe_combine.cu"
KERNELS = {False: "moe_combine_fwd_kernel", True: "moe_combine_bwd_kernel"}
BLOCK = 256
MAX_GRID = 1 << 20  # blocks of the 1-D grid; the kernels loop over token groups past it
MAX_TOP_K = 64  # the backward kernel's shared memory holds a partial dot per warp and slot
MAX_NS = 4  # 16-byte slots a thread keeps in registers; longer rows take extra passes
DTYPE_CODES = elements.float_codes()
INDEX_BITS = {torch.int32: 32, torch.int64: 64}


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def _defines(dtype_code: int, weights_code: int, index_bits: int, vec: bool, ns: int) -> dict:
    return {"DTYPE": dtype_code, "WDTYPE": weights_code, "INDEX_BITS": index_bits,
            "VEC": int(vec), "NS": ns, "BLOCK": BLOCK, "MAX_TOP_K": MAX_TOP_K}


def vector_ok(itemsize: int, hidden: int, strides=(), pointers=()) -> bool:
    """The 16-byte path: H, every row stride and every pointer multiples of 16 bytes. Otherwise
    one element an access."""
    vw = 16 // itemsize
    return hidden % vw == 0 and all(s % vw == 0 for s in strides) and \
        all(p % 16 == 0 for p in pointers)


def team_shape(tokens: int, slots: int) -> tuple[int, int, int]:
    """(blocks, shift, ns): a token is a team of ``1 << shift`` threads, the smallest power of
    two covering its slots (at most BLOCK), so that short rows put several tokens in a block;
    each thread keeps ``ns`` slots in registers (ceil(slots / team), at most MAX_NS). The grid
    stops at MAX_GRID blocks; the kernels loop over token groups past it."""
    lanes = min(BLOCK, 1 << max(slots - 1, 0).bit_length())
    ns = max(1, min(MAX_NS, -(-slots // lanes)))
    blocks = min(-(-tokens // (BLOCK // lanes)), MAX_GRID)
    return blocks, lanes.bit_length() - 1, ns


@functools.lru_cache(maxsize=None)
def _kernel(backward: bool, dtype_code: int, weights_code: int, index_bits: int, vec: bool,
            ns: int, device: int):
    """The loaded kernel; cached here too, which saves get_kernel's key normalisation."""
    return jit.get_kernel(SOURCE, KERNELS[backward], device=device,
                          defines=_defines(dtype_code, weights_code, index_bits, vec, ns))


def _launch(backward: bool, tensors) -> None:
    """Forward: ``tensors`` = (rows [P, H], inverse [T, k], weights [T, k], out [T, H]);
    backward: (dout [T, H], rows, inverse, weights, d_rows [P, H] or None, d_weights [T, k] or
    None). rows and dout with a unit last stride, the others contiguous; T >= 1."""
    if not all(t.is_cuda for t in tensors if t is not None):  # a custom op given other tensors
        fallback.require_cuda({f"argument {i}": t for i, t in enumerate(tensors)
                               if t is not None},
                              f"custom_kernels::moe_combine_{'bwd' if backward else 'fwd'}")
    if backward:
        dout, rows, inverse, weights, d_rows, d_weights = tensors
        strided, wide = (dout, rows), (dout, rows, d_rows)
    else:
        rows, inverse, weights, out = tensors
        strided, wide = (rows,), (rows, out)
    tokens, top_k = inverse.shape
    hidden = rows.shape[1]
    ld = tuple(t.stride(0) if t.shape[0] > 1 else 0 for t in strided)
    pointers = [t.data_ptr() for t in wide if t is not None]
    vec = vector_ok(rows.element_size(), hidden, ld, pointers)
    blocks, shift, ns = team_shape(tokens, hidden // (16 // rows.element_size()) if vec
                                   else hidden)
    device = rows.device.index
    kernel = _kernel(backward, DTYPE_CODES[rows.dtype], DTYPE_CODES[weights.dtype],
                     INDEX_BITS[inverse.dtype], vec, ns, device)
    if backward:
        args = (dout, rows, inverse, weights, d_rows.data_ptr() if d_rows is not None else 0,
                d_weights.data_ptr() if d_weights is not None else 0, tokens, top_k, hidden,
                *ld, shift)
    else:
        args = (rows, inverse, weights, out, tokens, top_k, hidden, *ld, shift)
    launch(kernel, *args, grid=blocks, block=BLOCK, device=device)


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def compile_moe_combine(dtype: str = "bfloat16", vec: bool = True, backward: bool = False,
                        arch: str = jit.DEFAULT_ARCH, *, weights_dtype: str | None = None,
                        index_bits: int = 64, slots_per_thread: int = 1) -> Path:
    """The cubin that ``combine`` (``backward``: its gradient) runs for ``rows`` of ``dtype``,
    ``weights`` of ``weights_dtype`` (None: ``dtype``), an int32 or int64 ``inverse``, 16-byte
    accesses (``vec``) or one element an access, and ``slots_per_thread`` (1 to MAX_NS) slots a
    thread in registers. Neither T, k nor H is compiled in."""
    if index_bits not in INDEX_BITS.values() or not 1 <= slots_per_thread <= MAX_NS:
        raise ValueError(f"compile_moe_combine: index_bits must be 32 or 64 and "
                         f"slots_per_thread 1 to {MAX_NS}, got {index_bits}, {slots_per_thread}")
    defines = _defines(elements.element(dtype).code,
                       elements.element(weights_dtype or dtype).code, index_bits, vec,
                       slots_per_thread)
    return jit.compile_cubin(SOURCE, defines=defines, name_expressions=(KERNELS[backward],),
                             arch=arch)


# ---------------------------------------------------------------------------------------------
# Custom ops: real impl, fake impl and autograd next to each other
# ---------------------------------------------------------------------------------------------

def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) with a unit last stride: itself when it has one, else a copy (an expanded
    gradient, or a layout torch.compile chose)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _fwd_impl(rows, inverse, weights) -> torch.Tensor:
    tokens = inverse.shape[0]
    out = torch.empty((tokens, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    if out.numel():
        _launch(False, (_unit_last(rows), inverse.contiguous(), weights.contiguous(), out))
    return out


def _bwd_impl(dout, rows, inverse, weights, rows_grad: bool, weights_grad: bool):
    """(d_rows or None, d_weights or None)."""
    d_rows = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device) if rows_grad else None
    d_weights = (torch.empty(weights.shape, dtype=weights.dtype, device=weights.device)
                 if weights_grad else None)
    wanted = (d_rows is not None and d_rows.numel()) or (d_weights is not None and
                                                         d_weights.numel())
    if wanted:
        _launch(True, (_unit_last(dout), _unit_last(rows), inverse.contiguous(),
                       weights.contiguous(), d_rows, d_weights))
    return d_rows, d_weights


@torch.library.custom_op("custom_kernels::moe_combine_fwd", mutates_args=())
def moe_combine_fwd(rows: torch.Tensor, inverse: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """Returns ``out`` [T, H], contiguous: ``sum_j weights[t, j] * rows[inverse[t, j]]``."""
    _check(rows, inverse, weights, "custom_kernels::moe_combine_fwd")
    return _fwd_impl(rows, inverse, weights)


@moe_combine_fwd.register_fake
def _(rows, inverse, weights):
    _check(rows, inverse, weights, "custom_kernels::moe_combine_fwd")
    return rows.new_empty((inverse.shape[0], rows.shape[1]))


@torch.library.custom_op("custom_kernels::moe_combine_bwd", mutates_args=())
def moe_combine_bwd(dout: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor,
                    weights: torch.Tensor, rows_grad: bool,
                    weights_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(``d_rows`` [P, H], ``d_weights`` [T, k]), contiguous, for the output gradient ``dout``
    [T, H] (any strides); a gradient not asked for is an empty tensor."""
    _check_bwd(dout, rows, inverse, weights)
    d_rows, d_weights = _bwd_impl(dout, rows, inverse, weights, rows_grad, weights_grad)
    return (d_rows if d_rows is not None else rows.new_empty(0),
            d_weights if d_weights is not None else weights.new_empty(0))


@moe_combine_bwd.register_fake
def _(dout, rows, inverse, weights, rows_grad, weights_grad):
    _check_bwd(dout, rows, inverse, weights)
    return (rows.new_empty(rows.shape if rows_grad else (0,)),
            weights.new_empty(weights.shape if weights_grad else (0,)))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dout):
    rows, inverse, weights = ctx.saved_tensors
    rows_grad, _, weights_grad = ctx.needs_input_grad
    d_rows, d_weights = torch.ops.custom_kernels.moe_combine_bwd(dout, rows, inverse, weights,
                                                                 rows_grad, weights_grad)
    return (d_rows if rows_grad else None), None, (d_weights if weights_grad else None)


torch.library.register_autograd("custom_kernels::moe_combine_fwd", _backward,
                                setup_context=_setup)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def combine(rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * rows[inverse[t, j]]`` [T, H] in ``rows``' dtype
    (float32 accumulation, one rounding), with gradients to ``rows`` and ``weights``; see the
    module docstring for the inputs and the precondition on ``inverse``. Tensors off a CUDA
    device run ``torch_combine`` (logged once)."""
    _check(rows, inverse, weights, "moe_combine")
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise UnsupportedInputError(
            f"moe_combine: rows has a non-contiguous last dimension (stride {rows.stride(1)}); "
            f"call .contiguous() first")
    # Also refuses tensors on several devices (a CUDA rows with a CPU inverse).
    if fallback.off_cuda({"rows": rows, "inverse": inverse, "weights": weights}, "moe_combine",
                         "torch_combine"):
        return torch_combine(rows, inverse, weights)
    return _combine(rows, inverse, weights)


def _combine(rows, inverse, weights):
    """Under torch.compile (and export), the custom op: the graph sees it with its fake impl.
    Eagerly, the same kernel without torch's Python custom-op dispatch (more host time than the launch):
    directly when no gradient is needed, else through an autograd.Function whose backward
    launches the backward kernel."""
    if torch.compiler.is_compiling() or not plain_eager(rows, inverse, weights):
        return torch.ops.custom_kernels.moe_combine_fwd(rows, inverse, weights)
    if torch.is_grad_enabled() and (rows.requires_grad or weights.requires_grad):
        return _EagerCombine.apply(rows, inverse, weights)
    return _fwd_impl(rows, inverse, weights)


class _EagerCombine(torch.autograd.Function):
    """Eager autograd, calling the launchers directly."""

    @staticmethod
    def forward(ctx, rows, inverse, weights):
        ctx.save_for_backward(rows, inverse, weights)
        return _fwd_impl(rows, inverse, weights)

    @staticmethod
    def backward(ctx, dout):
        rows, inverse, weights = ctx.saved_tensors
        rows_grad, _, weights_grad = ctx.needs_input_grad
        d_rows, d_weights = _bwd_impl(dout, rows, inverse, weights, rows_grad, weights_grad)
        return d_rows, None, d_weights


def _check(rows, inverse, weights, entry: str) -> None:
    """The rules the ops share with the public function, on every device (the ops copy a
    strided last dimension of ``rows`` instead of refusing it)."""
    for name, t in (("rows", rows), ("inverse", inverse), ("weights", weights)):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedInputError(f"{entry}: {name} must be a torch.Tensor, got "
                                        f"{type(t).__name__}")
        if t.dim() != 2:
            raise UnsupportedInputError(f"{entry}: {name} must be 2-D, got shape "
                                        f"{tuple(t.shape)}")
    if rows.dtype not in DTYPE_CODES:
        raise UnsupportedInputError(f"{entry}: rows must be float32, float16 or bfloat16, not "
                                    f"{rows.dtype}")
    if inverse.dtype not in INDEX_BITS:
        raise UnsupportedInputError(f"{entry}: inverse must be int64 or int32, not "
                                    f"{inverse.dtype}")
    tokens, top_k = inverse.shape
    if rows.shape[0] != tokens * top_k:
        raise UnsupportedInputError(
            f"{entry}: rows must have T * k = {tokens} * {top_k} = {tokens * top_k} rows (one "
            f"per (token, slot) pair of inverse [T, k]), got {rows.shape[0]}")
    if top_k > MAX_TOP_K:
        raise UnsupportedInputError(f"{entry}: at most {MAX_TOP_K} slots a token (the "
                                    f"kernel's limit), got k = {top_k}")
    if tuple(weights.shape) != tuple(inverse.shape) or \
            weights.dtype not in (torch.float32, rows.dtype):
        raise UnsupportedInputError(
            f"{entry}: weights must be a float32 or {rows.dtype} tensor of inverse's shape "
            f"{tuple(inverse.shape)}, got {weights.dtype} {tuple(weights.shape)}")


def _check_bwd(dout, rows, inverse, weights) -> None:
    entry = "custom_kernels::moe_combine_bwd"
    _check(rows, inverse, weights, entry)
    want = (inverse.shape[0], rows.shape[1])
    if not isinstance(dout, torch.Tensor) or tuple(dout.shape) != want or \
            dout.dtype != rows.dtype:
        raise UnsupportedInputError(
            f"{entry}: dout must be a {rows.dtype} tensor of shape {want} (T, H), got "
            f"{getattr(dout, 'dtype', type(dout).__name__)} {tuple(getattr(dout, 'shape', ()))}")


# ---------------------------------------------------------------------------------------------
# Torch fallback and the reference
# ---------------------------------------------------------------------------------------------

def torch_combine(rows: torch.Tensor, inverse: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """``combine`` in torch, for tensors off a CUDA device (inputs assumed checked), with
    autograd: the pairs gathered in token order, multiplied by their weights and summed in
    float32 (float64 stays float64), rounded once. Its gradients are the kernel's: the product
    ``weights * dout`` rounded once, and the float32 dot products in ``weights``' dtype."""
    tokens, top_k = inverse.shape
    acc = torch.promote_types(rows.dtype, torch.float32)
    pairs = rows.index_select(0, inverse.reshape(-1)).view(tokens, top_k, rows.shape[1])
    weighted = pairs.to(acc) * weights.to(acc).unsqueeze(-1)
    return weighted.sum(1).to(rows.dtype)


def combine_reference(rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor,
                      compute: torch.dtype = torch.float64) -> torch.Tensor:
    """``combine`` in ``compute`` math (float64 by default) rounded once to ``rows``' dtype,
    with autograd (its gradients: the ``compute`` gradients rounded once to each input's dtype).
    Accepts any ``inverse`` that indexes ``rows``, permutation or not."""
    tokens, top_k = inverse.shape
    pairs = rows.to(compute)[inverse.reshape(-1).long()].view(tokens, top_k, rows.shape[1])
    return (pairs * weights.to(compute).unsqueeze(-1)).sum(1).to(rows.dtype)
