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

Read top-down: the launcher, the compile function, the custom ops, the public function, then
the torch fallback and the fp32 reference.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from custom_kernels.core import elements
from custom_kernels import jit
from custom_kernels.core import fallback
from custom_kernels.core.eager import plain_eager
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.launch import launch

SOURCE = "swiglu.cu"
KERNELS = {False: "swiglu_fwd_kernel", True: "swiglu_bwd_kernel"}
BLOCK = 256
MAX_GRID_Y = 65535
DTYPE_CODES = elements.float_codes()


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def _defines(dtype_code: int, vec: bool) -> dict:
    return {"DTYPE": dtype_code, "VEC": int(vec), "BLOCK": BLOCK}


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
def _kernel(backward: bool, dtype_code: int, vec: bool, device: int):
    """The loaded kernel; cached here too, which saves get_kernel's key normalisation (a few
    microseconds, more than this whole function's share of a launch)."""
    return jit.get_kernel(SOURCE, KERNELS[backward], device=device,
                          defines=_defines(dtype_code, vec))


def _launch(backward: bool, rows: int, inter: int, tensors) -> None:
    """Forward: ``tensors`` = (gate_up [rows, 2I], y [rows, I]); backward: (dy [rows, I],
    gate_up, d_gate_up [rows, 2I]); 2-D views with a unit last stride, nothing empty."""
    if not all(t.is_cuda for t in tensors):  # a custom op called with other tensors
        fallback.require_cuda({f"argument {i}": t for i, t in enumerate(tensors)},
                              f"custom_kernels::swiglu_{'bwd' if backward else 'fwd'}")
    first = tensors[0]
    strides = tuple(t.stride(0) if rows > 1 else 0 for t in tensors)
    vec = vector_ok(first.element_size(), inter, strides, [t.data_ptr() for t in tensors])
    device = first.device.index
    kernel = _kernel(backward, DTYPE_CODES[first.dtype], vec, device)
    grid, shift = grid_shape(rows, inter // (16 // first.element_size()) if vec else inter)
    launch(kernel, *(t.data_ptr() for t in tensors), rows, inter, *strides, shift, grid=grid,
           block=BLOCK, device=device)


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def compile_swiglu(dtype: str = "bfloat16", vec: bool = True, arch: str = jit.DEFAULT_ARCH, *,
                   backward: bool = False) -> Path:
    """The cubin that ``swiglu`` (``backward``: its gradient) runs for ``dtype`` with 16-byte
    accesses (``vec``) or one element an access. ``I`` is not compiled in: one cubin serves
    every size."""
    return jit.compile_cubin(SOURCE, defines=_defines(elements.element(dtype).code, vec),
                             name_expressions=(KERNELS[backward],), arch=arch)


# ---------------------------------------------------------------------------------------------
# Custom ops: real impl, fake impl and autograd next to each other
# ---------------------------------------------------------------------------------------------

def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as [rows, width] with a unit last stride (a view when possible, else a copy: an
    expanded gradient, or a layout torch.compile chose)."""
    t2 = t.reshape(-1, width)
    return t2 if width <= 1 or t2.stride(1) == 1 else t2.contiguous()


def _fwd_impl(gate_up: torch.Tensor) -> torch.Tensor:
    width = gate_up.shape[-1]
    inter = width // 2
    y = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if y.numel():
        gu2 = _rows(gate_up, width)
        _launch(False, gu2.shape[0], inter, (gu2, y.view(-1, inter)))
    return y


def _bwd_impl(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    width = gate_up.shape[-1]
    inter = width // 2
    dgu = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    if dgu.numel():
        gu2 = _rows(gate_up, width)
        _launch(True, gu2.shape[0], inter, (_rows(dy, inter), gu2, dgu.view(-1, width)))
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
    Eagerly, the same kernel without torch's Python custom-op dispatch (about 15 us a call,
    more than the launch): directly when no gradient is needed, else through an
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


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """fp32 math rounded once to ``gate_up``'s dtype, with autograd (its gradient is the fp32
    gradient rounded once: what the backward kernel computes)."""
    inter = gate_up.shape[-1] // 2
    x = gate_up.float()
    return (torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]).to(gate_up.dtype)
