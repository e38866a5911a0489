"""Linear layers fused at the GEMM: several projections of one input as one GEMM, and a Linear
whose residual add runs in the GEMM's epilogue.

``merged_linear(x, weights, bias)`` computes ``x @ cat(weights).T (+ bias)`` as one GEMM: the
attention's Q, K and V projections, or the MLP's gate and up projections, read their input once
and launch once instead of three or two times. The weights stay separate Parameters (the model's
``state_dict``, its optimizer and its checkpoints see nothing new); ``pack`` lays them out end to
end in one storage, so that the merged GEMM reads them through a view, without a copy. Weights
that are not packed (a model moved with ``.to()`` after conversion, or FSDP2's gathered weights,
each in its own storage) are never concatenated: each weight's GEMM writes its columns of the
one output in place (cuBLAS takes the output's full width as its leading dimension), and the
input's gradient sums the weights' GEMMs over their column slices of the output's gradient.
The same result with no copy of the weights (a concatenation copied 272 MB of a Llama-3-8B
layer each way). The backward of packed weights is one GEMM for the input's gradient; both
take one GEMM for the merged weight gradient, split into the per-weight gradients.

``linear_residual(x, weight, bias, residual)`` computes ``x @ weight.T + bias + residual``, the
residual added in the GEMM's epilogue (``cutlass_ops.matmul``'s ``residual``; cuBLAS's ``beta = 1``
where torch runs), which saves the separate pass of ``residual + o_proj(x)`` over the output.

Each has the three paths of ``cutlass_ops.ops.linear_fast``: a torch.library custom op with a fake
while torch.compile traces, an autograd.Function eagerly when gradients are needed, a direct call
otherwise. All of them run the GEMMs through the tuned dispatch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from cutlass_ops import gemm_sharding_rules
from cutlass_ops.gemms import dispatch
from custom_kernels.core.eager import PLAIN, fast_autograd

# Starts reducing a gradient in place (an asynchronous all-reduce) and returns what to wait() on:
# merged_linear's backward overlaps it with the weight gradient's GEMM.
GradReduction = Callable[[Tensor], Any]

# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def merged_view(tensors: Sequence[Tensor]) -> Optional[Tensor]:
    """The tensors as one tensor, concatenated along dim 0, without a copy: when they are
    contiguous blocks laid end to end in one storage (what ``pack`` makes). None otherwise."""
    first = tensors[0]
    if len(tensors) == 1:
        return first
    tail = tuple(first.shape[1:])
    offset = first.storage_offset()
    try:
        base = first.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # fake or functional tensors have no storage
        return None
    for t in tensors:
        if (tuple(t.shape[1:]) != tail or t.dtype != first.dtype or not t.is_contiguous()
                or t.storage_offset() != offset or t.untyped_storage().data_ptr() != base):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    strides = first.stride() if first.dim() > 1 else (1,)
    return first.detach().as_strided((rows, *tail), strides, first.storage_offset())


def concatenated(tensors: Sequence[Tensor]) -> Tensor:
    """``torch.cat(tensors)``, as a view when they are packed."""
    view = merged_view(tensors)
    return view if view is not None else torch.cat([t.detach() for t in tensors])


def pack(layers: Sequence[torch.nn.Linear]) -> None:
    """Moves the weights (and the biases, when all have one) of ``layers`` into one storage,
    end to end, in place: each Parameter keeps its identity, shape and values (``.data``
    changes), so optimizers and state_dicts are unaffected. A no-op when already packed."""
    for name in ("weight", "bias"):
        params = [getattr(layer, name) for layer in layers]
        if any(p is None or hasattr(p, "to_local") for p in params) or \
                merged_view(params) is not None:  # (DTensors: their shards are packed already)
            continue
        with torch.no_grad():
            buffer = torch.cat([p.detach() for p in params])
            start = 0
            for p in params:
                p.data = buffer[start:start + p.shape[0]]
                start += p.shape[0]


class MergedView:
    """``merged_view`` of the same tensors, kept between calls while their addresses stay
    (a module holds one per group: finding the view costs tens of microseconds of storage
    queries, a decode step's host budget). The kept view holds its storage, so an address seen
    again is the same storage; tensors moved or replaced have new addresses and are looked at
    afresh."""

    def __init__(self):
        self._key: tuple = ()
        self._view: Optional[Tensor] = None

    def __deepcopy__(self, memo):
        return MergedView()  # a copied module's weights are elsewhere (and deepcopy of the kept
        # view would copy the whole packed storage once more)

    def __call__(self, tensors: Sequence[Tensor]) -> Optional[Tensor]:
        key = tuple((t.data_ptr(), t.shape, t.dtype) for t in tensors)
        if key != self._key:
            self._view, self._key = merged_view(tensors), key
        return self._view


def is_packed(layers: Sequence[torch.nn.Linear]) -> bool:
    return merged_view([layer.weight for layer in layers]) is not None


# ---------------------------------------------------------------------------------------------
# The GEMMs (no autograd): forward and backward of both
# ---------------------------------------------------------------------------------------------

def _rows(t: Tensor) -> Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor],
             residual: Optional[Tensor] = None) -> Tensor:
    rows = _rows(x)
    res = None if residual is None else _rows(residual)
    y = dispatch.matmul(rows, weight.t(), bias=bias, residual=res)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


def linear_grads(grad: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_w: bool,
                 grad_x_reduction: Optional[GradReduction] = None):
    """(dX = dY W, dW = dY^T X) of ``y = x W^T``, either None when not needed.
    ``grad_x_reduction``: started on dX before dW's GEMM and waited for after it (see
    ``merged_linear``)."""
    rows = _rows(grad)
    grad_x = dispatch.matmul(rows, weight).view(x.shape) if need_x else None
    pending = _start(grad_x_reduction, grad_x)
    grad_w = dispatch.matmul(rows.t(), _rows(x)) if need_w else None
    if pending is not None:
        pending.wait()
    return grad_x, grad_w


def _start(reduction: Optional[GradReduction], grad_x: Optional[Tensor]):
    return None if reduction is None or grad_x is None else reduction(grad_x)


def _forward_unpacked(x: Tensor, weights: Sequence[Tensor], bias: Optional[Tensor]) -> Tensor:
    """``x @ cat(weights).T + bias`` without the concatenated copy: each weight's GEMM writes
    its columns of the output in place (a column slice has unit column stride and the full
    width as row stride, which cuBLAS takes as its leading dimension: no temporary)."""
    rows = _rows(x)
    out = rows.new_empty((rows.shape[0], sum(w.shape[0] for w in weights)))
    start = 0
    for w in weights:
        cols = out[:, start:start + w.shape[0]]
        if bias is None:
            torch.mm(rows, w.t(), out=cols)
        else:
            torch.addmm(bias[start:start + w.shape[0]], rows, w.t(), out=cols)
        start += w.shape[0]
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[1])


def _grad_x_unpacked(grad: Tensor, x: Tensor, weights: Sequence[Tensor]) -> Tensor:
    """``dY @ cat(weights)``, summed over the weights' column slices of ``dY`` (the first GEMM
    writes, the others add in place: cuBLAS's beta = 1), so the weights are never copied."""
    rows = _rows(grad)
    grad_x, start = None, 0
    for w in weights:
        part = rows[:, start:start + w.shape[0]]
        grad_x = torch.mm(part, w) if grad_x is None else grad_x.addmm_(part, w)
        start += w.shape[0]
    return grad_x.view(x.shape)


