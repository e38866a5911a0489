"""FP8 Linear layers: ``fp8_linear(x, weights, bias, recipe)`` computes ``x @ cat(weights)^T +
bias`` (one GEMM for several weights, as ``cutlass_ops.fused_linear.merged_linear``) with its
forward and both backward GEMMs through ``cutlass_ops.scaled_mm``, each operand quantized as the
recipe says (``cutlass_ops.fp8.recipes``; quantization by ``custom_kernels.fp8.fp8_quant``):

    forward  y  = x W^T    a = x quantized along K,         b = W (N, K) along K
    dgrad    dx = dy W     a = dy along N,                  b = W^T (K, N), quantized from W
    wgrad    dW = dy^T x   a = dy^T (N, M) along tokens,    b = x^T (K, M), quantized from x

The forward quantizes x^T beside x (one pass where the recipe uses one granularity for both:
``quantize_pair``) and keeps it for the wgrad instead of x (one byte an element for two); token
counts the wgrad cannot reduce over (a multiple of 16, of 128 for blockwise) are padded with zero
rows there. The weight is read as the Parameter it is, on every call: bf16 master weights,
nothing else in the state_dict, and FSDP2's gathered weight is what the forward reads.

**Weights' FP8 copies.** A call that trains the weights quantizes them afresh (forward: W;
backward: W^T). A call that does not (gradients off, or frozen weights) takes them from the
layer's ``WeightCache``, made on first use and refreshed when a weight changes, which it knows
by ``cutlass_ops.fp8.weight_versions`` (data pointer, version counter, optimizer steps taken).
Writes through ``.data`` escape it: call ``cache.clear()``. Inference tensors have no version
counter: their FP8 copies are made at every call. A refresh writes into the copies' own memory, so a CUDA
graph that read them stays valid.
Under torch.compile the weights are quantized inside the compiled graph at every call: a
compiled graph checks its guards (the parameters' identity, shapes, dtypes, strides), never a
weight's values or version, so it could not tell when a kept copy went stale. In a CUDA graph
captured eagerly, a fresh copy is read by address (and the cache then never frees it), a stale
or missing one is quantized inside the graph: our decode-step graphs (``cutlass_ops.step_graphs``)
key their graphs on the weights' versions and capture again after a change; a graph of your own
replays the copies it was captured with until an eager call refreshes them.

**An FP8 input given** (``x_fp8=(q, scale)``): a kernel that wrote ``x`` also wrote its forward
operand (``custom_kernels.norms.rms_norm_fp8``, ``custom_kernels.swiglu.swiglu_fp8``: row and
block_1x128 granularity, equal to ``quantize(x)`` bit for bit); the forward reads it instead of
quantizing ``x`` again, and a training call still quantizes x^T for the wgrad.
**Amaxes given** (tensorwise, whose one scale needs the whole tensor's amax before any value):
``x_amax``, x's amax reduced by the kernel that wrote x, and ``grad_amax``, a
``custom_kernels.fp8.grad_amax.GradAmax`` where the kernel that writes the output gradient records
its amax (``custom_kernels.swiglu.swiglu_with_amax`` does both for down_proj and gate+up): x and
dy are then read once by their quantization (q and q^T from one pass) instead of twice.

Three paths as ``cutlass_ops.ops.linear_fast``: custom ops with fakes while torch.compile traces
(``cutlass_ops::fp8_linear`` and its backward, ``register_autograd``), an autograd.Function
eagerly when gradients are needed, a direct call otherwise. ``Fp8Linear`` is the module,
``FusedGemms`` the merged and residual GEMMs of a fused decoder block.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from cutlass_ops import fused_linear
from cutlass_ops.fp8 import recipes
from cutlass_ops.fp8.gemm_steps import (backward_gemms, forward_gemm, nothing_kept,
                                        quantize_operand, rows_of, training_weight_operand)
from cutlass_ops.fp8.loss_head import Fp8HeadProducts
from cutlass_ops.fp8.recipes import Operand, Recipe
from cutlass_ops.fp8.weight_versions import optimizer_steps, weights_key
from cutlass_ops.gemms import epilogues
from cutlass_ops.gemms.config import Activation
from custom_kernels.core.eager import fast_autograd
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.fp8.fp8_quant import Granularity, empty_scale, scale_shape
from custom_kernels.fp8.grad_amax import GradAmax

# ---------------------------------------------------------------------------------------------
# The rules of a call
# ---------------------------------------------------------------------------------------------


def _check_call(x: Tensor, weights: Sequence[Tensor], bias: Optional[Tensor],
                recipe: Recipe, x_fp8=None, x_amax=None) -> None:
    """The rules of a call (shapes, dtypes), with the recipe's layer rules on the merged
    weight; UnsupportedInputError naming the one broken."""
    k = weights[0].shape[1] if weights[0].dim() == 2 else -1
    if any(w.dim() != 2 or w.shape[1] != k for w in weights) or x.shape[-1] != k:
        raise UnsupportedInputError(
            f"fp8_linear: x {tuple(x.shape)} does not match the weights "
            f"{[tuple(w.shape) for w in weights]} (each (out_features, in_features))")
    dtype = weights[0].dtype
    recipe.check(k, sum(w.shape[0] for w in weights), dtype)
    if x.dtype != dtype or any(w.dtype != dtype for w in weights):
        raise UnsupportedInputError(f"fp8_linear: x is {x.dtype} and the weights "
                                    f"{sorted({str(w.dtype) for w in weights})}: an FP8 linear "
                                    "takes x in its weights' dtype")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != sum(w.shape[0] for w in weights)):
        raise UnsupportedInputError(f"fp8_linear: bias {tuple(bias.shape)} is not one value per "
                                    "output feature")
    if x_fp8 is not None:
        _check_x_fp8(x, x_fp8, recipe.forward.a)
    if x_amax is not None and (
            recipe.forward.a.granularity is not Granularity.TENSOR or
            not isinstance(x_amax, Tensor) or x_amax.dtype != torch.float32 or
            x_amax.numel() != 1 or x_amax.device != x.device):
        raise UnsupportedInputError(
            f"fp8_linear: x_amax is x's amax as a float32 scalar tensor on x's device, for a "
            f"recipe that scales x by the tensor (tensorwise); got "
            f"{getattr(x_amax, 'dtype', type(x_amax).__name__)} "
            f"{tuple(getattr(x_amax, 'shape', ()))} with recipe {recipe.name}")


def _check_x_fp8(x: Tensor, x_fp8, a: Operand) -> None:
    """``x_fp8`` must be x's forward operand as the recipe quantizes it: q of x's shape and
    the recipe's FP8 type, the scales of its granularity."""
    q, scale = x_fp8
    k = x.shape[-1]
    want = scale_shape(a.granularity, x.numel() // k if k else 0, k)
    if q.shape != x.shape or q.dtype != a.dtype or scale.dtype != torch.float32 or \
            tuple(scale.shape) != want:
        raise UnsupportedInputError(
            f"fp8_linear: x_fp8 is q {tuple(q.shape)} {q.dtype} with scales "
            f"{tuple(scale.shape)} {scale.dtype}; this recipe's forward reads x "
            f"{tuple(x.shape)} as {a.dtype} with float32 {a.granularity.value} scales "
            f"{want}")


# ---------------------------------------------------------------------------------------------
# The weights' FP8 copies for calls that do not train them
# ---------------------------------------------------------------------------------------------

def _key(weights: Sequence[Tensor], recipe: Recipe):
    """What the copies of ``weights`` depend on (``weight_versions.weights_key``)."""
    return weights_key(weights, recipe.name)


class WeightCache:
    """The FP8 copies of one weight, or of one merged GEMM's weights: the forward operand (W)
    and, when a call needs the input's gradient, the dgrad operand (W^T). See the module
    docstring for when they are refreshed."""

    def __init__(self):
        self._key = None
        self._copies: dict[str, tuple] = {}
        self._fresh: set = set()
        self.captured = False  # read by a CUDA graph: never freed, refreshed in place only

    def __deepcopy__(self, memo):
        return WeightCache()  # a copied module makes its own

    def __reduce__(self):
        return WeightCache, ()

    def get(self, which: str, weights: Sequence[Tensor], merged: Tensor, recipe: Recipe):
        """(q, scale) of ``merged`` (the weights as one) for ``which``: "forward" (W) or
        "dgrad" (W^T)."""
        key = _key(weights, recipe)
        capturing = merged.is_cuda and torch.cuda.is_current_stream_capturing()
        if key is not None and key == self._key and which in self._fresh:
            self.captured = self.captured or capturing
            return self._copies[which]
        operand = recipe.forward.b if which == "forward" else recipe.dgrad.b
        fresh = quantize_operand(merged, operand, transpose=which == "dgrad")
        if key is None or capturing:  # not keepable, or memory of the graph's own pool
            return fresh
        if key != self._key:
            self._key, self._fresh = key, set()
        old = self._copies.get(which)
        if old is not None and all(o.shape == f.shape and o.dtype == f.dtype and
                                   o.device == f.device for o, f in zip(old, fresh)):
            for o, f in zip(old, fresh):
                o.copy_(f)
            fresh = old
        self._copies[which] = fresh
        self._fresh.add(which)
        return fresh

    def clear(self) -> None:
        """Frees the copies (a training call does: it quantizes afresh), unless a CUDA graph
        read them."""
        if not self.captured and self._copies:
            self._copies.clear()
            self._fresh = set()
            self._key = None


# ---------------------------------------------------------------------------------------------
# Custom ops (torch.compile): forward, backward, their fakes and the autograd formula
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("cutlass_ops::fp8_linear", mutates_args=())
def fp8_linear_op(x: Tensor, weights: list[Tensor], bias: Optional[Tensor], recipe: str,
                  keep: bool, x_q: Optional[Tensor] = None,
                  x_s: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(x @ cat(weights).T + bias, x^T's FP8 operand and scales for the wgrad (empty unless
    ``keep``)), the weights quantized in the call; ``x_q`` and ``x_s``: x's forward operand
    when a kernel wrote it (both or neither)."""
    return _op_forward(x, weights, bias, recipe, keep, x_q, x_s)


def _given(x_q, x_s):
    if (x_q is None) != (x_s is None):
        raise UnsupportedInputError("fp8_linear: x_q and x_s come together (x's FP8 operand "
                                    "and its scales) or not at all")
    return (x_q, x_s) if x_q is not None else None


def _op_forward(x, weights, bias, recipe, keep, x_q=None, x_s=None):
    found = recipes.get(recipe)
    x_fp8 = _given(x_q, x_s)
    _check_call(x, weights, bias, found, x_fp8)
    with torch.no_grad():
        return forward_gemm(x, fused_linear.concatenated(weights), bias, found, keep, x_fp8=x_fp8)


@fp8_linear_op.register_fake
def _(x, weights, bias, recipe, keep, x_q=None, x_s=None):
    found = recipes.get(recipe)
    _check_call(x, weights, bias, found, _given(x_q, x_s))
    k, n = weights[0].shape[1], sum(w.shape[0] for w in weights)
    y = x.new_empty((*x.shape[:-1], n))
    if not keep:
        return (y, *nothing_kept(x))
    tokens = x.numel() // k
    tokens = tokens + (-tokens % found.token_multiple)
    b = found.wgrad.b
    return (y, x.new_empty((k, tokens), dtype=b.dtype),
            empty_scale(b.granularity, k, tokens, x.device))


@torch.library.custom_op("cutlass_ops::fp8_linear_backward", mutates_args=())
def fp8_linear_backward_op(grad: Tensor, xt_q: Tensor, xt_s: Tensor, weights: list[Tensor],
                           recipe: str, need_x: bool, need_w: bool) -> tuple[Tensor, Tensor]:
    """(dx, dW of the merged weight); an empty tensor for the one not needed."""
    found = recipes.get(recipe)
    with torch.no_grad():
        grad_x, grad_w = backward_gemms(
            grad, (xt_q, xt_s), found, need_x, need_w, weights[0].dtype,
            lambda: quantize_operand(fused_linear.concatenated(weights), found.dgrad.b, True))
    return (grad_x if grad_x is not None else grad.new_empty(0),
            grad_w if grad_w is not None else grad.new_empty(0))


@fp8_linear_backward_op.register_fake
def _(grad, xt_q, xt_s, weights, recipe, need_x, need_w):
    k, n = weights[0].shape[1], sum(w.shape[0] for w in weights)
    return (grad.new_empty((*grad.shape[:-1], k)) if need_x else grad.new_empty(0),
            weights[0].new_empty((n, k)) if need_w else grad.new_empty(0))


def _op_setup(ctx, inputs, output) -> None:
    x, weights, bias, recipe, keep = inputs[:5]
    _, xt_q, xt_s = output
    ctx.save_for_backward(xt_q, xt_s, *weights)
    ctx.mark_non_differentiable(xt_q, xt_s)
    ctx.recipe, ctx.has_bias = recipe, bias is not None


def _split(grad_w: Optional[Tensor], weights: Sequence[Tensor]) -> list:
    if grad_w is None:
        return [None] * len(weights)
    return list(grad_w.split([w.shape[0] for w in weights]))


def _op_backward(ctx, grad, *_):
    xt_q, xt_s, *weights = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[1])
    grad_x, grad_w = fp8_linear_backward_op(grad, xt_q, xt_s, weights, ctx.recipe, need_x,
                                            need_w)
    grad_b = rows_of(grad).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return (grad_x if need_x else None, _split(grad_w if need_w else None, weights), grad_b,
            None, None, None, None)


# ---------------------------------------------------------------------------------------------
# Eager autograd
# ---------------------------------------------------------------------------------------------

class _EagerFp8Linear(torch.autograd.Function):
    """``merged``: the weights as one (a view when packed; detached). The weights are kept for
    the dgrad (as nn.Linear keeps its own; under FSDP2 the gathered ones), x^T's FP8 operand for
    the wgrad. ``x_fp8``: x's forward operand (q, scale) when a kernel wrote it, or None."""

    @staticmethod
    def forward(ctx, x, bias, recipe, cache, x_fp8, amaxes, merged, *weights):
        need_w = any(ctx.needs_input_grad[7:])
        amax = None  # W's, for W^T in the backward (tensorwise)
        if need_w:
            fp8, amax = training_weight_operand(merged, recipe)
        else:
            fp8 = cache.get("forward", weights, merged, recipe) if cache is not None else None
        x_amax, ctx.grad_amax = amaxes
        y, xt_q, xt_s = forward_gemm(x, merged, bias, recipe, need_w, fp8, x_fp8, x_amax)
        ctx.save_for_backward(xt_q, xt_s, *weights)
        ctx.recipe, ctx.cache, ctx.has_bias = recipe, cache, bias is not None
        ctx.weight_amax = amax
        return y

    @staticmethod
    def backward(ctx, grad):
        xt_q, xt_s, *weights = ctx.saved_tensors
        need_x, need_b, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1], \
            any(ctx.needs_input_grad[7:])
        recipe, cache = ctx.recipe, ctx.cache

        def weight_t():
            merged = fused_linear.concatenated(weights)
            if cache is not None and not need_w:
                return cache.get("dgrad", weights, merged, recipe)
            return quantize_operand(merged, recipe.dgrad.b, True, amax=ctx.weight_amax)

        dy_amax = ctx.grad_amax.amax_of(grad) if ctx.grad_amax is not None else None
        with torch.no_grad():
            grad_x, grad_w = backward_gemms(grad, (xt_q, xt_s), recipe, need_x, need_w,
                                            weights[0].dtype, weight_t, dy_amax)
            grad_b = rows_of(grad).sum(0) if ctx.has_bias and need_b else None
        return (grad_x, grad_b, None, None, None, None, None, *_split(grad_w, weights))


