"""``linear_cross_entropy``: a causal LM's head and its loss without materializing the logits.

``loss = cross_entropy(hidden @ weight.T + bias, labels)``, computed a chunk of rows at a time:
each chunk's logits (one GEMM through ``cutlass_ops.matmul``, in the input dtype, then float32 as
Hugging Face's loss does) give that chunk's log-sum-exp, loss and logit gradient, which two more
GEMMs turn into the chunk's share of ``grad_hidden`` and ``grad_weight`` (accumulated in float32).
Never more than one chunk of logits is alive. For ``mean`` and ``sum`` the gradients are computed
in the forward pass and only scaled by the incoming gradient in the backward (no second pass over
the vocabulary); ``none`` recomputes each chunk in the backward, where the per-row incoming
gradient is known.

Semantics are ``torch.nn.functional.cross_entropy``'s on the full float32 logits: ``ignore_index``,
``mean`` over the non-ignored rows (or over ``num_items_in_batch``, as Hugging Face's trainer
normalizes), ``sum``, ``none``, ``label_smoothing``, and Gemma-2's ``logit_softcap`` (logits become
``cap * tanh(logits / cap)`` before the loss). A vocabulary sharded across GPUs is out of scope.

Today the per-chunk step is torch's; the fused kernel of ``custom_kernels`` (one read and one
write of the chunk) replaces ``_chunk_step`` without changing anything else here.
"""

from __future__ import annotations

from typing import Optional

import torch

from custom_kernels.core.errors import UnsupportedInputError

REDUCTIONS = ("mean", "sum", "none")
# Chunk logits are float32: this much memory per chunk unless the caller sets chunk_rows.
CHUNK_BYTES_CAP = 1 << 30
CHUNK_SHARE_OF_FREE = 1 / 8


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         logit_softcap: Optional[float] = None,
                         num_items_in_batch: Optional[int] = None,
                         chunk_rows: Optional[int] = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without the logits.

    hidden: (..., H); weight: (V, H); labels: hidden's leading shape, int64, values in [0, V) or
    ``ignore_index``; bias: (V,). Returns a scalar (``mean``, ``sum``) or labels' shape (``none``,
    float32). ``num_items_in_batch``: with ``mean``, divide the sum by it instead of by the count
    of non-ignored labels. ``chunk_rows``: rows a chunk (default: from free memory and V).
    """
    rows_hidden, flat_labels = _check(hidden, weight, labels, bias, reduction, label_smoothing,
                                      logit_softcap, num_items_in_batch, ignore_index)
    chunk = chunk_rows or default_chunk_rows(rows_hidden.shape[0], weight.shape[0],
                                             hidden.device)
    if chunk < 1:
        raise UnsupportedInputError(f"chunk_rows must be positive, got {chunk}")
    loss = _LinearCrossEntropy.apply(rows_hidden, weight, bias, flat_labels, ignore_index,
                                     reduction, float(label_smoothing), logit_softcap,
                                     num_items_in_batch, int(chunk))
    return loss.view(labels.shape) if reduction == "none" else loss


def default_chunk_rows(rows: int, vocab: int, device: torch.device) -> int:
    """Rows whose float32 logits fit an eighth of the free device memory, at most 1 GiB; a
    multiple of 128 (whole GEMM tiles) unless the problem is smaller."""
    budget = CHUNK_BYTES_CAP
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, int(free * CHUNK_SHARE_OF_FREE))
    chunk = max(1, budget // (4 * vocab))
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
    if not torch.compiler.is_compiling():  # a host sync: eager only (a compiled graph skips it)
        bad = (flat != ignore_index) & ((flat < 0) | (flat >= weight.shape[0]))
        if bool(bad.any()):
            first = flat[bad][0].item()
            raise UnsupportedInputError(f"label {first} is outside [0, {weight.shape[0]}) and is "
                                        f"not ignore_index ({ignore_index})")
    return hidden.reshape(-1, hidden.shape[-1]), flat


def _matmul(a, b):
    """The tuned dispatch eagerly; under torch.compile its custom op (``cutlass_ops::mm``, which
    has a fake implementation), since the eager dispatch reads pointers a graph cannot trace."""
    if torch.compiler.is_compiling():
        from cutlass_ops import ops

        return ops.mm(a, b)
    from cutlass_ops.gemms.dispatch import matmul

    return matmul(a, b)


def _logits(hidden_chunk, weight, bias, softcap):
    """A chunk's float32 logits, and the softcap's tanh (None without a cap) for the gradient."""
    logits = _matmul(hidden_chunk, weight.t())
    if bias is not None:
        logits = logits + bias
    logits = logits.float()
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, capped


def _chunk_step(logits, capped, labels, ignore_index, smoothing):
    """Per row of a chunk: the loss (0 where ignored) and the gradient of the summed loss with
    respect to the chunk's pre-cap logits (float32)."""
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target[:, None])[:, 0]
    loss = (1.0 - smoothing) * (lse - picked)
    if smoothing:
        loss = loss + smoothing * (lse - logits.mean(dim=-1))
    loss = torch.where(valid, loss, 0.0)
    grad = torch.softmax(logits, dim=-1)
    if smoothing:
        grad -= smoothing / logits.shape[-1]
    grad.scatter_add_(1, target[:, None], torch.full_like(picked[:, None], smoothing - 1.0))
    grad *= valid[:, None]
    if capped is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
        grad *= 1.0 - capped * capped
    return loss, grad


