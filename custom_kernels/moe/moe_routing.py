"""Mixture-of-experts routing in one pass (``csrc/moe_routing.cu``): top-k, weights and the
expert sort from the router logits, forward and backward.

``route(logits, top_k, scoring=, normalize=)`` computes what Hugging Face's routers (Qwen3-MoE,
Qwen2-MoE, Mixtral) compute, ``probs = softmax(logits, dtype=float32); v, index = topk(probs, k);
v /= v.sum(-1, keepdim=True) if normalize; weights = v.to(logits.dtype)``, and the sort of the
(token, slot) pairs by expert that a grouped GEMM needs, as a ``Routing``:

- ``weights`` [T, k] in the logits' dtype: w = v / sum(v) (normalize) or v, float32 rounded once;
- ``index`` [T, k] int64: the selected experts, in descending score order;
- ``token_of_row`` [T * k] int32: the token of each row of the expert-sorted pairs;
- ``offsets`` [E] int32: the pairs whose expert is <= e (cumulative ends, as
  ``torch._grouped_mm`` takes them);
- ``inverse`` [T, k] int32: the sorted row holding pair (t, j), so ``token_of_row[inverse[t, j]]
  == t`` (what ``custom_kernels.moe.moe_combine.combine`` takes).

Scores in float32: ``scoring="softmax"``, p = softmax over the row (max subtracted, IEEE
division); ``"sigmoid"``, p = 1 / (1 + exp(-l)) elementwise (a DeepSeek-V3-style router without
its group limits and bias). Top-k: the k largest p, descending, ties broken by the lower expert
index (torch.topk leaves the order of ties unspecified; ``route_reference`` sorts stably to get
this one); a NaN score counts as the largest, as in torch.topk. The pairs, flattened as t * k + j,
are sorted by expert stably (ties in flattened order) and deterministically: no atomic operation
decides an order, so two runs give the same bits.

Gradient: only ``weights`` is differentiable (to ``logits``); the other outputs are integers.
The backward pass recomputes p from the logits (nothing [T, E] is saved besides them) and
computes, in float32 rounded once to the logits' dtype: dv = (dw - sum_i dw_i w_i) / S with S =
sum v (normalize; else dv = dw), dp = dv at the selected experts and 0 elsewhere, then softmax
dl = p (dp - sum_e dp_e p_e) or sigmoid dl = dp p (1 - p).

Input refused on every device, with UnsupportedInputError: ``logits`` not a 2-D tensor, a dtype
other than float32, float16 or bfloat16, a non-unit last stride (any row stride is read in place),
E outside 1 to ``MAX_EXPERTS``, ``top_k`` not an int in 1 to min(E, ``MAX_TOP_K``), T * k above
2**31 - 1 (the rows are int32), an unknown ``scoring``. T = 0 gives empty outputs and all-zero
offsets.

Kernels (see the .cu file): three launches forward (top-k with a per-block histogram of experts,
a one-block scan of it, the placement of each pair) with an int32 workspace of blocks x E from
torch's allocator, one backward, everything on torch's current stream and no host sync: eagerly,
under ``torch.compile(fullgraph=True)`` (the custom ops ``custom_kernels::moe_routing_fwd`` /
``moe_routing_bwd`` with their fakes and autograd) and in CUDA graphs (run once before capturing:
the kernels are compiled and loaded on first use). Tensors off a CUDA device run
``route_reference`` (the CPU rule, ``custom_kernels.core.fallback``).

Read top-down: the launcher, the compile function, the custom ops, the public function, then the
reference.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import torch

from custom_kernels import jit
from custom_kernels.core import elements, fallback
from custom_kernels.core.eager import plain_eager
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.launch import launch

SOURCE = "moe_routing.cu"
KERNELS = {"topk": "moe_routing_topk_kernel", "scan": "moe_routing_scan_kernel",
           "place": "moe_routing_place_kernel", "bwd": "moe_routing_bwd_kernel"}
WARPS = 8  # warps a block of the top-k, place and backward kernels (a token a warp)
SCAN_BLOCK = 1024  # threads of the scan's one block: an expert a thread
MAX_EXPERTS = SCAN_BLOCK  # 32 a lane in registers at most, and a scan thread each
MAX_TOP_K = 32  # a selection a lane
MAX_PAIRS = 2 ** 31 - 1  # rows, offsets and inverse are int32
MIN_CHUNK = 4 * WARPS  # tokens a block owns at least (launches 1 and 3)
BLOCKS_PER_SM = 4  # the forward grid's target: fewer blocks, a smaller histogram to scan
MAX_GRID = 1 << 20  # blocks of the backward grid; its kernel loops over tokens past it
SCORINGS = ("softmax", "sigmoid")
DTYPE_CODES = elements.float_codes()


class Routing(NamedTuple):
    """What ``route`` returns (see the module docstring)."""
    weights: torch.Tensor       # [T, k], logits' dtype
    index: torch.Tensor         # [T, k], int64
    token_of_row: torch.Tensor  # [T * k], int32
    offsets: torch.Tensor       # [E], int32
    inverse: torch.Tensor       # [T, k], int32


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def lanes_per_row(experts: int) -> int:
    """NE: the experts a lane holds, ceil(E / 32) (compiled in; one cubin per value)."""
    return max(1, -(-experts // 32))


def _defines(kernel: str, dtype_code: int, ne: int) -> dict:
    """Only what each kernel reads: the scan needs neither the dtype nor NE, the placement no
    dtype."""
    if kernel == "scan":
        return {"SCAN_BLOCK": SCAN_BLOCK}
    if kernel == "place":
        return {"NE": ne, "WARPS": WARPS}
    return {"DTYPE": dtype_code, "NE": ne, "WARPS": WARPS}


def partition(tokens: int, sms: int) -> tuple[int, int]:
    """(blocks, chunk) of launches 1 and 3: block b owns tokens [b * chunk, (b + 1) * chunk),
    at least MIN_CHUNK of them, and about BLOCKS_PER_SM blocks an SM for long inputs (the scan
    reads blocks x E counts in one block)."""
    chunk = max(MIN_CHUNK, -(-tokens // (BLOCKS_PER_SM * sms)))
    return max(1, -(-tokens // chunk)), chunk


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _kernel(kernel: str, dtype_code: int, ne: int, device: int):
    """The loaded kernel; cached here too, which saves get_kernel's key normalisation."""
    return jit.get_kernel(SOURCE, KERNELS[kernel], device=device,
                          defines=_defines(kernel, dtype_code, ne))


