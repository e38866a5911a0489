"""``linear_cross_entropy``: a causal LM's head and its loss without materializing the logits.

``loss = cross_entropy(hidden @ weight.T + bias, labels)``, computed a chunk of rows at a time:
each chunk's logits (one GEMM through ``cutlass_ops.matmul``, bias in its epilogue, in the model
dtype) go through the fused kernel ``custom_kernels.cross_entropy`` (the custom op
``custom_kernels::cross_entropy_chunk``), which reads them once for the log-sum-exp and the loss
and overwrites them in place with the logit gradient, in the model dtype; two more GEMMs turn that
into the chunk's share of ``grad_hidden`` and ``grad_weight``. Never more than one chunk of
logits is alive, and no float32 copy of it. ``grad_weight`` is accumulated in the weight's dtype,
in place (``addmm_``: cuBLAS's beta = 1 epilogue, so one [V, H] buffer; the tuned dispatch's
``residual=`` epilogue writes a new tensor and would hold two): one rounding per chunk, as
Liger-Kernel does, against float32 accumulation's one at the end. ``grad_bias`` is summed in
float32. For ``mean`` and ``sum`` the gradients are computed in the forward pass and only scaled
by the incoming gradient in the backward, in place (no second pass over the vocabulary); ``none``
recomputes each chunk in the backward, where the per-row incoming gradient is known (the
kernel's ``row_scale``). Gradients of inputs that need none (a frozen head) are not computed.

Semantics are ``torch.nn.functional.cross_entropy``'s on the full float32 logits: ``ignore_index``,
``mean`` over the non-ignored rows (or over ``num_items_in_batch``, as Hugging Face's trainer
normalizes), ``sum``, ``none``, ``label_smoothing``, and Gemma-2's ``logit_softcap`` (logits become
``cap * tanh(logits / cap)`` before the loss). A vocabulary sharded across GPUs is out of scope.
(``cutlass_ops.parallel.vocab_parallel_loss`` takes a head whose vocabulary is sharded across ranks.)

**The head's products** are a ``HeadProducts`` (the logits of a chunk, then its gradients to
hidden and weight): the default runs the tuned bf16 GEMMs above; an FP8 LM head passes its own
(``cutlass_ops.fp8.loss_head``: the same three products through FP8 GEMMs, the weight quantized
once a call), so the chunking, the kernel and the reductions stay one code.

Tensors off a CUDA device keep torch's step (``_chunk_step``: float32 logits, the CPU rule of
``custom_kernels.core.fallback``), except under ``torch.compile``, where the custom op runs on
every device (its CPU implementation is that same torch step).
"""

from __future__ import annotations

from typing import Optional

import torch

from custom_kernels import cross_entropy as kernel
from custom_kernels.core import fallback
from custom_kernels.core.errors import UnsupportedInputError

