"""torch.library custom ops for the GEMM family: ``cutlass_ops::mm``, ``::bmm``, ``::linear``.

Each op runs on the tuned kernel that ``cutlass_ops.matmul``'s dispatch picks (or torch, where
dispatch falls back), has a fake implementation so that ``torch.compile(fullgraph=True)`` traces
it without a graph break, and an autograd formula whose backward GEMMs go through the same ops,
hence the same dispatch and tuning cache:
    y = x W^T + b:  dX = dY W,  dW = dY^T X,  db = sum of dY over rows.
``linear`` takes an ``activation`` fused into the GEMM's epilogue with the bias (a CUTLASS
epilogue visitor tree: one kernel writes act(x W^T + b)). Its backward needs the
pre-activation z = x W^T + b: the eager autograd path computes z with the bias fused, keeps it,
and applies the activation in torch; the custom op's own formula recomputes z. Without gradients
the whole epilogue is fused.
Inside an op, autograd is off (the formulas here handle it), so dispatch never refuses an input
for requiring grad. Launches use torch's current stream and torch's allocator only, so the ops
can be captured in CUDA graphs once their first call has resolved the kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from cutlass_ops import gemm_sharding_rules
from cutlass_ops.gemms import epilogues
from cutlass_ops.gemms import dispatch
from custom_kernels import host_ops
from custom_kernels.core.eager import PLAIN, fast_autograd, plain_eager


def _matmul(a: Tensor, b: Tensor, dims: int, op: str) -> Tensor:
    if a.dim() != dims or b.dim() != dims:
        raise ValueError(f"cutlass_ops::{op} takes {dims}-D tensors, got {a.dim()}-D and "
                         f"{b.dim()}-D")
    with torch.no_grad():
        return dispatch.matmul(a, b)


# ---- mm -----------------------------------------------------------------------------------

@torch.library.custom_op("cutlass_ops::mm", mutates_args=())
def mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for 2-D a (M x K) and b (K x N)."""
    return _matmul(a, b, 2, "mm")


@mm.register_fake
def _mm_fake(a: Tensor, b: Tensor) -> Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "cutlass_ops::mm takes 2-D tensors")
    torch._check(a.shape[1] == b.shape[0], lambda: "cutlass_ops::mm: shapes do not multiply")
    return a.new_empty((a.shape[0], b.shape[1]))


def _mm_setup(ctx, inputs, output) -> None:
    a, b = inputs
    ctx.save_for_backward(a, b)


def _mm_backward(ctx, grad: Tensor):
    a, b = ctx.saved_tensors
    grad_a = mm(grad, b.t()) if ctx.needs_input_grad[0] else None  # dA = dY B^T
    grad_b = mm(a.t(), grad) if ctx.needs_input_grad[1] else None  # dB = A^T dY
    return grad_a, grad_b


# ---- bmm ----------------------------------------------------------------------------------

@torch.library.custom_op("cutlass_ops::bmm", mutates_args=())
def bmm(a: Tensor, b: Tensor) -> Tensor:
    """Batched a @ b: a (L x M x K), b (L x K x N)."""
    return _matmul(a, b, 3, "bmm")


@bmm.register_fake
def _bmm_fake(a: Tensor, b: Tensor) -> Tensor:
    torch._check(a.dim() == 3 and b.dim() == 3, lambda: "cutlass_ops::bmm takes 3-D tensors")
    torch._check(a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1],
                 lambda: "cutlass_ops::bmm: shapes do not multiply")
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


def _bmm_backward(ctx, grad: Tensor):
    a, b = ctx.saved_tensors
    grad_a = bmm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
    grad_b = bmm(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


# ---- linear -------------------------------------------------------------------------------

@torch.library.custom_op("cutlass_ops::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
           activation: str = "identity") -> Tensor:
    """activation(x @ weight^T + bias) for x (..., in_features), weight (out_features,
    in_features): torch.nn.functional.linear, then the activation (identity, relu, gelu,
    gelu_tanh or silu), fused into one kernel where one is tuned or built."""
    with torch.no_grad():
        return _linear_forward(x, weight, bias, activation)


@linear.register_fake
def _linear_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                 activation: str = "identity") -> Tensor:
    torch._check(weight.dim() == 2 and x.shape[-1] == weight.shape[1],
                 lambda: "cutlass_ops::linear: x does not match weight")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output) -> None:
    x, weight, bias, activation = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.has_bias = bias is not None
    ctx.activation = activation


def _activation_grad(z: Tensor, grad: Tensor, activation: str) -> Tensor:
    """d activation(z) / dz times grad, through torch's own derivative of the activation."""
    if activation == "identity":
        return grad
    with torch.enable_grad():
        z = z.detach().requires_grad_()
        (grad_z,) = torch.autograd.grad(epilogues.activate(z, activation), z, grad)
    return grad_z


def _linear_grads(ctx, grad: Tensor, x: Tensor, weight: Tensor, matmul):
    rows = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = matmul(rows, weight).reshape(x.shape)  # dX = dY W
    if ctx.needs_input_grad[1]:
        grad_w = matmul(rows.t(), x.reshape(-1, x.shape[-1]))  # dW = dY^T X
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = rows.sum(0)
    return grad_x, grad_w, grad_b