def _launch(backward: bool, tensors, top_k: int, softmax: bool, normalize: bool) -> None:
    """Forward: ``tensors`` = (logits [T, E] with a unit last stride, weights [T, k], index
    [T, k], token_of_row [T * k], offsets [E], inverse [T, k]), the outputs contiguous;
    backward: (d_weights [T, k], logits, index, d_logits [T, E]), all but logits contiguous.
    T >= 1."""
    if not all(t.is_cuda for t in tensors):  # a custom op given other tensors
        fallback.require_cuda({f"argument {i}": t for i, t in enumerate(tensors)},
                              f"custom_kernels::moe_routing_{'bwd' if backward else 'fwd'}")
    logits = tensors[1] if backward else tensors[0]
    tokens, experts = logits.shape
    ld = logits.stride(0) if tokens > 1 else experts
    device = logits.device.index
    code, ne = DTYPE_CODES[logits.dtype], lanes_per_row(experts)
    flags = (int(softmax), int(normalize))
    if backward:
        d_weights, _, index, d_logits = tensors
        blocks = min(-(-tokens // WARPS), MAX_GRID)
        launch(_kernel("bwd", code, ne, device), d_weights, logits, index, d_logits, tokens,
               experts, top_k, ld, *flags, grid=blocks, block=32 * WARPS, device=device)
        return
    _, weights, index, token_of_row, offsets, inverse = tensors
    blocks, chunk = partition(tokens, _sm_count(device))
    hist = torch.empty((2, blocks, experts), dtype=torch.int32, device=logits.device)
    launch(_kernel("topk", code, ne, device), logits, weights, index, hist[0], tokens, experts,
           top_k, ld, chunk, *flags, grid=blocks, block=32 * WARPS, device=device)
    launch(_kernel("scan", code, ne, device), hist[0], hist[1], offsets, blocks, experts,
           grid=1, block=SCAN_BLOCK, device=device)
    launch(_kernel("place", code, ne, device), index, hist[1], token_of_row, inverse, tokens,
           experts, top_k, chunk, grid=blocks, block=32 * WARPS, device=device)


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def compile_moe_routing(kernel: str = "topk", dtype: str = "bfloat16", experts: int = 128,
                        arch: str = jit.DEFAULT_ARCH) -> Path:
    """The cubin of one of the four kernels (``KERNELS``: "topk", "scan", "place", "bwd") that
    ``route`` runs for logits of ``dtype`` and ``experts`` columns (the kernels compile in
    ceil(E / 32); the scan depends on neither, the placement not on the dtype). Neither T nor
    k is compiled in."""
    if kernel not in KERNELS or not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"compile_moe_routing: kernel must be one of {sorted(KERNELS)} and "
                         f"experts 1 to {MAX_EXPERTS}, got {kernel!r}, {experts}")
    defines = _defines(kernel, elements.element(dtype).code, lanes_per_row(experts))
    return jit.compile_cubin(SOURCE, defines=defines, name_expressions=(KERNELS[kernel],),
                             arch=arch)


# ---------------------------------------------------------------------------------------------
# Custom ops: real impl, fake impl and autograd next to each other
# ---------------------------------------------------------------------------------------------

def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) with a unit last stride: itself when it has one, else a copy (a layout
    torch.compile chose)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _empty_outputs(logits: torch.Tensor, top_k: int) -> Routing:
    tokens, experts = logits.shape
    device = logits.device
    return Routing(torch.empty((tokens, top_k), dtype=logits.dtype, device=device),
                   torch.empty((tokens, top_k), dtype=torch.int64, device=device),
                   torch.empty(tokens * top_k, dtype=torch.int32, device=device),
                   torch.empty(experts, dtype=torch.int32, device=device),
                   torch.empty((tokens, top_k), dtype=torch.int32, device=device))


