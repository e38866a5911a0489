"""``vocab_parallel_linear_cross_entropy``: the fused LM head and loss over a vocabulary sharded
across the ranks of a process group (tensor parallelism: torch's ``ColwiseParallel`` lm_head).

Every rank holds the same ``hidden`` (..., H) and ``labels`` (replicated, as ColwiseParallel's
input is) and its own rows of the head, ``weight_shard`` (V_local, H): rows
``[vocab_start, vocab_start + V_local)`` of the full (V, H) head. The result is
``F.cross_entropy(hidden @ full_weight.T, labels)`` on the full float32 logits (``ignore_index``;
``mean`` over the non-ignored labels or the sum over ``num_items_in_batch`` as Hugging Face's
trainer normalizes; ``sum``; ``none``; ``label_smoothing``; Gemma-2's ``logit_softcap``), the same
on every rank. Backward gives ``hidden`` its full gradient on every rank (as a replicated input
gets) and each rank's ``weight_shard`` the gradient of its own rows.

A chunk of rows at a time, as ``cutlass_ops.fused_cross_entropy.linear_cross_entropy``: the local
logits (one GEMM through ``cutlass_ops.matmul``, in the model dtype), then per row in float32
this rank's log-sum-exp over its slice, the target logit where the label falls in its slice
(else 0) and, with label smoothing, the sum of its logits; ONE all-gather of those statistics;
the global log-sum-exp is a logsumexp over the ranks', the target logit and the sum are sums.
The local logit gradient ``softmax_local(global lse) - onehot_local`` (smoothing, softcap and
ignored rows as ``F.cross_entropy``) then goes through two GEMMs: this rank's share of
``grad_hidden`` and the gradient of its rows of the head. For ``mean`` and ``sum`` the gradients
are computed in the forward pass and only scaled in the backward; ``none`` keeps the global
log-sum-exp of each row and recomputes the chunks in the backward (no collective there).

Collectives per call, on ``group``: (1) one all-gather of a few int64s per rank, read on the
host: the one host sync of a call (the shards' extents, so that they are checked to tile
[0, V), the chunk size every rank uses, the range and a checksum of the labels, and whether a
rank refused its inputs, so that all ranks raise together instead of one hanging in a
collective); (2) in the forward, one all-gather per chunk of float32 [2 or 3, rows of the chunk];
(3) in the backward, one all-reduce (SUM) of ``grad_hidden`` [rows, H] in hidden's dtype, when
hidden needs a gradient (none for the weight: each rank's rows are its own). Every rank must
make the same call (same hidden shape, reduction and ``requires_grad``) and run the backward.

The one-launch kernel of ``linear_cross_entropy`` (``custom_kernels.cross_entropy``) does not
fit: it needs a row's whole log-sum-exp in its one pass, which here is known only after the
collective. Its two halves do (``custom_kernels.parallel.shard_cross_entropy``): the slice's
statistics in one read of the chunk before the gather, the gradient in one read and write after
it, on the chunk in the model dtype with float32 math (torch's float32 form of the same steps,
what float64 and tensors off CUDA run, moved about nine times the bytes). Not
written for ``torch.compile`` (the host sync of (1) would break the graph).

Captured in a CUDA graph (``cutlass_ops.graphed_train_step``), a call reuses the plan an eager
call of the same shapes agreed (refused, naming why, without one) and checks the labels on the
device instead: where they would have been refused, the loss is NaN (a replay cannot raise).

Optional DTensor inputs: a ``weight_shard`` DTensor placed ``Shard(0)`` on a 1-D mesh (its local
tensor, its mesh's group, its rows as torch's ``Shard(0)`` splits them); ``hidden`` and
``labels`` DTensors with ``Replicate`` placements (their local tensors).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import torch
import torch.distributed as dist

from cutlass_ops.fused_cross_entropy import (REDUCTIONS, _accumulate, _chunks, _matmul,
                                             default_chunk_rows, division, divisor)
from custom_kernels import cross_entropy as kernel
from custom_kernels.parallel import shard_cross_entropy as shard_ce
from custom_kernels.core.errors import UnsupportedInputError

NAME = "vocab_parallel_linear_cross_entropy"
INT64_MAX = torch.iinfo(torch.int64).max
# The setup gather's fields, one int64 each per rank (see _agree).
FIELDS = ("refused", "vocab_local", "vocab_start", "rows", "hidden", "chunk",
          "label_min", "label_max", "label_sum")


def vocab_parallel_linear_cross_entropy(
        hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor, *,
        group=None, vocab_start: Optional[int] = None, ignore_index: int = -100,
        reduction: str = "mean", label_smoothing: float = 0.0,
        logit_softcap: Optional[float] = None, num_items_in_batch: Optional[int] = None,
        chunk_rows: Optional[int] = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ full_weight.T`` against ``labels``, the head's rows sharded
    over ``group``'s ranks (default: the world), without the logits. See the module docstring.

    hidden: (..., H), the same on every rank; weight_shard: (V_local, H), rows ``[vocab_start,
    vocab_start + V_local)`` of the full head (``vocab_start`` default: rank * V_local, equal
    shards); the shards must tile [0, V) exactly. labels: hidden's leading shape, int64 (or
    int32), the same on every rank, values in [0, V) or ``ignore_index``. Returns a scalar
    (``mean``, ``sum``) or labels' shape (``none``), float32 (float64 for float64 inputs).
    Refuses (UnsupportedInputError, on every rank alike): an uninitialized group, shapes or
    dtypes that do not match, shards that do not tile the vocabulary, labels outside [0, V)
    that are not ``ignore_index``, labels or rows that differ between ranks.
    """
    _check_options(reduction, label_smoothing, logit_softcap, num_items_in_batch, chunk_rows)
    hidden, weight_shard, labels, group, vocab_start = _unwrap_dtensors(
        hidden, weight_shard, labels, group, vocab_start)
    if not (dist.is_available() and dist.is_initialized()):
        raise UnsupportedInputError(f"{NAME}: torch.distributed is not initialized (call "
                                    "init_process_group first)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise UnsupportedInputError(f"{NAME}: this process is not a member of the group")
    refusal = _local_refusal(hidden, weight_shard, labels)
    start = vocab_start if vocab_start is not None else \
        rank * (weight_shard.shape[0] if refusal is None else 0)
    if refusal is None and start < 0:
        refusal = f"vocab_start must be non-negative, got {start}"
    flat = labels.reshape(-1).long() if refusal is None else None
    rows = flat.numel() if flat is not None else 0
    chunk = chunk_rows or (default_chunk_rows(rows, weight_shard.shape[0], hidden.device,
                                              _stat_dtype(hidden.dtype))
                           if refusal is None else INT64_MAX)
    key = _plan_key(hidden, weight_shard, flat, start, chunk, refusal, group, ignore_index,
                    float(label_smoothing), logit_softcap)
    captured = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    if captured:
        plan = _captured_plan(key)
    else:
        plan = _agree(hidden, weight_shard, flat, start, chunk, refusal, group, rank, world,
                      ignore_index, float(label_smoothing), logit_softcap)
        _remember(key, plan)
    loss = _VocabParallelCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight_shard,
                                            flat, plan, reduction, num_items_in_batch)
    if captured:
        loss = loss + _poison(flat, plan)
    return loss.view(labels.shape) if reduction == "none" else loss


