"""SwiGLU of a merged gate+up projection in one launch (``csrc/swiglu.cu``), forward and backward.

``swiglu(gate_up)`` is Hugging Face's LlamaMLP activation ``act_fn(gate_proj(x)) * up_proj(x)``
(``act_fn`` SiLU) computed from the output of one GEMM whose weight is
``cat([gate_proj.weight, up_proj.weight])``: ``gate_up`` ``[..., 2 * I]`` holds ``gate =
gate_up[..., :I]`` then ``up = gate_up[..., I:]``, and the result is ``silu(gate) * up``
``[..., I]``, contiguous, in ``gate_up``'s dtype. Eager HF runs two kernels (SiLU, product) and
writes the SiLU output in between; this reads ``gate_up`` once and writes the result once.

Values: fp32, fp16 or bf16, any ``I >= 1`` (16-byte accesses when ``I``, the row strides and the
pointers allow, else one element an access), rows with any strides and a unit last stride (a
strided view is read in place; rows that cannot be one view are copied). The forward result
is HF's bit for bit in every dtype: in bf16 and fp16 the kernel rounds SiLU to the dtype before
the product, as eager torch does, with torch's fp32 formula (see the .cu file). The backward pass is one launch for both halves of
``d_gate_up`` ``[..., 2 * I]`` (contiguous), fp32 math rounded once: within one rounding of the
fp32 gradient, not HF's autograd bits (which rounds ``dy * up`` and ``silu(gate)`` first).

Input refused on every device, with UnsupportedInputError: a tensor of no dimension, an odd
last dimension, a dtype other than fp32 / fp16 / bf16, and a last dimension that is not
contiguous (``.contiguous()`` is left to the caller, who sees the copy; the custom ops
themselves copy such tensors, so that any gradient layout works). Zero rows (or ``I = 0``)
give an empty result.

Everything runs on torch's current stream with memory from torch's allocator and no host sync:
eagerly, under ``torch.compile(fullgraph=True)`` (the custom ops ``custom_kernels::swiglu_fwd``
/ ``swiglu_bwd`` with their fakes and autograd) and in CUDA graphs (run once before capturing:
the kernel is compiled and loaded on first use). Tensors off a CUDA device run ``torch_swiglu``
(the CPU rule, ``custom_kernels.core.fallback``).

``swiglu_fp8(gate_up, granularity)`` (quantization where the data already is) returns
``(y, q, scale)``: ``y`` as ``swiglu`` computes it and, from the same kernel, its FP8
quantization, equal to ``fp8_quant.quantize(y, granularity)`` bit for bit ("row" or
"block_1x128"; its docstring says more), for down_proj's FP8 GEMM; the op is
``custom_kernels::swiglu_fp8_fwd``. ``swiglu_with_amax(gate_up, grad_amax=)`` returns ``(y,
amax)`` for the tensorwise recipe, whose one scale needs the whole tensor's amax first: the
kernels reduce y's amax, and in the backward d_gate_up's (``custom_kernels.fp8.grad_amax``), as
they write them, so that neither is read again for it.

Read top-down: the launchers, the compile functions, the custom ops, the public functions, then
the torch fallback and the fp32 reference.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from custom_kernels.core import elements
from custom_kernels import jit
from custom_kernels.parallel import sharding_rules
from custom_kernels.core import fallback
from custom_kernels.core.eager import plain_eager
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.fp8.fp8_quant import (Granularity, check_fused_output, empty_scale, rows_team,
                                      torch_quantize)
from custom_kernels.fp8.grad_amax import GradAmax
from custom_kernels.launch import launch

SOURCE = "swiglu.cu"
KERNELS = {False: "swiglu_fwd_kernel", True: "swiglu_bwd_kernel"}
FP8_KERNEL = "swiglu_fp8_kernel"
BLOCK = 256  # also the FP8 kernel's, whose teams fp8_quant.rows_team sizes for 256 threads
MAX_GRID_Y = 65535
MAX_GRID = 1 << 20  # blocks of the FP8 kernel's 1-D grid; it loops past that
NV = 8  # 16-byte slots of y an FP8 kernel thread keeps in registers
AMAX_BLOCKS = 2048  # about how many blocks (and atomics) an AMAX launch spreads a tensor over
DTYPE_CODES = elements.float_codes()
# The granularities the FP8 kernel writes, and their codes (its MODE).
FP8_MODES = {Granularity.ROW: 1, Granularity.BLOCK_1X128: 2}


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def _defines(dtype_code: int, vec: bool, amax: bool = False) -> dict:
    return {"DTYPE": dtype_code, "VEC": int(vec), "BLOCK": BLOCK, **({"AMAX": 1} if amax else {})}


def vector_ok(itemsize: int, inter: int, strides=(), pointers=()) -> bool:
    """The 16-byte path: ``I`` (the up half starts I elements after the gate half), every row
    stride and every pointer multiples of 16 bytes. Otherwise one element an access."""
    vw = 16 // itemsize
    return inter % vw == 0 and all(s % vw == 0 for s in strides) and \
        all(p % 16 == 0 for p in pointers)


def grid_shape(rows: int, vectors: int) -> tuple[tuple[int, int], int]:
    """((blocks over a row's vectors, row groups), shift): a block is ``BLOCK >> shift`` rows of
    ``1 << shift`` vectors, the smallest power of two covering a row (at most BLOCK), so that
    short rows still fill the block; the kernel loops over row groups past MAX_GRID_Y."""
    lanes = min(BLOCK, 1 << max(vectors - 1, 0).bit_length())
    rows_per_block = BLOCK // lanes
    grid = (-(-vectors // lanes), min(-(-rows // rows_per_block), MAX_GRID_Y))
    return grid, lanes.bit_length() - 1


@functools.lru_cache(maxsize=None)
def _kernel(backward: bool, dtype_code: int, vec: bool, device: int, amax: bool = False):
    """The loaded kernel; cached here too, which saves get_kernel's key normalisation (a few
    microseconds, more than this whole function's share of a launch)."""
    return jit.get_kernel(SOURCE, KERNELS[backward], device=device,
                          defines=_defines(dtype_code, vec, amax))


def _launch(backward: bool, rows: int, inter: int, tensors, amax=None) -> None:
    """Forward: ``tensors`` = (gate_up [rows, 2I], y [rows, I]); backward: (dy [rows, I],
    gate_up, d_gate_up [rows, 2I]); 2-D views with a unit last stride, nothing empty.
    ``amax``: a zeroed float32 word that the kernel's AMAX build reduces the output's largest
    |value| into, its grid capped near ``AMAX_BLOCKS`` blocks (one atomic each)."""
    if not all(t.is_cuda for t in tensors):  # a custom op called with other tensors
        fallback.require_cuda({f"argument {i}": t for i, t in enumerate(tensors)},
                              f"custom_kernels::swiglu_{'bwd' if backward else 'fwd'}")
    first = tensors[0]
    strides = tuple(t.stride(0) if rows > 1 else 0 for t in tensors)
    vec = vector_ok(first.element_size(), inter, strides, [t.data_ptr() for t in tensors])
    device = first.device.index
    kernel = _kernel(backward, DTYPE_CODES[first.dtype], vec, device, amax is not None)
    grid, shift = grid_shape(rows, inter // (16 // first.element_size()) if vec else inter)
    if amax is not None:
        grid = (grid[0], max(1, min(grid[1], AMAX_BLOCKS // grid[0])))
    launch(kernel, *(t.data_ptr() for t in tensors), rows, inter, *strides, shift,
           amax.data_ptr() if amax is not None else 0, grid=grid, block=BLOCK, device=device)


def _fp8_defines(dtype_code: int, vec: bool, mode: int, fp8_code: int) -> dict:
    return {**_defines(dtype_code, vec), "FP8": fp8_code, "MODE": mode, "NV": NV}


@functools.lru_cache(maxsize=None)
def _fp8_kernel(dtype_code: int, vec: bool, mode: int, fp8_code: int, device: int):
    return jit.get_kernel(SOURCE, FP8_KERNEL, device=device,
                          defines=_fp8_defines(dtype_code, vec, mode, fp8_code))


def _launch_fp8(gu2, y2, q2, scale, g: Granularity) -> None:
    """gu2 [rows, 2I] (unit last stride, not empty), y2 (or None) and q2 [rows, I] contiguous:
    a team of threads a row (or a row's 128 columns), as fp8_quant's rows kernel."""
    rows, width = gu2.shape
    inter = width // 2
    vec = vector_ok(gu2.element_size(), inter, (gu2.stride(0) if rows > 1 else 0,),
                    (gu2.data_ptr(),))
    shift = rows_team(g, gu2.element_size(), inter)
    group_cols = 128 if g is Granularity.BLOCK_1X128 else inter
    grid = min(-(-rows * (inter // group_cols) // (BLOCK >> shift)), MAX_GRID)
    device = gu2.device.index
    kernel = _fp8_kernel(DTYPE_CODES[gu2.dtype], vec, FP8_MODES[g],
                         elements.element(q2.dtype).code, device)
    launch(kernel, gu2.data_ptr(), y2.data_ptr() if y2 is not None else 0, q2.data_ptr(),
           scale.data_ptr(), rows, inter, gu2.stride(0), group_cols, shift, grid=grid,
           block=BLOCK, device=device)


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def compile_swiglu(dtype: str = "bfloat16", vec: bool = True, arch: str = jit.DEFAULT_ARCH, *,
                   backward: bool = False, amax: bool = False) -> Path:
    """The cubin that ``swiglu`` (``backward``: its gradient) runs for ``dtype`` with 16-byte
    accesses (``vec``) or one element an access; ``amax``: the build that also reduces the
    output's amax (``swiglu_with_amax``). ``I`` is not compiled in: one cubin serves every
    size."""
    return jit.compile_cubin(SOURCE, defines=_defines(elements.element(dtype).code, vec, amax),
                             name_expressions=(KERNELS[backward],), arch=arch)


def compile_swiglu_fp8(dtype: str = "bfloat16", vec: bool = True, granularity: str = "row",
                       fp8: str = "e4m3", arch: str = jit.DEFAULT_ARCH) -> Path:
    """The cubin that ``swiglu_fp8`` runs for ``dtype``, 16-byte accesses or not, a granularity
    and an FP8 type; no extent is compiled in."""
    defines = _fp8_defines(elements.element(dtype).code, vec,
                           FP8_MODES[_fp8_granularity(granularity, "compile_swiglu_fp8")],
                           elements.element(fp8).code)
    return jit.compile_cubin(SOURCE, defines=defines, name_expressions=(FP8_KERNEL,), arch=arch)


# ---------------------------------------------------------------------------------------------
# Custom ops: real impl, fake impl and autograd next to each other
# ---------------------------------------------------------------------------------------------

def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as [rows, width] with a unit last stride (a view when possible, else a copy: an
    expanded gradient, or a layout torch.compile chose)."""
    t2 = t.reshape(-1, width)
    return t2 if width <= 1 or t2.stride(1) == 1 else t2.contiguous()


def _fwd_impl(gate_up: torch.Tensor, amax=None) -> torch.Tensor:
    """``amax``: a zeroed float32 word the kernel reduces y's amax into."""
    width = gate_up.shape[-1]
    inter = width // 2
    y = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if y.numel():
        gu2 = _rows(gate_up, width)
        _launch(False, gu2.shape[0], inter, (gu2, y.view(-1, inter)), amax)
    return y


def _bwd_impl(dy: torch.Tensor, gate_up: torch.Tensor, amax=None) -> torch.Tensor:
    """``amax``: a zeroed float32 word the kernel reduces d_gate_up's amax into."""
    width = gate_up.shape[-1]
    inter = width // 2
    dgu = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    if dgu.numel():
        gu2 = _rows(gate_up, width)
        _launch(True, gu2.shape[0], inter, (_rows(dy, inter), gu2, dgu.view(-1, width)), amax)
    return dgu


@torch.library.custom_op("custom_kernels::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate_up: torch.Tensor) -> torch.Tensor:
    """Returns ``silu(gate) * up`` [..., I], contiguous."""
    _check_tensor(gate_up, "custom_kernels::swiglu_fwd")
    return _fwd_impl(gate_up)


@swiglu_fwd.register_fake
def _(gate_up):
    _check_tensor(gate_up, "custom_kernels::swiglu_fwd")
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("custom_kernels::swiglu_bwd", mutates_args=())
def swiglu_bwd(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """Returns ``d_gate_up`` [..., 2I], contiguous: (d_gate, d_up) for the output gradient
    ``dy`` [..., I] (any strides)."""
    _check_bwd(dy, gate_up)
    return _bwd_impl(dy, gate_up)


@swiglu_bwd.register_fake
def _(dy, gate_up):
    _check_bwd(dy, gate_up)
    return gate_up.new_empty(gate_up.shape)


def _setup(ctx, inputs, output):
    (gate_up,) = inputs
    ctx.save_for_backward(gate_up)


def _backward(ctx, dy):
    (gate_up,) = ctx.saved_tensors
    return torch.ops.custom_kernels.swiglu_bwd(dy, gate_up)


torch.library.register_autograd("custom_kernels::swiglu_fwd", _backward, setup_context=_setup)
# DTensor inputs (tensor parallelism) run on each rank's shard: custom_kernels.parallel.sharding_rules.
sharding_rules.register("swiglu_fwd", "swiglu_bwd")


def _fp8_impl(gate_up, g: Granularity, fp8_dtype, write_y: bool):
    """(y or None, q, scale) from the kernel (CUDA tensors)."""
    width = gate_up.shape[-1]
    inter = width // 2
    shape = (*gate_up.shape[:-1], inter)
    rows = gate_up.numel() // width
    y = torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device) if write_y else None
    q = torch.empty(shape, dtype=fp8_dtype, device=gate_up.device)
    scale = empty_scale(g, rows, inter, gate_up.device)
    if rows:
        _launch_fp8(_rows(gate_up, width), y.view(-1, inter) if y is not None else None,
                    q.view(-1, inter), scale, g)
    return y, q, scale


@torch.library.custom_op("custom_kernels::swiglu_fp8_fwd", mutates_args=())
def swiglu_fp8_fwd(gate_up: torch.Tensor, granularity: str, fp8_dtype: torch.dtype,
                   write_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``silu(gate) * up`` or an empty tensor, its FP8 quantization q, the scales)."""
    g = _check_fp8(gate_up, granularity, fp8_dtype, "custom_kernels::swiglu_fp8_fwd")
    impl = _fp8_impl if gate_up.is_cuda else torch_swiglu_fp8
    y, q, scale = impl(gate_up, g, fp8_dtype, write_y)
    return (y if y is not None else gate_up.new_empty(0)), q, scale


@swiglu_fp8_fwd.register_fake
def _(gate_up, granularity, fp8_dtype, write_y):
    g = _check_fp8(gate_up, granularity, fp8_dtype, "custom_kernels::swiglu_fp8_fwd")
    inter = gate_up.shape[-1] // 2
    shape = (*gate_up.shape[:-1], inter)
    return (gate_up.new_empty(shape if write_y else (0,)),
            gate_up.new_empty(shape, dtype=fp8_dtype),
            empty_scale(g, gate_up.numel() // gate_up.shape[-1], inter, gate_up.device))


def _fp8_setup(ctx, inputs, output):
    gate_up = inputs[0]
    _y, q, scale = output
    ctx.save_for_backward(gate_up)
    ctx.mark_non_differentiable(q, scale)


def _fp8_backward(ctx, dy, _d_q, _d_scale):
    (gate_up,) = ctx.saved_tensors
    want = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    if dy is None or tuple(dy.shape) != want:  # no y written: nothing flows back
        return torch.zeros_like(gate_up), None, None, None
    return torch.ops.custom_kernels.swiglu_bwd(dy, gate_up), None, None, None


torch.library.register_autograd("custom_kernels::swiglu_fp8_fwd", _fp8_backward,
                                setup_context=_fp8_setup)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]`` of shape [..., I], HF's
    ``act_fn(gate_proj(x)) * up_proj(x)`` bit for bit in bf16 / fp16; see the module
    docstring. Tensors off a CUDA device run ``torch_swiglu`` (logged once)."""
    _check(gate_up)
    if not gate_up.is_cuda and fallback.off_cuda({"gate_up": gate_up}, "swiglu",
                                                  "torch_swiglu"):
        return torch_swiglu(gate_up)
    return _swiglu(gate_up)


def _swiglu(gate_up):
    """Under torch.compile (and export), the custom op: the graph sees it with its fake impl.
    Eagerly, the same kernel without torch's Python custom-op dispatch (more host
    time a call than the launch): directly when no gradient is needed, else through an
    autograd.Function whose backward launches the backward kernel."""
    if torch.compiler.is_compiling() or not plain_eager(gate_up):
        return torch.ops.custom_kernels.swiglu_fwd(gate_up)
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return _EagerSwiGLU.apply(gate_up)
    return _fwd_impl(gate_up)


class _EagerSwiGLU(torch.autograd.Function):
    """Eager autograd, calling the launchers directly."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _fwd_impl(gate_up)

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        return _bwd_impl(dy, gate_up)


def swiglu_with_amax(gate_up: torch.Tensor, *, grad_amax: Optional[GradAmax] = None):
    """``(y, amax)``: ``y = swiglu(gate_up)`` (the same bits) and, from the same kernel, y's
    largest |value| as a float32 scalar tensor on the device (``fp8_quant.tensor_amax(y)`` bit
    for bit), so that a tensorwise FP8 ``quantize(y, "tensor", amax=amax)`` (down_proj's input)
    reads y once instead of twice. ``grad_amax`` (``custom_kernels.fp8.grad_amax``): the backward
    kernel also reduces d_gate_up's amax and records it there, for the FP8 backward of the GEMM
    that wrote gate_up. Where the kernels do not run eagerly (torch.compile, tensors off a CUDA
    device, tensor subclasses) this is ``(swiglu(gate_up), None)`` and ``grad_amax`` stays
    empty: the callers compute their own amaxes."""
    _check(gate_up)
    if not gate_up.is_cuda or torch.compiler.is_compiling() or not plain_eager(gate_up):
        return swiglu(gate_up), None
    amax = torch.zeros((), dtype=torch.float32, device=gate_up.device)
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return _EagerSwiGLUAmax.apply(gate_up, amax, grad_amax), amax
    return _fwd_impl(gate_up, amax), amax


class _EagerSwiGLUAmax(torch.autograd.Function):
    """``swiglu`` whose kernels also reduce the amaxes of what they write."""

    @staticmethod
    def forward(ctx, gate_up, amax, grad_amax):
        ctx.save_for_backward(gate_up)
        ctx.grad_amax = grad_amax
        return _fwd_impl(gate_up, amax)

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        slot = ctx.grad_amax
        if slot is None:
            return _bwd_impl(dy, gate_up), None, None
        dgu = _bwd_impl(dy, gate_up, slot.buffer(gate_up))
        slot.record(dgu)
        return dgu, None, None


def swiglu_fp8(gate_up: torch.Tensor, granularity="row", *,
               fp8_dtype: torch.dtype = torch.float8_e4m3fn, write_y: bool = True):
    """``(y, q, scale)``: ``y = swiglu(gate_up)`` (the same bits) and its FP8 quantization from
    the same kernel: ``q`` ([..., I], ``fp8_dtype`` e4m3 or e5m2, contiguous) and ``scale``
    equal ``fp8_quant.quantize(y.reshape(-1, I), granularity)`` bit for bit, so that down_proj's
    FP8 GEMM reads ``q`` instead of quantizing ``y`` in a pass of its own. ``granularity``:
    "row" (``scale`` (rows, 1)) or "block_1x128" (``scale`` (rows, I / 128) column-major; I a
    multiple of 128); I a multiple of 16 (an FP8 GEMM's K). "tensor" needs every row's amax
    before any value is quantized: refused (quantize ``y`` with ``fp8_quant.quantize``).

    ``y`` is not needed by SwiGLU's own backward (it recomputes from ``gate_up``); it is the
    input of down_proj, whose autograd and wgrad (``y`` transposed, quantized along the tokens)
    need it when training. ``write_y=False`` skips it (``None`` comes back), for calls that need
    no gradient (inference). Gradients flow to ``gate_up`` through ``y`` as in ``swiglu``;
    ``q`` and ``scale`` carry none. Tensors off a CUDA device run ``torch_swiglu`` then
    ``fp8_quant.torch_quantize`` (logged once)."""
    _check(gate_up)
    g = _check_fp8(gate_up, granularity, fp8_dtype, "swiglu_fp8")
    wants_grad = torch.is_grad_enabled() and gate_up.requires_grad
    if wants_grad and not write_y:
        raise UnsupportedInputError("swiglu_fp8: write_y=False writes no differentiable "
                                    "output; call it under torch.no_grad() or keep y")
    if not gate_up.is_cuda and fallback.off_cuda({"gate_up": gate_up}, "swiglu_fp8",
                                                  "torch_swiglu and torch_quantize"):
        return torch_swiglu_fp8(gate_up, g, fp8_dtype, write_y)
    if torch.compiler.is_compiling() or not plain_eager(gate_up):
        y, q, scale = torch.ops.custom_kernels.swiglu_fp8_fwd(gate_up, g.value, fp8_dtype,
                                                              write_y)
        return (y if write_y else None), q, scale
    if wants_grad:
        return _EagerSwiGLUFp8.apply(gate_up, g, fp8_dtype)
    return _fp8_impl(gate_up, g, fp8_dtype, write_y)


class _EagerSwiGLUFp8(torch.autograd.Function):
    """Eager autograd of ``swiglu_fp8``: the backward is ``swiglu``'s."""

    @staticmethod
    def forward(ctx, gate_up, g, fp8_dtype):
        y, q, scale = _fp8_impl(gate_up, g, fp8_dtype, True)
        ctx.save_for_backward(gate_up)
        ctx.mark_non_differentiable(q, scale)
        ctx.set_materialize_grads(False)
        return y, q, scale

    @staticmethod
    def backward(ctx, dy, _d_q, _d_scale):
        (gate_up,) = ctx.saved_tensors
        if dy is None:
            return torch.zeros_like(gate_up), None, None
        return _bwd_impl(dy, gate_up), None, None


def _check_fp8(gate_up, granularity, fp8_dtype, entry: str) -> Granularity:
    """The FP8 output's rules (``_check_tensor``'s first), on every device."""
    _check_tensor(gate_up, entry)
    g = _fp8_granularity(granularity, entry)
    check_fused_output(entry, g, fp8_dtype, gate_up.shape[-1] // 2, "I (half the last dimension)")
    return g


def _fp8_granularity(granularity, entry: str) -> Granularity:
    try:
        g = Granularity(granularity)
    except ValueError:
        g = None
    if g not in FP8_MODES:
        raise UnsupportedInputError(
            f"{entry}: granularity {granularity!r} is not written by the SwiGLU kernel (it "
            f"writes 'row' and 'block_1x128'); 'tensor' needs the whole tensor's amax before "
            f"any value is quantized: quantize y with custom_kernels.fp8.fp8_quant.quantize instead")
    return g


def _check(gate_up) -> None:
    """The public function's input rules, on any device (the device rule comes after them)."""
    _check_tensor(gate_up, "swiglu")
    if gate_up.shape[-1] > 1 and gate_up.stride(-1) != 1:
        raise UnsupportedInputError(
            f"swiglu: gate_up has a non-contiguous last dimension (stride "
            f"{gate_up.stride(-1)}); call .contiguous() first")


def _check_tensor(gate_up, entry: str) -> None:
    """The rules the ops share with the public function (the ops copy a strided last
    dimension instead of refusing it)."""
    if not isinstance(gate_up, torch.Tensor):
        raise UnsupportedInputError(f"{entry}: gate_up must be a torch.Tensor, got "
                                    f"{type(gate_up).__name__}")
    if gate_up.dtype not in DTYPE_CODES:
        raise UnsupportedInputError(f"{entry}: gate_up must be float32, float16 or bfloat16, "
                                    f"not {gate_up.dtype}")
    if gate_up.dim() == 0:
        raise UnsupportedInputError(f"{entry}: gate_up must be [..., 2 * I] (gate then up), "
                                    f"got a tensor of no dimension")
    if gate_up.shape[-1] % 2:
        raise UnsupportedInputError(
            f"{entry}: the last dimension of gate_up must be even (gate then up, 2 * I), got "
            f"{gate_up.shape[-1]}")


def _check_bwd(dy, gate_up) -> None:
    entry = "custom_kernels::swiglu_bwd"
    _check_tensor(gate_up, entry)
    want = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    if not isinstance(dy, torch.Tensor) or tuple(dy.shape) != want or dy.dtype != gate_up.dtype:
        raise UnsupportedInputError(
            f"{entry}: dy must be a {gate_up.dtype} tensor of shape {want} (gate_up's shape "
            f"with half its last dimension), got {getattr(dy, 'dtype', type(dy).__name__)} "
            f"{tuple(getattr(dy, 'shape', ()))}")


# ---------------------------------------------------------------------------------------------
# Torch fallback (HF's computation) and the fp32 reference
# ---------------------------------------------------------------------------------------------

def torch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``swiglu`` in torch, for tensors off a CUDA device: HF's ``F.silu(gate) * up``, with
    autograd (the very rounding the kernel reproduces)."""
    inter = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def torch_swiglu_fp8(gate_up: torch.Tensor, granularity="row", fp8_dtype=torch.float8_e4m3fn,
                     write_y: bool = True):
    """``swiglu_fp8`` in torch (inputs assumed checked): ``torch_swiglu`` (with autograd), then
    ``fp8_quant.torch_quantize`` of its result."""
    y = torch_swiglu(gate_up)
    q, scale = torch_quantize(y.detach().reshape(-1, y.shape[-1]), granularity,
                              fp8_dtype=fp8_dtype)
    return (y if write_y else None), q.view(y.shape), scale


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """fp32 math rounded once to ``gate_up``'s dtype, with autograd (its gradient is the fp32
    gradient rounded once: what the backward kernel computes)."""
    inter = gate_up.shape[-1] // 2
    x = gate_up.float()
    return (torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]).to(gate_up.dtype)