def _split(grad_w: Optional[Tensor], weights: Sequence[Tensor]):
    if grad_w is None:
        return [None] * len(weights)
    return list(grad_w.split([w.shape[0] for w in weights]))


# ---------------------------------------------------------------------------------------------
# Custom ops (torch.compile)
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("cutlass_ops::merged_linear", mutates_args=())
def merged_linear_op(x: Tensor, weights: list[Tensor], bias: Optional[Tensor]) -> Tensor:
    """x @ cat(weights).T + bias, one GEMM."""
    with torch.no_grad():
        return _forward(x, concatenated(weights), bias)


@merged_linear_op.register_fake
def _(x, weights, bias):
    rows = sum(w.shape[0] for w in weights)
    return x.new_empty((*x.shape[:-1], rows))


@torch.library.custom_op("cutlass_ops::merged_linear_backward", mutates_args=())
def merged_linear_backward_op(grad: Tensor, x: Tensor, weights: list[Tensor], need_x: bool,
                              need_w: bool) -> tuple[Tensor, Tensor]:
    """(dX, dW of the merged weight); an empty tensor for the one not needed."""
    with torch.no_grad():
        grad_x, grad_w = linear_grads(grad, x, concatenated(weights), need_x, need_w)
    return (grad_x if grad_x is not None else grad.new_empty(0),
            grad_w if grad_w is not None else grad.new_empty(0))