# ---------------------------------------------------------------------------------------------
# Calls captured in a CUDA graph (cutlass_ops.graphed_steps)
# ---------------------------------------------------------------------------------------------

# Plans agreed by eager calls, by everything the agreement reads but the labels' values. A
# capture cannot read the setup gather on the host; graphed_steps captures a signature's second
# call, so the eager call before it agreed the same shapes, and the capture reuses its plan.
_AGREED: dict = {}
_AGREED_LIMIT = 64


def _plan_key(hidden, weight, flat, start, chunk, refusal, group, ignore_index, smoothing,
              softcap) -> Optional[tuple]:
    if refusal is not None:
        return None
    return (group, hidden.device, tuple(weight.shape), start, flat.numel(), hidden.shape[-1],
            chunk, ignore_index, smoothing, softcap)


def _remember(key, plan: _VocabPlan) -> None:
    if key is None:
        return
    if len(_AGREED) >= _AGREED_LIMIT:
        _AGREED.clear()
    _AGREED[key] = plan


def _captured_plan(key) -> _VocabPlan:
    plan = _AGREED.get(key) if key is not None else None
    if plan is None:
        raise RuntimeError(f"{NAME}: a call captured in a CUDA graph without an eager call of "
                           "the same shapes before it (the ranks agree their plan on the host, "
                           "which a capture cannot)")
    return plan


def _poison(flat: torch.Tensor, plan: _VocabPlan) -> torch.Tensor:
    """NaN where a replay's labels would have been refused (out of [0, V) and not ignored, or
    different between the ranks), else 0: the replay cannot raise, so its loss says it. The
    labels' range and checksum (what the setup gather compares), one all-reduce (MAX) of 6
    int64s, on the device: each field's maximum and its negated minimum over the ranks."""
    summary = _label_summary(flat, plan.ignore_index, flat.device)
    low, high = summary[0], summary[1]
    spread = torch.cat([summary, -summary])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=plan.group)
    differ = (spread[:3] != -spread[3:]).any()
    any_label = low <= high
    outside = any_label & ((low < 0) | (high >= plan.vocab))
    return torch.where(differ | outside, float("nan"), 0.0)


