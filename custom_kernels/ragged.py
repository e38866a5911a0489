"""Per-segment sum and mean of ragged rows (``csrc/ragged.cu``), load-balanced by the work queue.

``values`` packs S variable-length segments end to end (as packed sequences do): segment ``s`` is
rows ``offsets[s]:offsets[s + 1]`` of ``values`` (shape ``[total, ...]``, fp32 / fp16 / bf16),
``offsets`` an int32 or int64 tensor of ``S + 1`` nondecreasing row indices on the same device
(``offsets[0] = 0`` and ``offsets[-1] = total`` for the usual cumulative lengths; rows outside
every segment are ignored). ``segment_sum(values, offsets)`` returns ``[S, ...]`` in ``values``'s
dtype, accumulated in fp32; ``segment_mean`` divides by the segment's length. Empty segments give
zeros (for the mean too). It is ``torch.segment_reduce(values, "sum", offsets=offsets)`` in one
launch whose cost does not depend on how skewed the lengths are: the rows are cut into equal
chunks that the queue hands out, a segment longer than a chunk is combined with fp32 atomics,
and its last piece writes it out (see the .cu file). No host sync; the offsets are never read on
the host, and out-of-range offsets are clamped on the device (never out of bounds), but
decreasing offsets give meaningless sums: they are not checked.

CUDA graphs: run once before capturing (the queue counters are allocated on first use); the
fp32 accumulator ``[S, D]``, which eager calls keep per stream and the kernel leaves zeroed,
is a graph buffer zeroed by a captured memset there.

Read top-down: the launcher, the compile function, the public functions, then the baselines of
``benchmarks/reductions.py`` (one launch per segment; padding to the longest segment) and the
float64 reference.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from custom_kernels.core import elements
from custom_kernels import jit, work_queue
from custom_kernels.cooperative import max_cooperative_grid
from custom_kernels.core import fallback
from custom_kernels.core.errors import UnsupportedInputError

SOURCE = "ragged.cu"
KERNEL = "ragged_segment_reduce"
BLOCK = 256
WARPS = BLOCK // 32
DTYPE_CODES = elements.float_codes()
# Tickets per block the queue aims at (balance) and the clamp of the rows per warp chunk (a
# segment longer than a chunk is combined with atomics: fewer, longer chunks mean fewer).
TICKETS_PER_BLOCK = 4
MIN_ROWS, MAX_ROWS = 16, 4096


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def _defines(dtype_code: int, offset_bits: int, vec: bool) -> dict:
    return {"DTYPE": dtype_code, "OFFSET_BITS": offset_bits, "VEC": int(vec), "BLOCK": BLOCK}


def columns_per_tile(dtype: torch.dtype) -> int:
    """32 lanes x 16 bytes."""
    return 128 if dtype == torch.float32 else 256


def chunk_rows(rows: int, tiles: int, grid: int) -> int:
    """Rows per warp chunk: about TICKETS_PER_BLOCK tickets (of WARPS chunks) per block."""
    target = rows * tiles / (WARPS * TICKETS_PER_BLOCK * max(grid, 1))
    return int(min(MAX_ROWS, max(MIN_ROWS, 4 * math.ceil(target / 4))))


def _launch(values2, offsets, out, mean: bool) -> None:
    rows, d = values2.shape
    segments = offsets.numel() - 1
    device = values2.device.index
    vpt = 16 // values2.element_size()
    vec = d % vpt == 0 and values2.stride(0) % vpt == 0 and values2.data_ptr() % 16 == 0
    kernel = jit.get_kernel(SOURCE, KERNEL, device=device, defines=_defines(
        DTYPE_CODES[values2.dtype], 32 if offsets.dtype == torch.int32 else 64, vec))
    grid = max_cooperative_grid(kernel, BLOCK, 0, device)
    tiles = -(-d // columns_per_tile(values2.dtype))
    chunk = chunk_rows(rows, tiles, grid)
    row_tickets = -(-(-(-rows // chunk)) // WARPS) * tiles
    fill_tickets = -(-segments // BLOCK)
    acc, count = _scratch(segments, d, device)
    work_queue.launch_persistent(
        kernel, values2, offsets, out, acc, count, work_queue.counters(device), rows,
        values2.stride(0), d, segments, chunk, tiles, int(mean), row_tickets, fill_tickets,
        tasks=row_tickets + fill_tickets, block=BLOCK, device=device)


def _scratch(segments: int, d: int, device: int):
    """The fp32 accumulator [S, D] and the arrival counts [S], zero at launch. Eagerly: this
    stream's buffer, which the kernel leaves zeroed (no memset). In graph capture: a buffer of
    the graph, zeroed by a captured memset at every replay (the warm-up usually ran on another
    stream, and nothing can be allocated outside the graph while capturing)."""
    numel = segments * d + segments
    if torch.cuda.is_current_stream_capturing():
        buf = torch.zeros(numel, dtype=torch.int32, device=f"cuda:{device}")
    else:
        buf = work_queue.zeroed_scratch("ragged", numel, torch.int32, device)
    return buf[:segments * d].view(torch.float32), buf[segments * d:numel]


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def compile_ragged(dtype: str = "bfloat16", offset_bits: int = 64, vec: bool = True,
                   arch: str = jit.DEFAULT_ARCH) -> Path:
    code = elements.element(dtype).code
    return jit.compile_cubin(SOURCE, defines=_defines(code, offset_bits, vec),
                             name_expressions=(KERNEL,), arch=arch)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------

def _check(values: torch.Tensor, offsets: torch.Tensor) -> None:
    """The input rules, on any device (the device rule comes after them)."""
    if values.dtype not in DTYPE_CODES:
        raise UnsupportedInputError(f"values must be float32, float16 or bfloat16, not "
                                    f"{values.dtype}")
    if values.dim() < 1:
        raise UnsupportedInputError("values must have a row dimension: [total, ...]")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise UnsupportedInputError(f"offsets must be int32 or int64, not {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise UnsupportedInputError(f"offsets must be 1-D with S + 1 >= 1 entries, got shape "
                                    f"{tuple(offsets.shape)}")


def segment_sum(values: torch.Tensor, offsets: torch.Tensor, *, mean: bool = False
                ) -> torch.Tensor:
    """``out[s] = values[offsets[s]:offsets[s + 1]].sum(0)`` (or ``.mean(0)``, 0 when empty) for
    every segment, shape ``[S, *values.shape[1:]]``; see the module docstring. Tensors off a
    CUDA device run ``torch_segment_sum`` (the CPU rule, ``custom_kernels.core.fallback``)."""
    _check(values, offsets)
    if values.device != offsets.device or not values.is_cuda:
        if fallback.off_cuda({"values": values, "offsets": offsets}, "segment_sum",
                             "torch_segment_sum"):
            return torch_segment_sum(values, offsets, mean)
    segments = offsets.numel() - 1
    tail = values.shape[1:]
    rows, d = values.shape[0], math.prod(tail)
    if segments == 0 or d == 0 or rows == 0:
        return values.new_zeros((segments, *tail))
    values2 = values.reshape(rows, d)
    if values2.stride(1) != 1:
        values2 = values2.contiguous()
    offsets = offsets.contiguous()
    out = torch.empty((segments, d), dtype=values.dtype, device=values.device)
    _launch(values2, offsets, out, mean)
    return out.reshape(segments, *tail)


def segment_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return segment_sum(values, offsets, mean=True)


# ---------------------------------------------------------------------------------------------
# Torch fallback, baselines (benchmarks/reductions.py) and the float64 reference
# ---------------------------------------------------------------------------------------------

def torch_segment_sum(values: torch.Tensor, offsets: torch.Tensor, mean: bool = False
                      ) -> torch.Tensor:
    """``segment_sum`` in torch, for tensors off a CUDA device: the same result (values's dtype,
    accumulated in fp32, offsets clamped to the rows, empty segments 0) without a kernel."""
    rows, segments = values.shape[0], offsets.numel() - 1
    bounds = offsets.long().clamp(0, rows)
    lo, hi = bounds[:-1], torch.maximum(bounds[1:], bounds[:-1])
    row = torch.arange(rows, device=values.device)
    # With nondecreasing offsets a row belongs to at most one segment: the last that starts at
    # or before it, if the row comes before that segment's end.
    segment = torch.searchsorted(lo, row, right=True) - 1
    inside = (segment >= 0) & (row < hi[segment.clamp(min=0)]) if segments else \
        torch.zeros(rows, dtype=torch.bool, device=values.device)
    out = torch.zeros((segments, *values.shape[1:]), dtype=torch.float32, device=values.device)
    out.index_add_(0, segment[inside], values[inside].float())
    if mean:
        lengths = (hi - lo).clamp(min=1).to(torch.float32)
        out /= lengths.view(-1, *([1] * (values.dim() - 1)))
    return out.to(values.dtype)


def segment_sum_loop(values: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """One reduction launch per segment; ``bounds`` are the offsets as Python ints."""
    out = values.new_empty((len(bounds) - 1, *values.shape[1:]))
    for s in range(len(bounds) - 1):
        torch.sum(values[bounds[s]:bounds[s + 1]], dim=0, out=out[s])
    return out


def padding_index(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(segment of each row, its position in the segment, longest length) for the padded
    baseline; computed once, outside the timed region (a data loader would provide them)."""
    lengths = offsets.diff().long()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device),
                                      lengths, output_size=rows)
    position = torch.arange(rows, device=offsets.device) - offsets[:-1].long()[segment]
    return segment, position, int(lengths.max()) if lengths.numel() else 0


def segment_sum_padded(values: torch.Tensor, segment: torch.Tensor, position: torch.Tensor,
                       longest: int, segments: int) -> torch.Tensor:
    """Pad every segment to the longest one ([S, longest, ...] of zeros), then reduce."""
    padded = values.new_zeros((segments, longest, *values.shape[1:]))
    padded[segment, position] = values
    return padded.sum(dim=1)


def reference_segment_sum(values: torch.Tensor, offsets: torch.Tensor, mean: bool = False
                          ) -> torch.Tensor:
    """float64, on values's device."""
    bounds = offsets.tolist()
    rows = values.shape[0]
    out = torch.zeros((len(bounds) - 1, *values.shape[1:]), dtype=torch.float64,
                      device=values.device)
    for s in range(len(bounds) - 1):
        lo, hi = max(0, min(bounds[s], rows)), max(0, min(bounds[s + 1], rows))
        if hi > lo:
            out[s] = values[lo:hi].double().sum(0)
            if mean:
                out[s] /= hi - lo
    return out