def _fwd_impl(logits, top_k: int, scoring: str, normalize: bool) -> Routing:
    out = _empty_outputs(logits, top_k)
    if logits.shape[0]:
        _launch(False, (_unit_last(logits), *out), top_k, scoring == "softmax", normalize)
    else:
        out.offsets.zero_()
    return out


def _bwd_impl(d_weights, logits, index, scoring: str, normalize: bool) -> torch.Tensor:
    d_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if d_logits.numel():
        _launch(True, (d_weights.contiguous(), _unit_last(logits), index.contiguous(), d_logits),
                index.shape[1], scoring == "softmax", normalize)
    return d_logits


@torch.library.custom_op("custom_kernels::moe_routing_fwd", mutates_args=())
def moe_routing_fwd(logits: torch.Tensor, top_k: int, scoring: str, normalize: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor]:
    """(weights, index, token_of_row, offsets, inverse), contiguous (see ``Routing``)."""
    _check(logits, top_k, scoring, "custom_kernels::moe_routing_fwd", strides=False)
    return tuple(_fwd_impl(logits, top_k, scoring, normalize))


@moe_routing_fwd.register_fake
def _(logits, top_k, scoring, normalize):
    _check(logits, top_k, scoring, "custom_kernels::moe_routing_fwd", strides=False)
    return tuple(_empty_outputs(logits, top_k))