# ---------------------------------------------------------------------------------------------
# Checks and the setup gather
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _VocabPlan:
    """What every rank agreed on in the setup gather, and the loss's options."""
    group: object
    world: int
    vocab_start: int
    vocab: int
    chunk: int
    ignore_index: int
    smoothing: float
    softcap: Optional[float]


def _check_options(reduction, label_smoothing, logit_softcap, num_items_in_batch, chunk_rows):
    """The arguments that are the same on every rank: refused before any collective."""
    if reduction not in REDUCTIONS:
        raise UnsupportedInputError(f"{NAME}: reduction must be one of {REDUCTIONS}, got "
                                    f"{reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise UnsupportedInputError(f"{NAME}: label_smoothing must be in [0, 1], got "
                                    f"{label_smoothing}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise UnsupportedInputError(f"{NAME}: logit_softcap must be positive, got "
                                    f"{logit_softcap}")
    if num_items_in_batch is not None and (reduction != "mean" or num_items_in_batch <= 0):
        raise UnsupportedInputError(f"{NAME}: num_items_in_batch is a positive count, used "
                                    "with reduction='mean' only")
    if chunk_rows is not None and chunk_rows < 1:
        raise UnsupportedInputError(f"{NAME}: chunk_rows must be positive, got {chunk_rows}")