# ---------------------------------------------------------------------------------------------
# Public functions and modules
# ---------------------------------------------------------------------------------------------

def fp8_linear(x: Tensor, weights: Sequence[Tensor], bias: Optional[Tensor] = None,
               recipe: Recipe | str = "rowwise", *, cache: Optional[WeightCache] = None,
               view: Optional[fused_linear.MergedView] = None, x_fp8=None,
               x_amax: Optional[Tensor] = None, grad_amax: Optional[GradAmax] = None) -> Tensor:
    """``x @ cat(weights).T + bias`` through FP8 GEMMs per ``recipe`` (forward and backward;
    several weights as one GEMM), with autograd to ``x``, each weight and the bias. ``cache``:
    the weights' FP8 copies for calls that do not train them (module docstring); ``view``: the
    caller's ``fused_linear.MergedView`` of packed weights; ``x_fp8``: ``(q, scale)``, x's
    forward operand as the recipe quantizes it, when a kernel that wrote x wrote it too (no
    gradient flows through it; x keeps its own). Tensorwise recipes: ``x_amax``, x's amax
    (float32 scalar on the device) when a kernel that wrote x reduced it, so that x is read
    once; ``grad_amax`` (``custom_kernels.fp8.grad_amax``), where the backward finds the output
    gradient's amax if the kernel that wrote that gradient recorded it. Both must be the very
    values' amaxes (a wrong one quantizes wrongly); torch.compile computes its own.
    UnsupportedInputError for shapes or dtypes the recipe does not take."""
    recipe = recipes.get(recipe)
    weights = list(weights)
    grad = torch.is_grad_enabled()
    train = grad and any(w.requires_grad for w in weights)
    if torch.compiler.is_compiling():
        x_q, x_s = x_fp8 if x_fp8 is not None else (None, None)
        return fp8_linear_op(x, weights, bias, recipe.name, train, x_q, x_s)[0]
    _check_call(x, weights, bias, recipe, x_fp8, x_amax)
    merged = view(weights) if view is not None else fused_linear.merged_view(weights)
    merged = merged.detach() if merged is not None else \
        torch.cat([w.detach() for w in weights])
    if cache is not None and train:
        cache.clear()
    if train or grad and (x.requires_grad or bias is not None and bias.requires_grad):
        return _EagerFp8Linear.apply(x, bias, recipe, cache, x_fp8, (x_amax, grad_amax),
                                     merged, *weights)
    fp8 = cache.get("forward", weights, merged, recipe) if cache is not None else None
    return forward_gemm(x, merged, bias, recipe, False, fp8, x_fp8, x_amax)[0]