@torch.library.custom_op("custom_kernels::moe_routing_bwd", mutates_args=())
def moe_routing_bwd(d_weights: torch.Tensor, logits: torch.Tensor, index: torch.Tensor,
                    scoring: str, normalize: bool) -> torch.Tensor:
    """``d_logits`` [T, E], contiguous, in the logits' dtype, for the weights' gradient
    ``d_weights`` [T, k] (any strides) and the forward's ``index``."""
    _check_bwd(d_weights, logits, index, scoring)
    return _bwd_impl(d_weights, logits, index, scoring, normalize)


@moe_routing_bwd.register_fake
def _(d_weights, logits, index, scoring, normalize):
    _check_bwd(d_weights, logits, index, scoring)
    return logits.new_empty(logits.shape)


def _setup(ctx, inputs, output):
    logits, _, scoring, normalize = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.mark_non_differentiable(*output[1:])
    ctx.scoring, ctx.normalize = scoring, normalize


def _backward(ctx, d_weights, *_):
    logits, index = ctx.saved_tensors
    if d_weights is None:  # the weights were not used
        return logits.new_zeros(logits.shape), None, None, None
    d_logits = torch.ops.custom_kernels.moe_routing_bwd(d_weights, logits, index, ctx.scoring,
                                                        ctx.normalize)
    return d_logits, None, None, None


torch.library.register_autograd("custom_kernels::moe_routing_fwd", _backward,
                                setup_context=_setup)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
          normalize: bool = True) -> Routing:
    """The routing of ``logits`` [T, E] to ``top_k`` experts a token (see the module docstring
    for the outputs, the rules and the gradient). Tensors off a CUDA device run
    ``route_reference`` (logged once)."""
    _check(logits, top_k, scoring, "moe_routing", strides=True)
    if fallback.off_cuda({"logits": logits}, "moe_routing", "route_reference"):
        return route_reference(logits, top_k, scoring=scoring, normalize=normalize)
    return _route(logits, top_k, scoring, bool(normalize))


def _route(logits, top_k: int, scoring: str, normalize: bool) -> Routing:
    """Under torch.compile (and export), the custom op: the graph sees it with its fake impl.
    Eagerly, the same kernels without torch's Python custom-op dispatch: directly when no
    gradient is needed, else through an autograd.Function whose backward launches the backward
    kernel."""
    if torch.compiler.is_compiling() or not plain_eager(logits):
        return Routing(*torch.ops.custom_kernels.moe_routing_fwd(logits, top_k, scoring,
                                                                 normalize))
    if torch.is_grad_enabled() and logits.requires_grad:
        return Routing(*_EagerRouting.apply(logits, top_k, scoring, normalize))
    return _fwd_impl(logits, top_k, scoring, normalize)


class _EagerRouting(torch.autograd.Function):
    """Eager autograd, calling the launchers directly."""

    @staticmethod
    def forward(ctx, logits, top_k, scoring, normalize):
        out = _fwd_impl(logits, top_k, scoring, normalize)
        ctx.save_for_backward(logits, out.index)
        ctx.mark_non_differentiable(*out[1:])
        ctx.scoring, ctx.normalize = scoring, normalize
        return tuple(out)

    @staticmethod
    def backward(ctx, d_weights, *_):
        logits, index = ctx.saved_tensors
        return _bwd_impl(d_weights, logits, index, ctx.scoring, ctx.normalize), None, None, None


