"""Rotary position embedding of q and k in one launch (``csrc/rotary.cu``), forward and backward.

``apply_rotary(q, k, cos, sin)`` is Hugging Face's ``apply_rotary_pos_emb(q.transpose(1, 2),
k.transpose(1, 2), cos, sin)`` (``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
cat(-x2, x1)``) fused with the transpose that follows the projections: ``q`` ``[B, S, Hq, D]``
and ``k`` ``[B, S, Hk, D]`` are the views ``proj(x).view(B, S, -1, D)`` (any strides with a unit
last stride: column slices of one merged QKV output are read in place), ``cos`` / ``sin``
``[B, S, D]`` or ``[1, S, D]`` (what HF's rotary module returns, ``q``'s dtype, unit last
stride). It returns ``q_out`` ``[B, Hq, S, D]`` and ``k_out`` ``[B, Hk, S, D]`` (the shapes
scaled_dot_product_attention and HF's KV cache take). Eagerly they are laid out in the
projections' memory order (``q_out.transpose(1, 2)`` is contiguous): scaled_dot_product_attention
writes its output in its query's memory order (cuDNN and flash alike), so the attention output
then needs no copy on its way back to ``[B, S, H * D]`` for o_proj. The custom op (what
torch.compile traces) returns them contiguous, the layout its graphs were measured with; a
compiled graph plans its own copies. Both are one launch that reads q, k, cos and sin
once and writes each output once; eager HF runs five elementwise kernels for each of q and k
(neg, cat, two products, the sum), each reading and writing the whole tensor.

Values: fp32, fp16 or bf16, ``D`` even (any size; models use 64 to 256). In bf16 and fp16 the
result is HF's bit for bit: the kernel rounds each product and the sum as eager torch does (see
the .cu file). The backward pass, also one launch for both gradients, is fp32 math rounded once
and returns ``dq`` / ``dk`` in the input layout ``[B, S, H, D]``, contiguous. cos and sin get no
gradient: HF computes them from non-trainable buffers. When either requires a gradient, the torch
formula runs instead (logged once), so that a model that does train them still gets the right
gradients.

Everything runs on torch's current stream with memory from torch's allocator and no host sync:
eagerly, under ``torch.compile(fullgraph=True)`` (the custom ops ``custom_kernels::rotary_fwd`` /
``rotary_bwd`` with their fakes and autograd) and in CUDA graphs. Tensors off a CUDA device run
``rotary_reference`` (the CPU rule, ``custom_kernels.core.fallback``); input the kernel refuses
raises UnsupportedInputError naming the problem, on every device.

Read top-down: the launcher, the compile function, the custom ops, the public function, then the
torch reference.
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
from custom_kernels.launch import launch

SOURCE = "rotary.cu"
BLOCK = 128
HEADS = 4  # heads per thread: its cos / sin registers serve them all, their loads fly together
MAX_GRID_Y = 65535
DTYPE_CODES = elements.float_codes()


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def kernel_name(backward: bool) -> str:
    return f"rotary_kernel<{'true' if backward else 'false'}>"


def _defines(dtype_code: int, vw: int) -> dict:
    return {"DTYPE": dtype_code, "VW": vw, "BLOCK": BLOCK, "HEADS": HEADS}


def vector_width(itemsize: int, half: int, strides=(), pointers=()) -> int:
    """Elements per access: the widest of 16, 8, 4 and 2 bytes (down to one element) that
    divides the half head (each thread's vectors start in both halves), every stride and every
    pointer; the kernel's accesses are then aligned."""
    for nbytes in (16, 8, 4, 2):
        vw = nbytes // itemsize
        if vw < 1:
            break
        if half % vw == 0 and all(s % vw == 0 for s in strides) and \
                all(p % nbytes == 0 for p in pointers):
            return vw
    return 1


def _strides(t: Optional[torch.Tensor], dims: int) -> tuple:
    """The batch, sequence (and head) strides of a [B, S, (H,) D] view, or zeros for no tensor.
    A dimension of size 1 gets 0: that broadcasts a cos / sin of batch 1, and its stride, never
    used, cannot narrow the accesses."""
    if t is None:
        return (0,) * dims
    return tuple(0 if n == 1 else s for n, s in zip(t.shape[:dims], t.stride()[:dims]))


def _launch(a, b, ya, yb, cos, sin, backward: bool) -> None:
    """``ya = rotary(a)``, ``yb = rotary(b)`` (or the backward pass): ``a``, ``b``, ``ya``,
    ``yb`` are [B, S, H, D] views with a unit last stride (None: no heads), cos / sin
    [B or 1, S, D]; nothing is empty."""
    first = a if a is not None else b
    batch, seq, _, d = first.shape
    heads_a = a.shape[2] if a is not None else 0
    heads_b = b.shape[2] if b is not None else 0
    rows, half = batch * seq, d // 2
    tensors = [t for t in (a, b, ya, yb, cos, sin) if t is not None]
    strides = (*_strides(a, 3), *_strides(b, 3), *_strides(ya, 3), *_strides(yb, 3),
               *_strides(cos, 2), *_strides(sin, 2))
    vw = vector_width(first.element_size(), half, strides, [t.data_ptr() for t in tensors])
    device = first.device.index
    kernel = _kernel(backward, DTYPE_CODES[first.dtype], vw, device)
    groups = -(-(heads_a + heads_b) // HEADS)
    grid = (-(-rows * (half // vw) // BLOCK), min(groups, MAX_GRID_Y))
    launch(kernel, _ptr(a), _ptr(b), _ptr(ya), _ptr(yb), cos.data_ptr(), sin.data_ptr(), rows,
           seq, half, heads_a, heads_b, *strides, grid=grid, block=BLOCK, device=device)


@functools.lru_cache(maxsize=None)
def _kernel(backward: bool, dtype_code: int, vw: int, device: int):
    """The loaded kernel; cached here too, which saves get_kernel's key normalisation (host
    time a call, at the start of a step where the GPU waits on the host)."""
    return jit.get_kernel(SOURCE, kernel_name(backward), device=device,
                          defines=_defines(dtype_code, vw))


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def compile_rotary(dtype: str = "bfloat16", head_dim: int = 128, backward: bool = False,
                   arch: str = jit.DEFAULT_ARCH) -> Path:
    """The cubin that ``apply_rotary`` (``backward``: its gradient) runs for aligned tensors of
    ``dtype`` with heads of ``head_dim``. The head size is not compiled in (one cubin serves
    every size with the same vector width); it only picks the widest vector its half allows."""
    itemsize = elements.element(dtype).bytes
    vw = vector_width(itemsize, head_dim // 2)
    return jit.compile_cubin(SOURCE, defines=_defines(elements.element(dtype).code, vw),
                             name_expressions=(kernel_name(backward),), arch=arch)


# ---------------------------------------------------------------------------------------------
# Custom ops: real impl, fake impl and autograd next to each other
# ---------------------------------------------------------------------------------------------

def _unit_last(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` with a unit last stride (a copy only when it has another: an expanded gradient,
    or a layout torch.compile chose)."""
    if t is None or t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def head_major(x: torch.Tensor, projection_order: bool = True) -> torch.Tensor:
    """A new tensor for the rotary output of ``x`` [B, S, H, D]: shaped [B, H, S, D], laid out
    as [B, S, H, D] (``projection_order``, the eager layout: the module docstring says why) or
    contiguous (the custom op's)."""
    batch, seq, heads, d = x.shape
    if projection_order:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device).transpose(1, 2)
    return torch.empty((batch, heads, seq, d), dtype=x.dtype, device=x.device)


def _fwd_impl(q, k, cos, sin, projection_order: bool = True):
    q_out, k_out = head_major(q, projection_order), head_major(k, projection_order)
    # The outputs as [B, S, H, D] views, the layout the kernel walks; an empty pair is skipped.
    (a, ya), (b, yb) = (_live(x, y.transpose(1, 2)) for x, y in ((q, q_out), (k, k_out)))
    if a is not None or b is not None:
        _launch(a, b, ya, yb, _unit_last(cos), _unit_last(sin), backward=False)
    return q_out, k_out


def _bwd_impl(dq_out, dk_out, cos, sin):
    """(dq, dk) in [B, S, H, D], contiguous; None for a gradient not given."""
    dq, dk = (None if g is None else
              torch.empty((g.shape[0], g.shape[2], g.shape[1], g.shape[3]), dtype=g.dtype,
                          device=g.device)
              for g in (dq_out, dk_out))
    (a, ya), (b, yb) = (_live(g if g is None else g.transpose(1, 2), y)
                        for g, y in ((dq_out, dq), (dk_out, dk)))
    if a is not None or b is not None:
        _launch(a, b, ya, yb, _unit_last(cos), _unit_last(sin), backward=True)
    return dq, dk


def _live(x, y):
    """(x with a unit last stride, y), or (None, None) when there is nothing to compute."""
    if x is None or x.numel() == 0:
        return None, None
    return _unit_last(x), y


@torch.library.custom_op("custom_kernels::rotary_fwd", mutates_args=())
def rotary_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q_out [B, Hq, S, D], k_out [B, Hk, S, D]), contiguous."""
    return _fwd_impl(q, k, cos, sin, projection_order=False)


@rotary_fwd.register_fake
def _(q, k, cos, sin):
    return head_major(q, False), head_major(k, False)


@torch.library.custom_op("custom_kernels::rotary_bwd", mutates_args=())
def rotary_bwd(dq_out: Optional[torch.Tensor], dk_out: Optional[torch.Tensor],
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dq [B, S, Hq, D], dk [B, S, Hk, D]), contiguous; an empty tensor stands for the
    gradient of an output whose gradient is None (custom ops return tensors only)."""
    dq, dk = _bwd_impl(dq_out, dk_out, cos, sin)
    return _or_empty(dq, cos), _or_empty(dk, cos)


@rotary_bwd.register_fake
def _(dq_out, dk_out, cos, sin):
    return tuple(cos.new_empty(0) if g is None else
                 g.new_empty((g.shape[0], g.shape[2], g.shape[1], g.shape[3]))
                 for g in (dq_out, dk_out))


def _or_empty(t, like):
    return t if t is not None else like.new_empty(0)


def _setup(ctx, inputs, output):
    _q, _k, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    need_q, need_k = ctx.needs_input_grad[:2]
    dq_out = dq_out if need_q else None
    dk_out = dk_out if need_k else None
    if dq_out is None and dk_out is None:
        return None, None, None, None
    dq, dk = torch.ops.custom_kernels.rotary_bwd(dq_out, dk_out, cos, sin)
    return (dq if dq_out is not None else None), (dk if dk_out is not None else None), None, None


torch.library.register_autograd("custom_kernels::rotary_fwd", _backward, setup_context=_setup)
# DTensor inputs (tensor parallelism) run on each rank's shard: custom_kernels.parallel.sharding_rules.
sharding_rules.register("rotary_fwd", "rotary_bwd")


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_out, k_out)``, HF's ``apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2),
    cos, sin)`` as [B, H, S, D] tensors, laid out as [B, S, H, D] eagerly and contiguous under
    torch.compile; see the module docstring. Tensors off a CUDA
    device, and cos / sin that require a gradient, run ``rotary_reference`` (logged once)."""
    _check(q, k, cos, sin)
    if fallback.off_cuda({"q": q, "k": k, "cos": cos, "sin": sin}, "apply_rotary",
                         "rotary_reference"):
        return _torch_rotary(q, k, cos, sin)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        fallback.log_once("apply_rotary uses rotary_reference",
                          "cos or sin requires a gradient (the kernel gives them none)")
        return _torch_rotary(q, k, cos, sin)
    return _rotary(q, k, cos, sin)


def _rotary(q, k, cos, sin):
    """Under torch.compile (and export), the custom op: the graph sees it with its fake impl.
    Eagerly, the same kernel without torch's Python custom-op dispatch (more host
    time a call than the launch): directly when no gradient is needed, else through an
    autograd.Function whose backward launches the backward kernel."""
    if torch.compiler.is_compiling() or not plain_eager(q, k, cos, sin):
        return torch.ops.custom_kernels.rotary_fwd(q, k, cos, sin)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _EagerRotary.apply(q, k, cos, sin)
    return _fwd_impl(q, k, cos, sin)


class _EagerRotary(torch.autograd.Function):
    """Eager autograd, calling the launchers directly."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.set_materialize_grads(False)
        return _fwd_impl(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        dq, dk = _bwd_impl(dq_out if ctx.needs_input_grad[0] else None,
                           dk_out if ctx.needs_input_grad[1] else None, cos, sin)
        return dq, dk, None, None


def _check(q, k, cos, sin) -> None:
    """The input rules, on any device (the device rule comes after them)."""
    tensors = {"q": q, "k": k, "cos": cos, "sin": sin}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise UnsupportedInputError(f"apply_rotary: {name} must be a torch.Tensor, got "
                                        f"{type(t).__name__}")
    if q.dtype not in DTYPE_CODES:
        raise UnsupportedInputError(f"apply_rotary: q must be float32, float16 or bfloat16, "
                                    f"not {q.dtype}")
    for name in ("k", "cos", "sin"):
        if tensors[name].dtype != q.dtype:
            raise UnsupportedInputError(
                f"apply_rotary: {name} is {tensors[name].dtype} but q is {q.dtype}; q, k, cos "
                f"and sin must share one dtype (HF's rotary module returns cos / sin in q's)")
    _check_shapes(q, k, cos, sin)
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise UnsupportedInputError(
                f"apply_rotary: {name} has a non-contiguous last dimension (stride "
                f"{t.stride(-1)}); call .contiguous() first")


def _check_shapes(q, k, cos, sin) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise UnsupportedInputError(
            f"apply_rotary: q and k must be [B, S, H, D] (the views proj(x).view(B, S, -1, D), "
            f"before HF's transpose), got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    batch, seq, _, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq, d):
        raise UnsupportedInputError(
            f"apply_rotary: k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch, "
            f"sequence or head size ([B, S, H, D]; only the head counts may differ)")
    if d % 2:
        raise UnsupportedInputError(f"apply_rotary: the head size D must be even, got {d}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, batch) or tuple(t.shape[1:]) != (seq, d):
            raise UnsupportedInputError(
                f"apply_rotary: {name} has shape {tuple(t.shape)}; expected [B, S, D] or "
                f"[1, S, D] with B={batch}, S={seq}, D={d}")


# ---------------------------------------------------------------------------------------------
# Torch fallback and reference (HF's formula)
# ---------------------------------------------------------------------------------------------

def _torch_rotary(q, k, cos, sin):
    """``apply_rotary`` in torch, for tensors off a CUDA device: the reference, in the kernel's
    layout."""
    return tuple(y.transpose(1, 2).contiguous().transpose(1, 2)
                 for y in rotary_reference(q, k, cos, sin))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half``: ``cat(-x2, x1)`` over the last dimension."""
    x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb`` on ``apply_rotary``'s layouts, in torch with autograd (cos
    and sin included): q / k [B, S, H, D] are transposed to [B, H, S, D] as HF's attention does,
    cos / sin [B or 1, S, D] unsqueezed at dim 1. The outputs keep the strides torch gives
    them (not necessarily contiguous)."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