def _local_refusal(hidden, weight, labels) -> Optional[str]:
    """Why this rank's tensors are refused, or None. Not raised at once: a rank may be alone in
    refusing (its own shard), and it must still join the setup gather so that no rank hangs."""
    for name, t in (("hidden", hidden), ("weight_shard", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedInputError(f"{NAME}: {name} must be a tensor, got "
                                        f"{type(t).__name__}")
    if weight.dim() != 2 or weight.shape[0] < 1 or hidden.dim() < 1 or \
            hidden.shape[-1] != weight.shape[1]:
        return (f"hidden {tuple(hidden.shape)} and weight_shard {tuple(weight.shape)}: the shard "
                "must be (V_local >= 1, hidden) with hidden's last dimension")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        return f"labels {tuple(labels.shape)} must have hidden's leading shape " \
               f"{tuple(hidden.shape[:-1])}"
    if labels.dtype not in (torch.int64, torch.int32):
        return f"labels must be int64 (or int32), got {labels.dtype}"
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        return f"hidden and weight_shard must share one floating dtype, got {hidden.dtype} " \
               f"and {weight.dtype}"
    devices = {str(t.device) for t in (hidden, weight, labels)}
    if len(devices) > 1:
        return f"tensors on different devices: {sorted(devices)}"
    return None


def _label_summary(flat, ignore_index, device) -> torch.Tensor:
    """Min, max and sum of the non-ignored labels, on the device (no sync); an empty set gives
    (INT64_MAX, -INT64_MAX, 0)."""
    if flat is None or not flat.numel():
        return torch.tensor([INT64_MAX, -INT64_MAX, 0], dtype=torch.int64, device=device)
    keep = flat != ignore_index
    return torch.stack([torch.where(keep, flat, INT64_MAX).amin(),
                        torch.where(keep, flat, -INT64_MAX).amax(),
                        torch.where(keep, flat, 0).sum()])


def _agree(hidden, weight, flat, start, chunk, refusal, group, rank, world, ignore_index,
           smoothing, softcap) -> _VocabPlan:
    """The setup gather (one all-gather of ``FIELDS`` per rank, one host read) and the checks
    on what it brings, which every rank runs on the same table and so refuses alike."""
    ok = refusal is None
    own = [int(not ok), weight.shape[0] if ok else 0, start, flat.numel() if ok else -1,
           hidden.shape[-1] if ok else 0, min(chunk, INT64_MAX)]
    mine = torch.cat([torch.tensor(own, dtype=torch.int64, device=hidden.device),
                      _label_summary(flat, ignore_index, hidden.device)])
    table = mine.new_empty((world, len(FIELDS)))
    _all_gather(table, mine, group)
    table = [dict(zip(FIELDS, row)) for row in table.tolist()]  # the call's one host sync
    refused = [r for r, row in enumerate(table) if row["refused"]]
    if refused:
        raise UnsupportedInputError(f"{NAME}: {refusal}" if refusal is not None else
                                    f"{NAME}: rank(s) {refused} refused their inputs (see "
                                    "their errors)")
    for field, what in (("rows", "hidden's rows"), ("hidden", "hidden's size"),
                        ("label_min", "labels"), ("label_max", "labels"),
                        ("label_sum", "labels")):
        if len({row[field] for row in table}) > 1:
            raise UnsupportedInputError(f"{NAME}: {what} differ between ranks; hidden and "
                                        "labels must be replicated")
    vocab = _tiled_vocab(table)
    low, high = table[0]["label_min"], table[0]["label_max"]
    if low <= high and (low < 0 or high >= vocab):
        bad = low if low < 0 else high
        raise UnsupportedInputError(f"{NAME}: label {bad} is outside [0, {vocab}) and is not "
                                    f"ignore_index ({ignore_index})")
    return _VocabPlan(group, world, start, vocab, min(row["chunk"] for row in table), ignore_index,
                 smoothing, softcap)


def _tiled_vocab(table) -> int:
    """V, once the shards' [start, start + V_local) are checked to tile [0, V) without gaps or
    overlaps (in any order of ranks)."""
    extents = sorted((row["vocab_start"], row["vocab_local"]) for row in table)
    end = 0
    for start, size in extents:
        if start != end:
            raise UnsupportedInputError(
                f"{NAME}: the shards (vocab_start, V_local) by rank "
                f"{[(row['vocab_start'], row['vocab_local']) for row in table]} do not tile "
                "the vocabulary: each must start where another ends, the first at 0")
        end = start + size
    return end


def _unwrap_dtensors(hidden, weight, labels, group, vocab_start):
    """Local tensors of DTensor inputs (a Shard(0) weight on a 1-D mesh, replicated hidden and
    labels), with the weight mesh's group and its rows' start; plain tensors pass through."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:  # not loaded: nothing can be a DTensor
        return hidden, weight, labels, group, vocab_start
    if isinstance(weight, dtensor):
        mesh, placements = weight.device_mesh, weight.placements
        if mesh.ndim != 1 or not placements[0].is_shard(0):
            raise UnsupportedInputError(f"{NAME}: a DTensor weight_shard must be placed Shard(0) "
                                        f"on a 1-D mesh, got {placements} on {mesh.ndim} dims")
        if group is not None and group is not mesh.get_group():
            raise UnsupportedInputError(f"{NAME}: group is not the weight DTensor's mesh group")
        group = mesh.get_group()
        if vocab_start is None:  # torch's Shard(0): chunks of ceil(V / ranks), the last short
            rows = -(-weight.shape[0] // mesh.size())
            vocab_start = min(mesh.get_local_rank() * rows, weight.shape[0])
        weight = weight.to_local()
    out = []
    for name, t in (("hidden", hidden), ("labels", labels)):
        if isinstance(t, dtensor):
            if not all(p.is_replicate() for p in t.placements):
                raise UnsupportedInputError(f"{NAME}: a DTensor {name} must be replicated, got "
                                            f"{t.placements}")
            t = t.to_local()
        out.append(t)
    return out[0], weight, out[1], group, vocab_start


# ---------------------------------------------------------------------------------------------
# Collectives (looked up on torch.distributed at each call)
# ---------------------------------------------------------------------------------------------

def _all_gather(out, tensor, group):
    """``out`` [world, *tensor.shape] gets every rank's ``tensor``: torch's
    ``all_gather_single`` where it exists (2.13 deprecates ``all_gather_into_tensor``), given the
    concatenated view (gloo takes no stacked output)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(-1, *tensor.shape[1:]), tensor, group=group)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# A chunk
# ---------------------------------------------------------------------------------------------

def _global_stats(local, plan):
    """The chunk's global log-sum-exp per row and each row's loss (not yet masked), from this
    rank's [lse, target logit(, logit sum)] per row (``shard_stats``) through one all-gather.

    Why an all-gather and not all-reduce MAX then SUM: the SUM of exp(x - max) needs the global
    max first, two dependent round trips; the gather is one round trip of world x 2 or 3
    floats a row (a few hundred KB at chunk sizes and TP degrees 2-8: latency-bound), and a
    logsumexp over the ranks' log-sum-exps is as exact as the two-step. The target logit and the
    logit sum ride along as plain sums (one rank has a row's target, the others send 0)."""
    local = local[:3 if plan.smoothing else 2].contiguous()
    gathered = local.new_empty((plan.world, *local.shape))
    _all_gather(gathered, local, plan.group)
    lse = torch.logsumexp(gathered[:, 0], dim=0)
    loss = (1.0 - plan.smoothing) * (lse - gathered[:, 1].sum(0))
    if plan.smoothing:  # F.cross_entropy: eps times the mean over all V of (lse - logit)
        loss = loss + plan.smoothing * (lse - gathered[:, 2].sum(0) / plan.vocab)
    return lse, loss


def _run(hidden, weight, labels, plan, *, lse=None, row_scale=None, wants=(False, False)):
    """Per-row losses and global log-sum-exps (``lse`` None: the forward, one all-gather a
    chunk), else the given ``lse`` (the backward of ``none``: no collective); and the gradients
    of ``sum(row_scale * loss)`` that ``wants`` asks for: hidden's (this rank's share, before
    the all-reduce) and the shard's, in their dtype. A chunk's logits stay in the model dtype:
    ``shard_stats`` reads them once, ``shard_grad_`` overwrites them with their gradient."""
    rows, forward = hidden.shape[0], lse is None
    losses = None
    if forward:
        losses = torch.empty(rows, dtype=_stat_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(losses)
    valid = labels != plan.ignore_index
    grad_hidden = torch.empty_like(hidden) if wants[0] else None
    grad_weight = None
    for part in _chunks(rows, plan.chunk):
        logits = _matmul(hidden[part], weight.t())
        if forward:
            stats = shard_ce.shard_stats(logits, labels[part], vocab_start=plan.vocab_start,
                                         ignore_index=plan.ignore_index, softcap=plan.softcap)
            lse[part], loss = _global_stats(stats, plan)
            losses[part] = torch.where(valid[part], loss, 0.0)
        if not (wants[0] or wants[1]):
            continue
        grad = shard_ce.shard_grad_(
            logits, labels[part], lse[part], vocab_start=plan.vocab_start,
            vocab_total=plan.vocab, ignore_index=plan.ignore_index, smoothing=plan.smoothing,
            softcap=plan.softcap, row_scale=row_scale[part] if row_scale is not None else None)
        if wants[0]:
            grad_hidden[part] = _matmul(grad, weight)
        if wants[1]:
            grad_weight = _accumulate(grad_weight, grad.t(), hidden[part])
        del grad, logits
    if wants[1] and grad_weight is None:  # no rows
        grad_weight = torch.zeros_like(weight)
    return losses, lse, grad_hidden, grad_weight


def _scale_(t, scale):
    """``t *= scale`` in place, float32 math for half types (``custom_kernels.cross_entropy
    .scale_``: ``scale`` stays a device value); float64 in float64."""
    if t is None:
        return None
    return t.mul_(scale) if t.dtype == torch.float64 else kernel.scale_(t, scale.float())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, plan, reduction, num_items):
        ctx.plan, ctx.reduction = plan, reduction
        if reduction == "none":  # the per-row incoming gradient comes later: recompute then
            losses, lse, _, _ = _run(hidden, weight, labels, plan)
            ctx.save_for_backward(hidden, weight, labels, lse)
            return losses
        # The gradients already divided by the count (as linear_cross_entropy's): the backward
        # scales by its incoming gradient only, a pass skipped when that is 1.
        count = divisor(reduction, labels, plan.ignore_index, num_items)
        wants = tuple(ctx.needs_input_grad[:2])
        row_scale, ctx.late_count = division(count, hidden, any(wants),
                                             _stat_dtype(hidden.dtype))
        losses, _, *ctx.grads = _run(hidden, weight, labels, plan, row_scale=row_scale,
                                     wants=wants)
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduction == "none":
            hidden, weight, labels, lse = ctx.saved_tensors
            _, _, grad_hidden, grad_weight = _run(
                hidden, weight, labels, ctx.plan, lse=lse,
                row_scale=grad_output.reshape(-1).to(lse.dtype),
                wants=tuple(ctx.needs_input_grad[:2]))
        else:
            grad_hidden, grad_weight = ctx.grads
            ctx.grads = None
            scale = grad_output.to(_stat_dtype(grad_output.dtype))
            if ctx.late_count is not None:
                scale = scale / ctx.late_count
            grad_hidden, grad_weight = _scale_(grad_hidden, scale), _scale_(grad_weight, scale)
        if grad_hidden is not None:
            # Each rank's share comes from its rows of the head: the sum is hidden's gradient,
            # which a replicated input needs whole on every rank. One all-reduce a call, in
            # hidden's dtype (as a row-parallel layer's input gradient is reduced).
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.plan.group)
        return grad_hidden, grad_weight, None, None, None, None


__all__ = ["vocab_parallel_linear_cross_entropy"]