@merged_linear_backward_op.register_fake
def _(grad, x, weights, need_x, need_w):
    rows = sum(w.shape[0] for w in weights)
    return (x.new_empty(x.shape) if need_x else grad.new_empty(0),
            weights[0].new_empty((rows, x.shape[-1])) if need_w else grad.new_empty(0))


def _merged_setup(ctx, inputs, output) -> None:
    x, weights, bias = inputs
    ctx.save_for_backward(x, *weights)
    ctx.has_bias = bias is not None


def _merged_backward(ctx, grad):
    x, *weights = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[1])
    grad_x, grad_w = merged_linear_backward_op(grad, x, weights, need_x, need_w)
    grad_b = _rows(grad).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return (grad_x if need_x else None, _split(grad_w if need_w else None, weights), grad_b)


@torch.library.custom_op("cutlass_ops::linear_residual", mutates_args=())
def linear_residual_op(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                       residual: Tensor) -> Tensor:
    """x @ weight.T + bias + residual, the residual added in the GEMM's epilogue."""
    with torch.no_grad():
        return _forward(x, weight, bias, residual)


@linear_residual_op.register_fake
def _(x, weight, bias, residual):
    torch._check(tuple(residual.shape) == (*x.shape[:-1], weight.shape[0]),
                 lambda: "cutlass_ops::linear_residual: residual must have the output's shape")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _residual_setup(ctx, inputs, output) -> None:
    x, weight, bias, residual = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _residual_backward(ctx, grad):
    # merged_linear_backward of the one weight: the same two GEMMs on the unflattened tensors,
    # so that a DTensor sharded on the sequence stays local (its rule gives dW Partial), where
    # flattening [B, S] rows would gather a sequence shard first.
    x, weight = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x, grad_w = merged_linear_backward_op(grad, x, [weight], need_x, need_w)
    grad_b = _rows(grad).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return (grad_x if need_x else None, grad_w if need_w else None, grad_b,
            grad if ctx.needs_input_grad[3] else None)


# ---------------------------------------------------------------------------------------------
# Eager autograd (a few microseconds a call where the custom ops' Python dispatch costs ~17)
# ---------------------------------------------------------------------------------------------

class _EagerMerged(torch.autograd.Function):
    """``merged``: the packed weights' view (detached, no gradient), or None when they are not
    packed (FSDP2's gathered weights: separate tensors, which FSDP2 frees after each layer's
    forward and gathers again for its backward). Unpacked weights are kept as ``nn.Linear``
    keeps its own and run through ``_forward_unpacked`` / ``_grad_x_unpacked``: no
    concatenated copy is made in either pass, nor held from the forward to the backward."""

    @staticmethod
    def forward(ctx, x, bias, merged, packed, grad_x_reduction, *weights):
        ctx.packed, ctx.grad_x_reduction = packed, grad_x_reduction
        ctx.save_for_backward(x, merged) if packed else ctx.save_for_backward(x, *weights)
        ctx.rows = [w.shape[0] for w in weights]
        ctx.has_bias = bias is not None
        if not packed:
            return _forward_unpacked(x, [w.detach() for w in weights], bias)
        return _forward(x, merged, bias)

    @staticmethod
    def backward(ctx, grad):
        x, *kept = ctx.saved_tensors
        need_x, need_b, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1], \
            any(ctx.needs_input_grad[5:])
        with torch.no_grad():
            if ctx.packed:
                grad_x, grad_w = linear_grads(grad, x, kept[0], need_x, need_w,
                                              ctx.grad_x_reduction)
            else:
                grad_x = _grad_x_unpacked(grad, x, [w.detach() for w in kept]) \
                    if need_x else None
                pending = _start(ctx.grad_x_reduction, grad_x)
                grad_w = linear_grads(grad, x, None, False, need_w)[1]
                if pending is not None:
                    pending.wait()
            grad_b = _rows(grad).sum(0) if ctx.has_bias and need_b else None
        grads = list(grad_w.split(ctx.rows)) if grad_w is not None else [None] * len(ctx.rows)
        return (grad_x, grad_b, None, None, None, *grads)