def _linear_backward(ctx, grad: Tensor):
    x, weight, bias = ctx.saved_tensors
    if ctx.activation != "identity":  # the op kept only its output: recompute z
        z = linear(x, weight, bias)
        grad = _activation_grad(z, grad, ctx.activation)
    return (*_linear_grads(ctx, grad, x, weight, mm), None)


# ---- eager fast path ------------------------------------------------------------------------

def _linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                    activation: str = "identity") -> Tensor:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"cutlass_ops::linear: x {tuple(x.shape)} does not match weight "
                         f"{tuple(weight.shape)}")
    flat = x.dim() == 2  # the common case in a host-bound loop: no reshapes
    y = dispatch.matmul(x if flat else x.reshape(-1, x.shape[-1]), weight.t(), bias=bias,
                        activation=activation)
    return y if flat else y.reshape(*x.shape[:-1], weight.shape[0])


class _EagerLinear(torch.autograd.Function):
    """The linear op's formulas as an autograd.Function: in eager mode it costs a few
    microseconds per call where the custom op's Python dispatch costs about 17
    (docs/measurements.md, "Host cost of a call"). With an activation it
    keeps z = x W^T + b (bias fused) for the backward and applies the activation in torch."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        ctx.has_bias = bias is not None
        ctx.activation = activation
        if activation == "identity":
            ctx.save_for_backward(x, weight, None)
            return _linear_forward(x, weight, bias)
        z = _linear_forward(x, weight, bias)
        ctx.save_for_backward(x, weight, z)
        return epilogues.activate(z, activation)

    @staticmethod
    def backward(ctx, grad):
        x, weight, z = ctx.saved_tensors
        with torch.no_grad():
            if ctx.activation != "identity":
                grad = _activation_grad(z, grad, ctx.activation)
            grads = _linear_grads(ctx, grad, x, weight, dispatch.matmul)
        return (*grads, None)


def host_linear(x: Tensor, weight: Tensor) -> Optional[Tensor]:
    """``x W^T`` through the compiled host path (``custom_kernels.host_ops``: a C++ op, its own
    autograd node, the backward products through ``cutlass_ops::mm``), or None when it does not
    take the call: not loaded (yet), traced or non-plain tensors, rows that are not contiguous, a
    product dispatch has not recorded (its first call records it)."""
    if (HOST_LINEAR.off or torch.compiler.is_compiling() or not plain_eager(x, weight)
            or not x.is_cuda):
        return None  # (off CUDA: nothing to launch, and no reason to build the library)
    if not HOST_LINEAR_WITH_GRAD and torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad):
        return None
    op = HOST_LINEAR.op or HOST_LINEAR.load()
    return None if op is None else op(x, weight)


# The backward's products go through cutlass_ops::mm: named once the library is loaded.
HOST_LINEAR = host_ops.LazyOp("linear", on_load=lambda host: host.set_product_op("cutlass_ops::mm"))
# Calls wanting gradients take the C++ Linear's autograd node too (its backward products through
# cutlass_ops::mm; tests/gpu/test_host_ops_gpu.py checks it against _EagerLinear bit for bit);
# False sends them to _EagerLinear, the Python path.
HOST_LINEAR_WITH_GRAD = True


def linear_fast(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                activation: str = "identity") -> Tensor:
    """``linear`` with the least host work: the compiled host path where it takes the call (no
    bias, no activation), the custom op while torch.compile traces (it needs the op and its
    fake), an autograd.Function when gradients are needed, a direct call when not. Same kernels
    and formulas in all of them."""
    if bias is None and activation == "identity":
        out = host_linear(x, weight)
        if out is not None:
            return out
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (
        bias is not None and bias.requires_grad))
    # A subclass (DTensor: tensor parallelism) takes the op too: its rules, not the launchers.
    if torch.compiler.is_compiling() or type(x) not in PLAIN or type(weight) not in PLAIN:
        if needs_grad and activation != "identity":
            # Keep z for the backward instead of recomputing it: Inductor fuses the activation.
            return epilogues.activate(linear(x, weight, bias), activation)
        return linear(x, weight, bias, activation)
    if needs_grad:
        return _EagerLinear.apply(x, weight, bias, activation)
    return _linear_forward(x, weight, bias, activation)


# The ops' autograd, with a direct path for plain tensors (custom_kernels.core.eager): the
# registered formulas serve tracing, the eager functions every other call.
# mm and bmm have no eager autograd of their own: with gradients, their registered formulas.
fast_autograd("cutlass_ops::mm", eager=lambda a, b: _matmul(a, b, 2, "mm"),
              backward=_mm_backward, setup_context=_mm_setup, eager_grads=False)
fast_autograd("cutlass_ops::bmm", eager=lambda a, b: _matmul(a, b, 3, "bmm"),
              backward=_bmm_backward, setup_context=_mm_setup, eager_grads=False)
fast_autograd("cutlass_ops::linear", eager=linear_fast, backward=_linear_backward,
              setup_context=_linear_setup)

# DTensor inputs (tensor parallelism) run on each rank's shard: cutlass_ops.gemm_sharding_rules.
gemm_sharding_rules.register("mm", "linear")

__all__ = ["mm", "bmm", "linear", "linear_fast"]