def _chunks(rows: int, chunk: int):
    for start in range(0, rows, chunk):
        yield slice(start, min(start + chunk, rows))


def _loss_and_grads(hidden, weight, bias, labels, ignore_index, smoothing, softcap, chunk,
                    row_scale=None, want_grads=True):
    """The per-row losses and, with ``want_grads``, the gradients of ``sum(row_scale * loss)``
    (hidden's dtype; weight's and bias's in float32, summed over the chunks)."""
    rows = hidden.shape[0]
    losses = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    grad_hidden = grad_weight = grad_bias = None
    if want_grads:
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if bias is not None:
            grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
    for part in _chunks(rows, chunk):
        logits, capped = _logits(hidden[part], weight, bias, softcap)
        losses[part], grad = _chunk_step(logits, capped, labels[part], ignore_index, smoothing)
        del logits, capped
        if not want_grads:
            continue
        if row_scale is not None:
            grad *= row_scale[part, None]
        if grad_bias is not None:
            grad_bias += grad.sum(0)
        grad = grad.to(hidden.dtype)
        grad_hidden[part] = _matmul(grad, weight)
        grad_weight += _matmul(grad.t(), hidden[part]).float()
    return losses, grad_hidden, grad_weight, grad_bias


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, smoothing, softcap,
                num_items, chunk):
        args = (ignore_index, smoothing, softcap, chunk)
        ctx.reduction, ctx.args, ctx.weight_dtype = reduction, args, weight.dtype
        if reduction == "none":  # the per-row incoming gradient comes later: recompute then
            losses, *_ = _loss_and_grads(hidden, weight, bias, labels, *args, want_grads=False)
            ctx.save_for_backward(hidden, weight, bias, labels)
            return losses
        # The gradients of the summed loss, now, while each chunk's logits are at hand; the
        # backward only scales them.
        losses, *grads = _loss_and_grads(hidden, weight, bias, labels, *args,
                                         want_grads=any(ctx.needs_input_grad[:3]))
        ctx.grads = grads
        ctx.count = 1.0
        if reduction == "mean":  # F.cross_entropy: the non-ignored rows (NaN when none is)
            ctx.count = float(num_items) if num_items is not None else \
                (labels != ignore_index).sum()
        return losses.sum() / ctx.count

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduction == "none":
            hidden, weight, bias, labels = ctx.saved_tensors
            _, grad_hidden, grad_weight, grad_bias = _loss_and_grads(
                hidden, weight, bias, labels, *ctx.args, row_scale=grad_output.float())
        else:
            grad_hidden, grad_weight, grad_bias = ctx.grads
            ctx.grads = None
            scale = grad_output.float() / ctx.count
            grad_hidden = (grad_hidden.float() * scale).to(grad_hidden.dtype)
            grad_weight = grad_weight * scale
            grad_bias = grad_bias * scale if grad_bias is not None else None
        return (grad_hidden, grad_weight.to(ctx.weight_dtype),
                grad_bias.to(ctx.weight_dtype) if grad_bias is not None else None,
                None, None, None, None, None, None, None)


__all__ = ["linear_cross_entropy", "default_chunk_rows"]