class Fp8Linear(nn.Linear):
    """torch.nn.Linear whose three GEMMs run FP8 per ``recipe`` ("tensorwise", "rowwise" or
    "blockwise"; ``cutlass_ops.fp8.recipes``), with an optional activation after the GEMM
    (identity, relu, gelu, gelu_tanh, silu; applied in torch). Same parameters and state_dict
    as nn.Linear (bf16 or fp16 master weights); the weights' FP8 copies for calls that do not
    train them live in ``fp8_weights``, which is no state."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, recipe: Recipe | str = "rowwise", activation: str = "identity"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipes.get(recipe)
        self.recipe.check(in_features, out_features, self.weight.dtype)
        self.activation = Activation(activation).value
        self.fp8_weights = WeightCache()

    def forward(self, x: Tensor) -> Tensor:
        y = fp8_linear(x, (self.weight,), self.bias, self.recipe, cache=self.fp8_weights)
        return epilogues.activate(y, self.activation)

    def loss_head_products(self) -> Optional[Fp8HeadProducts]:
        """The layer's products as an LM head inside the chunked loss (``cutlass_ops.lm_loss``
        asks a head for them): FP8 per its recipe; None with an activation (not a head)."""
        if self.activation != "identity":
            return None
        return Fp8HeadProducts(self.recipe, self.fp8_weights)

    def extra_repr(self) -> str:
        fused = f", activation={self.activation}" if self.activation != "identity" else ""
        return super().extra_repr() + f", recipe={self.recipe.name}{fused}"

    @classmethod
    def from_linear(cls, layer: nn.Linear, recipe: Recipe | str,
                    activation: Optional[str] = None) -> Fp8Linear:
        """An FP8 Linear sharing ``layer``'s parameters (no copy: optimizers keep working);
        the activation is ``layer``'s (a cutlass_ops.nn.Linear's fused one) unless given."""
        recipe = recipes.get(recipe)
        recipe.check(layer.in_features, layer.out_features, layer.weight.dtype)
        new = cls(layer.in_features, layer.out_features, bias=layer.bias is not None,
                  device="meta", dtype=layer.weight.dtype, recipe=recipe,
                  activation=activation or getattr(layer, "activation", "identity"))
        new.weight = layer.weight
        new.bias = layer.bias
        new.train(layer.training)
        return new


# The granularities a kernel that writes an activation can also quantize it at (each group
# within one row: the norm and SwiGLU kernels hold a row); a tensor's amax needs a grid-wide pass.
WRITTEN_GRANULARITIES = (Granularity.ROW, Granularity.BLOCK_1X128)


class FusedGemms:
    """The merged and residual GEMMs of a fused decoder block in FP8 (a
    ``cutlass_ops.block_gemms.BlockGemms``: ``fused_linear``'s signatures, plus ``x_fp8``): the
    residual is added after the GEMM, in torch (the bf16 block adds it in the GEMM's epilogue).
    One per module (the attention: QKV and o_proj; the MLP: gate+up and down_proj), with their
    weights' FP8 copies. ``input_fp8``: (granularity, FP8 dtype) of the activation operand the
    forward GEMMs read, when the kernel writing an activation can write it too (rowwise and
    blockwise recipes), else None (tensorwise)."""

    def __init__(self, recipe: Recipe | str):
        self.recipe = recipes.get(recipe)
        self.merged_weights = WeightCache()
        self.residual_weights = WeightCache()
        a = self.recipe.forward.a
        self.input_fp8 = (a.granularity, a.dtype) if a.granularity in WRITTEN_GRANULARITIES \
            else None
        # Tensorwise: kernels that write an activation or a gradient can reduce its amax.
        self.takes_amaxes = a.granularity is Granularity.TENSOR

    copies_weights = True  # the weights' FP8 copies, refreshed when a weight changes
    collectives = False

    def __deepcopy__(self, memo):
        return FusedGemms(self.recipe)

    def merged_linear(self, x: Tensor, weights: Sequence[Tensor],
                      bias: Optional[Tensor] = None,
                      view: Optional[fused_linear.MergedView] = None, *,
                      x_fp8=None, grad_amax: Optional[GradAmax] = None) -> Tensor:
        return fp8_linear(x, weights, bias, self.recipe, cache=self.merged_weights, view=view,
                          x_fp8=x_fp8, grad_amax=grad_amax)

    def linear_residual(self, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                        residual: Tensor, *, x_fp8=None,
                        x_amax: Optional[Tensor] = None) -> Tensor:
        return fp8_linear(x, (weight,), bias, self.recipe, cache=self.residual_weights,
                          x_fp8=x_fp8, x_amax=x_amax) + residual

    def output_projection(self, module: nn.Module, x: Tensor) -> Tensor:
        return module(x)  # o_proj is an FP8 Linear of its own


fast_autograd("cutlass_ops::fp8_linear", eager=_op_forward, backward=_op_backward,
              setup_context=_op_setup, eager_grads=False)

__all__ = ["fp8_linear", "fp8_linear_op", "fp8_linear_backward_op", "Fp8Linear", "FusedGemms",
           "WeightCache", "optimizer_steps"]