class _EagerResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _forward(x, weight, bias, residual)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.no_grad():
            grad_x, grad_w = linear_grads(grad, x, weight, ctx.needs_input_grad[0],
                                       ctx.needs_input_grad[1])
            grad_b = _rows(grad).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, grad if ctx.needs_input_grad[3] else None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------

def _subclass(*tensors) -> bool:
    """A tensor subclass (DTensor: tensor parallelism) among them: the custom op, whose
    sharding rules (cutlass_ops.gemm_sharding_rules) keep it on each rank's shard."""
    return any(t is not None and type(t) not in PLAIN for t in tensors)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def merged_bias(layers: Sequence[torch.nn.Linear]) -> Optional[Tensor]:
    """The layers' biases concatenated (a view when packed), None when none has one; a layer
    without a bias among ones with a bias contributes zeros."""
    biases = [layer.bias for layer in layers]
    if all(b is None for b in biases):
        return None
    if all(b is not None for b in biases):
        view = merged_view(biases) if not _needs_grad(*biases) else None
        return view if view is not None else torch.cat(biases)
    return torch.cat([b if b is not None else layer.weight.new_zeros(layer.out_features)
                      for b, layer in zip(biases, layers)])


def merged_linear(x: Tensor, weights: Sequence[Tensor], bias: Optional[Tensor] = None,
                  view: Optional[MergedView] = None,
                  grad_x_reduction: Optional[GradReduction] = None) -> Tensor:
    """``x @ cat(weights).T + bias`` as one GEMM, with autograd to ``x``, each weight and the
    bias (of the merged width). Split the result with ``.split([w.shape[0] for w in weights],
    -1)``. ``view``: the caller's ``MergedView`` of these weights (eager calls reuse it).
    ``grad_x_reduction``: the backward starts it on dX (in place) right after dX's GEMM and
    waits for what it returns after dW's, so that a reduction running beside the GEMMs (an
    asynchronous all-reduce: tensor parallelism) overlaps dW's GEMM; eager calls of plain
    tensors only (``uses_eager_autograd``), a ValueError otherwise."""
    weights = list(weights)
    if not uses_eager_autograd(x, bias, *weights):
        if grad_x_reduction is not None:
            raise ValueError("merged_linear: grad_x_reduction needs an eager call of plain "
                             "tensors (not torch.compile, not a tensor subclass)")
        return merged_linear_op(x, weights, bias)
    merged = view(weights) if view is not None else merged_view(weights)
    packed = merged is not None
    if _needs_grad(x, bias, *weights):
        return _EagerMerged.apply(x, bias, merged, packed, grad_x_reduction, *weights)
    if not packed:
        return _forward_unpacked(x, weights, bias)
    return _forward(x, merged, bias)


def uses_eager_autograd(*tensors: Optional[Tensor]) -> bool:
    """Whether calls on these tensors take this module's eager autograd (not the registered op,
    which torch.compile and tensor subclasses need)."""
    return not torch.compiler.is_compiling() and not _subclass(*tensors)


def linear_residual(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Tensor
                    ) -> Tensor:
    """``x @ weight.T + bias + residual`` with the add in the GEMM's epilogue, with autograd."""
    if torch.compiler.is_compiling() or _subclass(x, weight, bias, residual):
        return linear_residual_op(x, weight, bias, residual)
    if _needs_grad(x, weight, bias, residual):
        return _EagerResidual.apply(x, weight, bias, residual)
    return _forward(x, weight, bias, residual)


# The ops' autograd, with a direct path for plain tensors (custom_kernels.core.eager): the
# registered formulas serve tracing, the public functions every other call.
fast_autograd("cutlass_ops::merged_linear", eager=merged_linear, backward=_merged_backward,
              setup_context=_merged_setup)
fast_autograd("cutlass_ops::linear_residual", eager=linear_residual,
              backward=_residual_backward, setup_context=_residual_setup)

# DTensor inputs (tensor parallelism) run on each rank's shard: cutlass_ops.gemm_sharding_rules.
gemm_sharding_rules.register("merged_linear", "merged_linear_backward", "linear_residual")

__all__ = ["merged_linear", "linear_residual", "linear_grads", "uses_eager_autograd", "pack",
           "is_packed", "merged_view", "merged_bias", "MergedView", "GradReduction"]