REDUCTIONS = ("mean", "sum", "none")
# A chunk's logits (in the model dtype, which the kernel overwrites with the gradient) take at
# most this much memory unless the caller sets chunk_rows.
CHUNK_BYTES_CAP = 1 << 30
CHUNK_SHARE_OF_FREE = 1 / 8


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         logit_softcap: Optional[float] = None,
                         num_items_in_batch: Optional[int] = None,
                         chunk_rows: Optional[int] = None,
                         products: Optional["HeadProducts"] = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without the logits.

    hidden: (..., H); weight: (V, H); labels: hidden's leading shape, int64, values in [0, V) or
    ``ignore_index``; bias: (V,). Returns a scalar (``mean``, ``sum``) or labels' shape (``none``,
    float32). ``num_items_in_batch``: with ``mean``, divide the sum by it instead of by the count
    of non-ignored labels. ``chunk_rows``: rows a chunk (default: from free memory and V).
    A label outside [0, V) that is not ``ignore_index``: UnsupportedInputError off a GPU; on a GPU
    its row's loss and gradients are NaN (checking first would sync with the host every step).
    ``products``: the head's GEMMs (``HeadProducts``; default the tuned bf16 ones).
    """
    rows_hidden, flat_labels = _check(hidden, weight, labels, bias, reduction, label_smoothing,
                                      logit_softcap, num_items_in_batch, ignore_index)
    if products is not None and not isinstance(products, HeadProducts):
        raise UnsupportedInputError(f"products must be a HeadProducts (the head's GEMMs), got "
                                    f"{type(products).__name__}")
    chunk = chunk_rows or default_chunk_rows(rows_hidden.shape[0], weight.shape[0],
                                             hidden.device, hidden.dtype)
    if chunk < 1:
        raise UnsupportedInputError(f"chunk_rows must be positive, got {chunk}")
    loss = _LinearCrossEntropy.apply(rows_hidden, weight, bias, flat_labels, ignore_index,
                                     reduction, float(label_smoothing), logit_softcap,
                                     num_items_in_batch, int(chunk), products or HeadProducts())
    return loss.view(labels.shape) if reduction == "none" else loss


def default_chunk_rows(rows: int, vocab: int, device: torch.device,
                       dtype: torch.dtype = torch.float32) -> int:
    """Rows whose logits in ``dtype`` (the model's: the chunk the kernel works on in place) fit
    an eighth of the free device memory, at most 1 GiB; a multiple of 128 (whole GEMM tiles)
    unless the problem is smaller. (Off CUDA the torch step adds float32 copies of the chunk.)"""
    budget = CHUNK_BYTES_CAP
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, int(free * CHUNK_SHARE_OF_FREE))
    chunk = max(1, budget // (dtype.itemsize * vocab))
    if chunk >= 128:
        chunk -= chunk % 128
    return min(rows, chunk) if rows else 1


def _check(hidden, weight, labels, bias, reduction, label_smoothing, logit_softcap,
           num_items_in_batch, ignore_index):
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedInputError(f"{name} must be a tensor, got {type(t).__name__}")
    if reduction not in REDUCTIONS:
        raise UnsupportedInputError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise UnsupportedInputError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise UnsupportedInputError(f"logit_softcap must be positive, got {logit_softcap}")
    if num_items_in_batch is not None and (reduction != "mean" or num_items_in_batch <= 0):
        raise UnsupportedInputError("num_items_in_batch is a positive count, used with "
                                    "reduction='mean' only")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise UnsupportedInputError(f"hidden {tuple(hidden.shape)} and weight "
                                    f"{tuple(weight.shape)}: weight must be (vocab, hidden) with "
                                    "hidden's last dimension")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise UnsupportedInputError(f"labels {tuple(labels.shape)} must have hidden's leading "
                                    f"shape {tuple(hidden.shape[:-1])}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise UnsupportedInputError(f"labels must be int64 (or int32), got {labels.dtype}")
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        raise UnsupportedInputError(f"hidden and weight must share one floating dtype, got "
                                    f"{hidden.dtype} and {weight.dtype}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or
                             bias.dtype != weight.dtype):
        raise UnsupportedInputError(f"bias must be ({weight.shape[0]},) of {weight.dtype}, got "
                                    f"{tuple(bias.shape)} of {bias.dtype}")
    devices = {t.device for t in (hidden, weight, labels, bias) if t is not None}
    if len(devices) > 1:
        raise UnsupportedInputError(f"tensors on different devices: {sorted(map(str, devices))}")
    flat = labels.reshape(-1).long()
    # Read on the host off a GPU only: on a GPU it would be a sync in every train step (the one
    # sync of a converted model's step); there the kernel makes a bad label's row NaN instead.
    if not flat.is_cuda and not torch.compiler.is_compiling():
        bad = (flat != ignore_index) & ((flat < 0) | (flat >= weight.shape[0]))
        if bool(bad.any()):
            first = flat[bad][0].item()
            raise UnsupportedInputError(f"label {first} is outside [0, {weight.shape[0]}) and is "
                                        f"not ignore_index ({ignore_index})")
    return hidden.reshape(-1, hidden.shape[-1]), flat


def _matmul(a, b, bias=None):
    """The tuned dispatch eagerly (``bias`` in the GEMM's epilogue); under torch.compile its
    custom ops (``cutlass_ops::mm`` / ``::linear``, which have fake implementations), since the
    eager dispatch reads pointers a graph cannot trace."""
    if torch.compiler.is_compiling():
        from cutlass_ops import ops

        return ops.mm(a, b) if bias is None else ops.linear(a, b.t(), bias)
    from cutlass_ops.gemms.dispatch import matmul

    return matmul(a, b, bias=bias.detach() if bias is not None else None)


class HeadProducts:
    """The head's three products in the chunked loss, bf16 through the tuned dispatch. A
    subclass (an FP8 head's) overrides them; ``start`` runs once per pass over the chunks (what
    the chunks share: the weight's operands), ``finish`` after it."""

    def start(self, weight: torch.Tensor, train_weight: bool) -> None:
        pass

    def finish(self) -> None:
        pass

    def logits(self, hidden_chunk, weight, bias=None) -> torch.Tensor:
        """``hidden_chunk @ weight.T (+ bias)`` in the model dtype."""
        return _matmul(hidden_chunk, weight.t(), bias)

    def grad_hidden(self, grad, weight) -> torch.Tensor:
        """The chunk's hidden gradient from its logits gradient ``grad``."""
        return _matmul(grad, weight)

    def grad_weight(self, accumulated, grad, hidden_chunk) -> torch.Tensor:
        """``accumulated`` (None at the first chunk) plus this chunk's weight gradient."""
        return _accumulate(accumulated, grad.t(), hidden_chunk)


def _logits(hidden_chunk, weight, bias, softcap, products):
    """A chunk's float32 logits, and the softcap's tanh (None without a cap) for the gradient:
    the torch step's input, off CUDA."""
    logits = products.logits(hidden_chunk, weight)
    if bias is not None:
        logits = logits + bias
    logits = logits.float()
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, capped


# Per row of a chunk: the loss (0 where ignored) and the gradient of the summed loss with respect
# to the chunk's pre-cap float32 logits; F.cross_entropy's semantics (custom_kernels keeps the one
# definition, which its op's CPU implementation runs too).
_chunk_step = kernel.torch_chunk_step


def _torch_chunk(hidden_chunk, weight, bias, labels, ignore_index, smoothing, softcap,
                 row_scale, want_grads, products):
    """The chunk off CUDA: torch's step on float32 logits; the gradient (times ``row_scale``)
    in hidden's dtype, and its float32 column sums with a ``bias``."""
    logits, capped = _logits(hidden_chunk, weight, bias, softcap, products)
    losses, grad = _chunk_step(logits, capped, labels, ignore_index, smoothing)
    del logits, capped
    if not want_grads:
        return losses, None, None
    if row_scale is not None:
        grad *= row_scale[:, None]
    return losses, grad.to(hidden_chunk.dtype), grad.sum(0) if bias is not None else None


def _fused_chunk(hidden_chunk, weight, bias, labels, ignore_index, smoothing, softcap,
                 row_scale, want_grads, products):
    """The chunk through the fused kernel: logits in the model dtype (bias in the GEMM's
    epilogue), overwritten in place with the gradient (times ``row_scale``)."""
    logits = products.logits(hidden_chunk, weight, bias)
    if logits.stride(-1) != 1:  # the kernel's layout (a GEMM's output has it)
        logits = logits.contiguous()
    losses = torch.ops.custom_kernels.cross_entropy_chunk(
        logits, labels, ignore_index, smoothing, softcap, row_scale, want_grads)
    if not want_grads:
        return losses, None, None
    return losses, logits, logits.sum(0, dtype=torch.float32) if bias is not None else None


def _chunks(rows: int, chunk: int):
    for start in range(0, rows, chunk):
        yield slice(start, min(start + chunk, rows))


def _accumulate(grad_weight, grad_t, hidden_chunk):
    """``grad_weight + grad_t @ hidden_chunk`` in the weight's dtype: the first chunk's GEMM
    writes it, later ones add in place (cuBLAS's beta = 1: no second [V, H] buffer, one rounding
    per chunk)."""
    if grad_weight is None:
        return _matmul(grad_t, hidden_chunk)
    return grad_weight.addmm_(grad_t, hidden_chunk)


def _loss_and_grads(hidden, weight, bias, labels, ignore_index, smoothing, softcap, chunk,
                    products, row_scale=None, wants=(True, True, True)):
    """The per-row losses and the gradients of ``sum(row_scale * loss)`` that ``wants`` asks for
    (hidden, weight, bias): hidden's and weight's in their dtype, bias's in float32."""
    rows = hidden.shape[0]
    losses = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    want_hidden, want_weight, want_bias = wants[0], wants[1], wants[2] and bias is not None
    want_grads = want_hidden or want_weight or want_bias
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    grad_weight = None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
        if want_bias else None
    fused = hidden.is_cuda or torch.compiler.is_compiling()
    if not fused:
        fallback.log_once("linear_cross_entropy uses torch's chunk step",
                          f"the tensors are on {hidden.device}, not a CUDA device")
    step = _fused_chunk if fused else _torch_chunk
    products.start(weight, want_weight)
    for part in _chunks(rows, chunk):
        losses[part], grad, column_sums = step(
            hidden[part], weight, bias, labels[part], ignore_index, smoothing, softcap,
            row_scale[part] if row_scale is not None else None, want_grads, products)
        if grad_bias is not None:
            grad_bias += column_sums
        if want_hidden:
            grad_hidden[part] = products.grad_hidden(grad, weight)
        if want_weight:
            grad_weight = products.grad_weight(grad_weight, grad, hidden[part])
        del grad
    products.finish()
    if want_weight and grad_weight is None:  # no rows
        grad_weight = torch.zeros_like(weight)
    return losses, grad_hidden, grad_weight, grad_bias


def _scale(t, scale):
    """``t *= scale`` in place in float32 math (``custom_kernels.cross_entropy.scale_``: one
    pass of a kernel on a GPU; ``scale`` stays a device value)."""
    return kernel.scale_(t, scale) if t is not None else None


def divisor(reduction: str, labels, ignore_index: int, num_items=None):
    """What the summed loss is divided by: 1 for ``sum``; for ``mean``, ``num_items`` (Hugging
    Face's trainer) or the count of non-ignored labels, as F.cross_entropy (a device value: no
    sync; NaN in the loss when every label is ignored)."""
    if reduction != "mean":
        return 1.0
    return float(num_items) if num_items is not None else (labels != ignore_index).sum()


def divides_in_forward(hidden) -> bool:
    """Whether the gradients are divided by the count in the forward (``per_row``): not in
    float16, whose range would flush them to zero (a softmax over a large vocabulary, 1 / V,
    divided by thousands of rows falls below its smallest subnormal), so that the backward
    divides them after the GEMMs, in float32 math."""
    return hidden.dtype != torch.float16


def per_row(count, hidden, dtype=torch.float32):
    """``1 / count`` (``divisor``'s) for each of hidden's rows, on its device, or None for a
    count of 1: the row scale that divides the gradients in the forward. A count of 0 (every
    label ignored: every gradient row is zero, the loss NaN as F.cross_entropy's) scales by 1,
    where 1 / 0 would make the zeros NaN."""
    rows = hidden.shape[0]
    if isinstance(count, torch.Tensor):
        return torch.reciprocal(count.clamp_min(1).to(dtype)).expand(rows).contiguous()
    if count == 1.0:
        return None
    return torch.full((rows,), 1.0 / count if count else 1.0, dtype=dtype, device=hidden.device)


def division(count, hidden, wanted: bool, dtype=torch.float32) -> tuple:
    """Where the gradients are divided by ``count``: (the row scale of the forward, the count
    left for the backward), one of them None (both when no gradient is wanted: nothing to make)."""
    if not wanted:
        return None, None
    if divides_in_forward(hidden):
        return per_row(count, hidden, dtype), None
    return None, count


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, smoothing, softcap,
                num_items, chunk, products):
        args = (ignore_index, smoothing, softcap, chunk, products)
        ctx.reduction, ctx.args, ctx.weight_dtype = reduction, args, weight.dtype
        if reduction == "none":  # the per-row incoming gradient comes later: recompute then
            losses, *_ = _loss_and_grads(hidden, weight, bias, labels, *args,
                                         wants=(False, False, False))
            ctx.save_for_backward(hidden, weight, bias, labels)
            return losses
        # The gradients of the reduced loss, now, while each chunk's logits are at hand: the
        # kernel writes each row's gradient already divided by the count, so that the backward
        # only scales them by its incoming gradient (a pass the scale kernel skips when that
        # is 1, as after loss.backward()).
        count = divisor(reduction, labels, ignore_index, num_items)
        wants = tuple(ctx.needs_input_grad[:3])
        row_scale, ctx.late_count = division(count, hidden, any(wants))
        losses, *ctx.grads = _loss_and_grads(hidden, weight, bias, labels, *args,
                                             row_scale=row_scale, wants=wants)
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduction == "none":
            hidden, weight, bias, labels = ctx.saved_tensors
            _, grad_hidden, grad_weight, grad_bias = _loss_and_grads(
                hidden, weight, bias, labels, *ctx.args, row_scale=grad_output.float(),
                wants=tuple(ctx.needs_input_grad[:3]))
        else:
            grad_hidden, grad_weight, grad_bias = ctx.grads
            ctx.grads = None
            scale = grad_output.float()
            if ctx.late_count is not None:
                scale = scale / ctx.late_count
            grad_hidden, grad_weight = _scale(grad_hidden, scale), _scale(grad_weight, scale)
            grad_bias = grad_bias * scale if grad_bias is not None else None
        return (grad_hidden, grad_weight,
                grad_bias.to(ctx.weight_dtype) if grad_bias is not None else None,
                None, None, None, None, None, None, None, None)


__all__ = ["linear_cross_entropy", "default_chunk_rows", "HeadProducts"]