def _check(logits, top_k, scoring, entry: str, strides: bool) -> None:
    """The rules the ops share with the public function, on every device (the ops copy a
    strided last dimension instead of refusing it: ``strides=False``)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        got = (f"shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
               else type(logits).__name__)
        raise UnsupportedInputError(f"{entry}: logits must be a 2-D torch.Tensor [T, E], got "
                                    f"{got}")
    if logits.dtype not in DTYPE_CODES:
        raise UnsupportedInputError(f"{entry}: logits must be float32, float16 or bfloat16, "
                                    f"not {logits.dtype}")
    tokens, experts = logits.shape
    if strides and experts > 1 and logits.stride(1) != 1:
        raise UnsupportedInputError(
            f"{entry}: logits has a non-contiguous last dimension (stride {logits.stride(1)}); "
            f"call .contiguous() first")
    if not 1 <= experts <= MAX_EXPERTS:
        raise UnsupportedInputError(f"{entry}: the number of experts E (logits' last "
                                    f"dimension) must be 1 to {MAX_EXPERTS}, got {experts}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, torch.SymInt)) or \
            not 1 <= top_k <= min(experts, MAX_TOP_K):
        raise UnsupportedInputError(f"{entry}: top_k must be an int from 1 to min(E, "
                                    f"{MAX_TOP_K}) = {min(experts, MAX_TOP_K)}, got {top_k!r}")
    if tokens * top_k > MAX_PAIRS:
        raise UnsupportedInputError(f"{entry}: T * k = {tokens * top_k} pairs exceed the int32 "
                                    f"rows (at most {MAX_PAIRS})")
    if scoring not in SCORINGS:
        raise UnsupportedInputError(f"{entry}: scoring must be one of {', '.join(SCORINGS)}, "
                                    f"got {scoring!r}")


def _check_bwd(d_weights, logits, index, scoring) -> None:
    entry = "custom_kernels::moe_routing_bwd"
    top_k = index.shape[-1] if isinstance(index, torch.Tensor) and index.dim() == 2 else 0
    _check(logits, max(top_k, 1), scoring, entry, strides=False)
    want = (logits.shape[0], top_k)
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or \
            tuple(index.shape) != want or top_k < 1:
        raise UnsupportedInputError(f"{entry}: index must be the forward's int64 [T, k] "
                                    f"tensor for logits [T, E] = {tuple(logits.shape)}")
    if not isinstance(d_weights, torch.Tensor) or tuple(d_weights.shape) != want or \
            d_weights.dtype != logits.dtype:
        raise UnsupportedInputError(
            f"{entry}: d_weights must be a {logits.dtype} tensor of shape {want} (T, k), got "
            f"{getattr(d_weights, 'dtype', type(d_weights).__name__)} "
            f"{tuple(getattr(d_weights, 'shape', ()))}")


# ---------------------------------------------------------------------------------------------
# The reference (and the fallback off CUDA)
# ---------------------------------------------------------------------------------------------

def route_reference(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                    normalize: bool = True) -> Routing:
    """``route`` in torch ops, on any device, with autograd on ``weights``: scores in float32
    (float64 logits stay float64, for gradcheck), a stable descending sort for the top-k (ties
    to the lower index), the normalization, one rounding; the pairs sorted with a stable argsort,
    the offsets a cumulative sum of counts made with a scatter (no host sync on a GPU)."""
    if scoring not in SCORINGS:
        raise UnsupportedInputError(f"route_reference: scoring must be one of "
                                    f"{', '.join(SCORINGS)}, got {scoring!r}")
    tokens, experts = logits.shape
    compute = torch.promote_types(logits.dtype, torch.float32)
    scores = (torch.softmax(logits.to(compute), dim=-1) if scoring == "softmax"
              else torch.sigmoid(logits.to(compute)))
    values, index = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, index = values[:, :top_k].contiguous(), index[:, :top_k].contiguous()
    if normalize:
        values = values / values.sum(-1, keepdim=True)
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=logits.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    inverse = torch.empty_like(flat)
    inverse[order] = torch.arange(flat.numel(), device=logits.device)
    return Routing(values.to(logits.dtype), index, (order // top_k).to(torch.int32),
                   counts.cumsum(0).to(torch.int32), inverse.view(tokens, top_k).to(torch.int32))


__all__ = ["Routing", "route", "route_reference", "compile_moe_routing", "MAX_EXPERTS",
           "MAX_TOP_K"]
