"""The vocabulary-parallel cross-entropy's two per-chunk passes (``csrc/cross_entropy.cu``:
``cross_entropy_shard_stats`` and ``cross_entropy_shard_grad``), for a tensor-parallel LM head
whose rank holds the logits of its slice ``[vocab_start, vocab_start + V_local)`` of the
vocabulary (``cutlass_ops.parallel.vocab_parallel_loss``, which runs the collective between
them).

- ``shard_stats(logits, labels, vocab_start=, ignore_index=, softcap=)`` -> ``[3, R]``: per row
  the slice's log-sum-exp, the target logit where the label falls in the slice (else 0) and the
  sum of the logits (label smoothing), of the soft-capped logits ``x = cap * tanh(raw / cap)``
  when a cap is given; 0, 0, 0 for a row whose label is ``ignore_index``.
- ``shard_grad_(logits, labels, lse, ...)`` overwrites ``logits`` with the gradient of each
  row's loss with respect to its raw logits, given the rows' global log-sum-exp ``lse``:
  ``exp(x - lse) - eps / vocab_total - (1 - eps) * onehot(label - vocab_start)``, times
  ``1 - tanh^2`` under a cap, times ``row_scale`` when given, 0 on ignored rows; returns it.

Why kernels: the torch form of the same math works on float32 copies of the chunk (a
conversion, ``logsumexp``'s max and exp passes, the gradient's exp, scale and conversion back):
about nine times the bytes of one read for the statistics and one read and write for the
gradient, which is what the kernels move, in the logits' dtype with float32 math. On a 2-GPU
tensor-parallel Llama-3-8B-shaped step that is milliseconds a step.

float32, float16 and bfloat16 logits on a CUDA device with a contiguous last dimension take the
kernels; anything else (float64, off CUDA: the CPU rule of ``custom_kernels.core.fallback``)
takes the torch form, whose statistics are float64 for float64 logits. No host sync and no
allocation but the statistics: both can be captured in a CUDA graph. Inputs are the caller's
to check (``vocab_parallel_loss`` checks them across the ranks first): int64 labels ``[R]``,
float32 ``lse`` and ``row_scale`` ``[R]`` on the logits' device.
"""

from __future__ import annotations

from typing import Optional

import torch

from custom_kernels import cross_entropy, jit

STATS_KERNEL = "cross_entropy_shard_stats"
GRAD_KERNEL = "cross_entropy_shard_grad"


def _kernel_takes(logits: torch.Tensor) -> bool:
    return (logits.is_cuda and logits.dtype in cross_entropy.DTYPE_CODES
            and cross_entropy._kernel_layout(logits) and not torch.compiler.is_compiling())


def _launch(name: str, logits: torch.Tensor, softcap: Optional[float], *args) -> None:
    """One launch over the chunk's rows: a persistent grid, one block a row at a time."""
    from custom_kernels.cooperative import max_cooperative_grid
    from custom_kernels.launch import launch, sm_count

    rows, vocab = logits.shape
    size, device = logits.element_size(), logits.device.index
    block = cross_entropy.block_size(vocab, size)
    kernel = jit.get_kernel(cross_entropy.SOURCE, name, device=device,
                            defines=cross_entropy._defines(cross_entropy.DTYPE_CODES[logits.dtype],
                                                           True, block, softcap is not None))
    grid = max(1, min(rows, max_cooperative_grid(kernel, block, 0, device) or sm_count(device)))
    launch(kernel, *args, grid=grid, block=block, device=device)


def shard_stats(logits: torch.Tensor, labels: torch.Tensor, *, vocab_start: int,
                ignore_index: int = -100, softcap: Optional[float] = None) -> torch.Tensor:
    """``[3, R]`` statistics of each row of this rank's slice (module docstring)."""
    rows = logits.shape[0]
    if not _kernel_takes(logits):
        return _torch_stats(logits, labels, vocab_start, ignore_index, softcap)
    stats = torch.empty((3, rows), dtype=torch.float32, device=logits.device)
    if rows:
        _launch(STATS_KERNEL, logits, softcap, logits, labels, stats, rows, logits.stride(0),
                logits.shape[1], int(vocab_start), int(ignore_index),
                float(softcap) if softcap is not None else 0.0)
    return stats


def shard_grad_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, *,
                vocab_start: int, vocab_total: int, ignore_index: int = -100,
                smoothing: float = 0.0, softcap: Optional[float] = None,
                row_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``logits`` overwritten with the gradient of each row's loss (module docstring)."""
    rows = logits.shape[0]
    if not _kernel_takes(logits):
        grad = _torch_grad(logits, labels, lse, vocab_start, vocab_total, ignore_index,
                           smoothing, softcap, row_scale)
        return logits.copy_(grad)
    if rows:
        _launch(GRAD_KERNEL, logits, softcap, logits, labels, lse,
                row_scale if row_scale is not None else 0, rows, logits.stride(0),
                logits.shape[1], int(vocab_start), int(vocab_total), int(ignore_index),
                float(smoothing), float(softcap) if softcap is not None else 0.0)
    return logits


# ---------------------------------------------------------------------------------------------
# The torch form: off CUDA, float64, and the tests' second opinion
# ---------------------------------------------------------------------------------------------

def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _capped(logits: torch.Tensor, softcap: Optional[float]):
    """The (capped) logits in the statistics' dtype, a tensor of their own (float32 logits are
    copied: the gradient works in place on it), and the cap's tanh (None without a cap)."""
    x = logits.to(_stat_dtype(logits.dtype), copy=True)
    if softcap is None:
        return x, None
    tanh = torch.tanh(x / softcap)
    return tanh * softcap, tanh


def _mine(labels, vocab_start, vocab_local, ignore_index):
    """(rows not ignored, rows whose label falls in the slice, each row's column of it or 0)."""
    valid = labels != ignore_index
    local = labels - vocab_start
    mine = valid & (local >= 0) & (local < vocab_local)
    return valid, mine, torch.where(mine, local, 0)


def _torch_stats(logits, labels, vocab_start, ignore_index, softcap) -> torch.Tensor:
    x, _ = _capped(logits, softcap)
    valid, mine, index = _mine(labels, vocab_start, x.shape[1], ignore_index)
    picked = torch.where(mine, x.gather(1, index[:, None])[:, 0], 0.0)
    stats = torch.stack([torch.logsumexp(x, dim=-1), picked, x.sum(-1)])
    return stats.masked_fill_(~valid, 0.0)


def _torch_grad(logits, labels, lse, vocab_start, vocab_total, ignore_index, smoothing, softcap,
                row_scale) -> torch.Tensor:
    x, tanh = _capped(logits, softcap)
    valid, mine, index = _mine(labels, vocab_start, x.shape[1], ignore_index)
    grad = x.sub_(lse[:, None].to(x.dtype)).exp_()
    if smoothing:
        grad.sub_(smoothing / vocab_total)
    grad.scatter_add_(1, index[:, None], ((smoothing - 1.0) * mine.to(grad.dtype))[:, None])
    scale = valid.to(grad.dtype)
    if row_scale is not None:
        scale = scale * row_scale.to(grad.dtype)
    grad.mul_(scale[:, None])
    if tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
        grad.mul_(tanh.mul_(tanh).neg_().add_(1.0))
    return grad


__all__ = ["shard_grad_", "shard_stats"]
