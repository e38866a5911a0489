"""FP8 quantization with dynamic (current) scaling and no host sync: a tensor, or its transpose, to
e4m3 / e5m2 with the scales ``cutlass_ops.scaled_mm`` (``torch._scaled_mm``) takes.

``q, scale = quantize(x, granularity, fp8_dtype=torch.float8_e4m3fn, transpose=False)`` for a
2-D ``x`` (R, C) in bf16, fp16 or fp32 with a unit last stride (any row stride). The quantized
matrix is ``m = x`` (``transpose=True``: ``m = x.t()``, (C, R), read from ``x`` in place, never
copied to a contiguous transpose). ``granularity`` (``Granularity``, or its string) says which
elements share a scale, and the scale's layout:

- ``"tensor"``: all of ``m``; ``scale`` shape ``()``.
- ``"row"``: each row of ``m``; ``scale`` (rows, 1) (``scaled_mm``'s rowwise ``scale_a``; for a
  weight (N, K), ``scale.t()`` is its ``scale_b``).
- ``"block_1x128"``: each row's 128-column chunks; ``m``'s columns a multiple of 128; ``scale``
  (rows, cols / 128) column-major (stride (1, rows)): blockwise ``scale_a`` as it is.
- ``"block_128x128"``: 128x128 blocks; both extents multiples of 128; ``scale`` (rows / 128,
  cols / 128) row-major: a weight (N, K)'s scales, whose ``.t()`` is blockwise ``scale_b``.

``q`` is (rows, cols) row-major contiguous in ``fp8_dtype`` (``float8_e4m3fn``, largest 448, or
``float8_e5m2``, 57344). The rule, in float32 (bf16 and fp16 values widen exactly):
``amax`` = the largest ``|m|`` of the group; ``inv = fp8_max / amax`` (IEEE division, once a
group), 1.0 where amax is 0 (an all-zero group, an empty one), the largest float32 where the
quotient overflows (amax below about 1e-36); ``q = fp8(clamp(m * inv, -fp8_max, fp8_max))``
(one rounded product, then torch's round-to-nearest-even cast); ``scale = 1 / inv`` (IEEE), the
dequantization multiplier, ``m ~= q.float() * scale``, float32. (torchao's rule; a product an
element, not a quotient, keeps the kernels at memory speed.) Non-finite input does not crash: a
NaN makes its group's amax, inv and scale NaN and every q of the group NaN; an infinity makes
inv 0 and the scale inf, the group's finite values quantize to 0 and the infinity to NaN.

``quantize_pair(x, granularity, fp8_dtype=...)`` returns ``((q, scale), (qt, scale_t))``, the
quantization of ``x`` and of ``x.t()`` (the backward's K-major operands), both orientations'
divisibility rules applied; see its docstring for which granularities read ``x`` once.

Refused on every device with UnsupportedInputError naming the rule: ``x`` not a 2-D tensor, a
dtype other than bf16 / fp16 / fp32, a last dimension that is not contiguous, an unknown
granularity, extents the granularity cannot divide, an ``fp8_dtype`` other than the two above.
Empty input gives empty outputs with scales of ones.

Where it runs: tensors off a CUDA device run ``torch_quantize`` (the CPU rule,
``custom_kernels.core.fallback``; it is also the reference the GPU tests compare the kernels
with, bit for bit). On a GPU, the kernels of ``csrc/fp8_quant.cu`` (NVRTC, compiled and loaded on
first use) on torch's current stream with memory from torch's allocator: eagerly without
torch's custom-op dispatch, under ``torch.compile(fullgraph=True)`` through the custom ops
``custom_kernels::fp8_quantize`` / ``fp8_quantize_pair`` and their fakes. Nothing is read back
to the host (amaxes and scales stay on the device), so a call can be captured in a CUDA graph
(run it once before capturing) and replayed on new data, its scales recomputed. What runs:

- ``row``, ``block_1x128``: one kernel, one read of ``x``: a team of threads a row (or a row's
  128-column chunk) holds its values in registers (rows up to 2048 16-byte slots: 16384 bf16 or
  8192 fp32 values; longer rows re-read the rest), reduces the amax, writes scale and ``q``.
- ``tensor``: an amax kernel (atomicMax on the float bits of ``|x|`` into a zeroed device
  word), then the quantize kernel reading it: two reads of ``x`` (one, given ``amax``).
- ``tensor`` and ``block_128x128`` with 16-byte loads (one scale covers a 128x128 tile), q, qt
  or both: a tile a block, each value quantized once from registers; q is stored from them, qt
  as q's FP8 bytes transposed in shared memory (``fp8_quant_tiles_once_kernel``).
- ``transpose=True`` otherwise (and the other inputs of ``block_128x128``): a 128x128 tile of
  ``x`` a block, read once into shared memory with coalesced 16-byte loads, written as ``q``
  rows or ``qt`` rows (each lane a tile column: coalesced reads of shared memory, 16-byte
  stores along ``qt``'s rows). The transposed ``row`` and ``tensor`` granularities run the amax
  kernel first (each column's amax, or the tensor's); ``block_1x128`` and ``block_128x128``
  reduce inside the tile.

Loads are 16 bytes wide when ``C``, the row stride and the pointer allow, else one element an
access. The kernels index in 64 bits: no int32 limit applies to ``R``, ``C`` or the row stride.
Nothing is differentiable here: the outputs carry no gradient.

Read top-down: the launcher, the compile function, the custom ops, the public functions and
their checks, then the torch reference.
"""

from __future__ import annotations

import enum
import functools
from pathlib import Path

import torch

from custom_kernels import jit
from custom_kernels.core import elements
from custom_kernels.core import fallback
from custom_kernels.core.eager import plain_eager
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.launch import launch, set_max_dynamic_shared

SOURCE = "fp8_quant.cu"
AMAX_KERNEL, ROWS_KERNEL, TILES_KERNEL, ONCE_KERNEL = (
    "fp8_amax_kernel", "fp8_quant_rows_kernel", "fp8_quant_tiles_kernel",
    "fp8_quant_tiles_once_kernel")
DTYPE_CODES = elements.float_codes()
BLOCK_K = 128  # the extent of a block's side (block_1x128, block_128x128), the kernels' tile
BLOCK = 256  # threads of the amax and rows kernels
TILE_THREADS = 256  # threads of the tile kernel (the .cu file's TILE_THREADS)
NV = 8  # slots (16 bytes each) a thread of the rows kernel keeps in registers
MAX_GRID = 1 << 20  # blocks of a 1-D grid; the kernels loop past it
MAX_GRID_Y = 65535
AMAX_BLOCKS = 2048  # about how many blocks the amax kernel spreads a tensor over
AMAX_ALL, AMAX_ROWS, AMAX_COLS = 1, 2, 4  # which amaxes fp8_amax_kernel computes (bits of AMAX)


class Granularity(str, enum.Enum):
    """Which elements share one scale (see the module docstring for the scales' layouts)."""

    TENSOR = "tensor"
    ROW = "row"
    BLOCK_1X128 = "block_1x128"
    BLOCK_128X128 = "block_128x128"


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 type (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(fp8_dtype).max)


def scale_shape(granularity: Granularity, rows: int, cols: int) -> tuple[int, ...]:
    """The scale's shape for a quantized matrix (rows, cols)."""
    return {Granularity.TENSOR: (), Granularity.ROW: (rows, 1),
            Granularity.BLOCK_1X128: (rows, cols // BLOCK_K),
            Granularity.BLOCK_128X128: (rows // BLOCK_K, cols // BLOCK_K)}[granularity]


def empty_scale(granularity: Granularity, rows: int, cols: int, device) -> torch.Tensor:
    """An uninitialised float32 scale in its layout: block_1x128's is column-major."""
    shape = scale_shape(granularity, rows, cols)
    if granularity is Granularity.BLOCK_1X128:
        return torch.empty(shape[::-1], dtype=torch.float32, device=device).t()
    return torch.empty(shape, dtype=torch.float32, device=device)


# Granularities with one scale for a whole 128x128 tile (the tensor's, the block's): with
# 16-byte loads they run fp8_quant_tiles_once_kernel, which quantizes each value once and
# writes qt as q's bytes transposed (docs/measurements.md, "FP8 GEMMs").
ONCE_GRANULARITIES = (Granularity.TENSOR, Granularity.BLOCK_128X128)

# The granularity's code in csrc/fp8_quant.cu (its MODE).
MODE_CODES = {Granularity.TENSOR: 0, Granularity.ROW: 1, Granularity.BLOCK_1X128: 2,
              Granularity.BLOCK_128X128: 3}


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def slot_elements(itemsize: int) -> int:
    """Elements of a slot, the kernels' unit of access: 16 bytes of x."""
    return 16 // itemsize


def _defines(kernel: str, dtype_code: int, fp8_code: int, vec: bool, mode: int = 0,
             amax: int = 0, write_q: bool = True, write_qt: bool = False) -> dict:
    """The kernel's -D values (only those it reads, so that its cubins are not duplicated)."""
    top = fp8_max(elements.from_code(fp8_code).torch_dtype)
    defines = {"DTYPE": dtype_code, "VEC": int(vec), "BLOCK": BLOCK}
    if kernel == AMAX_KERNEL:
        defines["AMAX"] = amax
        return defines
    defines.update(FP8=fp8_code, FP8_MAX=f"{top:.1f}f")
    if kernel == ROWS_KERNEL:
        defines.update(MODE=mode, NV=NV)
    else:
        defines.update(MODE=mode, WRITE_Q=int(write_q), WRITE_QT=int(write_qt))
    return defines


def vector_ok(itemsize: int, cols: int, row_stride: int, pointer: int) -> bool:
    """16-byte loads of x (and EPT-byte stores of q): the columns and the row stride multiples of
    a slot, the pointer of 16 bytes. Otherwise one element an access."""
    ept = slot_elements(itemsize)
    return cols % ept == 0 and row_stride % ept == 0 and pointer % 16 == 0


def rows_team(g: Granularity, itemsize: int, cols: int) -> int:
    """log2 of the rows kernel's team (threads a group): a 128-column chunk takes one slot a
    thread; a row the smallest power of two of threads covering its slots, at most BLOCK (each
    then keeps up to NV slots in registers; longer rows are read again past that)."""
    ept = slot_elements(itemsize)
    slots = BLOCK_K // ept if g is Granularity.BLOCK_1X128 else -(-cols // ept)
    return (min(BLOCK, 1 << max(slots - 1, 0).bit_length())).bit_length() - 1


@functools.lru_cache(maxsize=None)
def _kernel(kernel: str, device: int, *key):
    """The loaded kernel for ``_defines(kernel, *key)``; the tile kernel may take its whole
    tile of shared memory (64 KB for float32)."""
    loaded = jit.get_kernel(SOURCE, kernel, device=device, defines=_defines(kernel, *key))
    if kernel == TILES_KERNEL:
        set_max_dynamic_shared(loaded, BLOCK_K * BLOCK_K * 4, device)
    return loaded


class _QuantPlan:
    """What the kernels of one call signature need besides the tensors (``_plan``): derived once
    from x's shape, strides, dtype, device and alignment, the granularity, the FP8 type and the
    outputs asked for, then reused by every call of that signature (``_KNOWN``)."""

    __slots__ = ("g", "fp8_dtype", "device", "want_q", "want_qt", "amax", "rows_kernel",
                 "once", "kernel", "grid", "shared", "group_cols", "shift")

    def outputs(self, x):
        """The empty (q, scale) and (qt, scale_t) asked for (None where not)."""
        rows, cols = x.shape
        out = []
        for wanted, (r, c) in ((self.want_q, (rows, cols)), (self.want_qt, (cols, rows))):
            out.append(_empty_outputs_of(r, c, self.g, self.fp8_dtype, x.device) if wanted
                       else (None, None))
        return out

    def execute(self, x, q, scale, qt, scale_t, amax=None) -> None:
        """``amax``: the tensor's amax (float32 on the device) when the plan was made for one
        given (no amax kernel then)."""
        rows, cols = x.shape
        device = self.device
        pointers = (amax.data_ptr() if amax is not None else 0, 0, 0)
        buffer = None  # lives until the launches below are queued (stream-ordered allocator)
        if self.amax is not None:
            buffer, pointers = _launch_amax(x, self.amax)
        if self.rows_kernel:
            launch(self.kernel, x.data_ptr(), q.data_ptr(), scale.data_ptr(), pointers[0], rows,
                   cols, x.stride(0), self.group_cols, self.shift, grid=self.grid, block=BLOCK,
                   device=device)
        elif self.once:
            launch(self.kernel, x.data_ptr(), *(t.data_ptr() if t is not None else 0
                                                 for t in (q, qt, scale, scale_t)),
                   pointers[0], rows, cols, x.stride(0), grid=self.grid, block=TILE_THREADS,
                   device=device)
        else:
            launch(self.kernel, x.data_ptr(), *(t.data_ptr() if t is not None else 0
                                                 for t in (q, qt, scale, scale_t)),
                   *pointers, rows, cols, x.stride(0), grid=self.grid, block=TILE_THREADS,
                   shared_mem=self.shared, device=device)
        del buffer


def _plan(x, g: Granularity, fp8_dtype, want_q: bool, want_qt: bool,
          given_amax: bool = False) -> _QuantPlan:
    """The plan of a call on x (CUDA, 2-D, unit last stride, not empty): the once kernel for
    the granularities with one scale a tile (``ONCE_GRANULARITIES``, 16-byte loads), else the
    rows kernel for q alone (tensor, row, block_1x128) and the tile kernel otherwise; after the
    amax kernel for what no block sees whole (the tensor's amax unless ``given_amax``; each column's, and each row's
    for the pair, at row granularity)."""
    rows, cols = x.shape
    vec = vector_ok(x.element_size(), cols, x.stride(0) if rows > 1 else 0, x.data_ptr())
    dtype_code, device = DTYPE_CODES[x.dtype], x.device.index
    fp8_code = elements.element(fp8_dtype).code
    plan = _QuantPlan()
    plan.g, plan.fp8_dtype, plan.device = g, fp8_dtype, device
    plan.want_q, plan.want_qt = want_q, want_qt
    flags = AMAX_ALL if g is Granularity.TENSOR and not given_amax else 0
    if g is Granularity.ROW and want_qt:
        flags = AMAX_COLS | (AMAX_ROWS if want_q else 0)
    plan.amax = _amax_plan(x, flags, vec, dtype_code, fp8_code) if flags else None
    mode = MODE_CODES[g]
    plan.once = vec and g in ONCE_GRANULARITIES
    plan.rows_kernel = not plan.once and not want_qt and g is not Granularity.BLOCK_128X128
    if plan.once:
        plan.kernel = _kernel(ONCE_KERNEL, device, dtype_code, fp8_code, vec, mode, 0, want_q,
                              want_qt)
        plan.grid = min(-(-rows // BLOCK_K) * -(-cols // BLOCK_K), MAX_GRID)
        plan.shared = plan.group_cols = plan.shift = 0
    elif plan.rows_kernel:
        plan.shift = rows_team(g, x.element_size(), cols)
        plan.group_cols = BLOCK_K if g is Granularity.BLOCK_1X128 else cols
        teams = BLOCK >> plan.shift
        plan.grid = min(-(-rows * (cols // plan.group_cols) // teams), MAX_GRID)
        plan.kernel = _kernel(ROWS_KERNEL, device, dtype_code, fp8_code, vec, mode)
        plan.shared = 0
    else:
        plan.kernel = _kernel(TILES_KERNEL, device, dtype_code, fp8_code, vec, mode, 0, want_q,
                              want_qt)
        plan.grid = min(-(-rows // BLOCK_K) * -(-cols // BLOCK_K), MAX_GRID)
        plan.shared = BLOCK_K * BLOCK_K * x.element_size()
        plan.group_cols = plan.shift = 0
    return plan


def _amax_plan(x, flags: int, vec: bool, dtype_code: int, fp8_code: int):
    """(kernel, buffer sizes (the tensor's amax, each row's, each column's; 0 where not asked
    for), their offsets in bytes, rows a block, grid) of the amax kernel: the |x| bits reduced
    with atomicMax into a zeroed buffer, all on the device."""
    rows, cols = x.shape
    sizes = (1 if flags & AMAX_ALL else 0, rows if flags & AMAX_ROWS else 0,
             cols if flags & AMAX_COLS else 0)
    offsets = tuple(4 * sum(sizes[:i]) for i in range(3))
    grid_x = -(-cols // (slot_elements(x.element_size()) * BLOCK))
    rows_per_block = max(16, -(-rows * grid_x // AMAX_BLOCKS))
    grid_y = min(-(-rows // rows_per_block), MAX_GRID_Y)
    kernel = _kernel(AMAX_KERNEL, x.device.index, dtype_code, fp8_code, vec, 0, flags)
    return kernel, sizes, offsets, rows_per_block, (grid_x, grid_y)


def _launch_amax(x, amax_plan):
    """(buffer, pointers into it: the tensor's amax, each row's, each column's; 0 where not
    asked for): ``_amax_plan``'s kernel run into a zeroed buffer."""
    kernel, sizes, offsets, rows_per_block, grid = amax_plan
    buffer = torch.zeros(sum(sizes), dtype=torch.int32, device=x.device)
    base = buffer.data_ptr()
    pointers = tuple(base + o if n else 0 for n, o in zip(sizes, offsets))
    launch(kernel, x.data_ptr(), *pointers, *x.shape, x.stride(0), rows_per_block, grid=grid,
           block=BLOCK, device=x.device.index)
    return buffer, pointers


# Known call signatures: an eager call on a plain CUDA tensor whose signature (shape, strides,
# dtype, device, 16-byte alignment, granularity, FP8 type, outputs) passed the checks before
# needs none now, and its plan is kept: the call allocates and launches (about half of a call's
# host time otherwise: docs/measurements.md). Bounded by the shapes a program quantizes.
_KNOWN: dict = {}


def _signature(x, granularity, fp8_dtype, which: str):
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, granularity, fp8_dtype,
            which)


def _known(x, granularity, fp8_dtype, which: str):
    """The plan of a call seen before, when this call may take the direct path; else None."""
    if type(x) is not torch.Tensor or not x.is_cuda or torch.compiler.is_compiling() or \
            not plain_eager(x):
        return None
    return _KNOWN.get(_signature(x, granularity, fp8_dtype, which))


def _run(x, g: Granularity, fp8_code: int, q, scale, qt, scale_t) -> None:
    """Fills q / scale (the quantization of x) and qt / scale_t (of x.t()), either pair None
    (``_plan``). x: CUDA, 2-D, unit last stride, not empty."""
    fp8_dtype = elements.from_code(fp8_code).torch_dtype
    _plan(x, g, fp8_dtype, q is not None, qt is not None).execute(x, q, scale, qt, scale_t)


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def compile_fp8_quant(kernel: str = ROWS_KERNEL, dtype: str = "bfloat16", fp8: str = "e4m3",
                      vec: bool = True, granularity: str = "row", *, amax: int = AMAX_ALL,
                      write_q: bool = True, write_qt: bool = False,
                      arch: str = jit.DEFAULT_ARCH) -> Path:
    """The cubin of one of the four kernels (``AMAX_KERNEL``, ``ROWS_KERNEL``,
    ``TILES_KERNEL``, ``ONCE_KERNEL``) for an input dtype, an FP8 type, 16-byte accesses or not, a granularity
    (rows and tile kernels), the amaxes asked for (amax kernel) and the outputs written (tile
    kernel). No extent is compiled in."""
    key = (elements.element(dtype).code, elements.element(fp8).code, vec,
           MODE_CODES[Granularity(granularity)], amax, write_q, write_qt)
    return jit.compile_cubin(SOURCE, defines=_defines(kernel, *key), name_expressions=(kernel,),
                             arch=arch)


# ---------------------------------------------------------------------------------------------
# Custom ops: real impl and fake impl next to each other (no autograd: FP8 carries no gradient)
# ---------------------------------------------------------------------------------------------

def _quantize_impl(x, g: Granularity, fp8_dtype, transpose: bool, key=None, amax=None):
    """The kernels on a CUDA device; elsewhere (the op called with CPU tensors) the reference.
    ``key``: the call's signature, to keep its plan under (an eager call that passed the
    checks); ``amax``: the tensor's, given."""
    if not x.is_cuda:
        return torch_quantize(x, g, fp8_dtype=fp8_dtype, transpose=transpose, amax=amax)
    q, scale = _empty_outputs(x, g, fp8_dtype, transpose)
    if x.numel() == 0:
        return q, scale.fill_(1.0)
    plan = _plan(x, g, fp8_dtype, not transpose, transpose, amax is not None)
    if key is not None:
        _KNOWN[key] = plan
    plan.execute(x, *((None, None, q, scale) if transpose else (q, scale, None, None)),
                 amax=amax)
    return q, scale


def _pair_impl(x, g: Granularity, fp8_dtype, key=None, amax=None):
    if not x.is_cuda:
        return (torch_quantize(x, g, fp8_dtype=fp8_dtype, amax=amax),
                torch_quantize(x, g, fp8_dtype=fp8_dtype, transpose=True, amax=amax))
    (q, scale), (qt, scale_t) = (_empty_outputs(x, g, fp8_dtype, False),
                                 _empty_outputs(x, g, fp8_dtype, True))
    if x.numel() == 0:
        return (q, scale.fill_(1.0)), (qt, scale_t.fill_(1.0))
    plan = _plan(x, g, fp8_dtype, True, True, amax is not None)
    if key is not None:
        _KNOWN[key] = plan
    plan.execute(x, q, scale, qt, scale_t, amax=amax)
    return (q, scale), (qt, scale_t)


@torch.library.custom_op("custom_kernels::fp8_quantize", mutates_args=())
def fp8_quantize(x: torch.Tensor, granularity: str, fp8_dtype: torch.dtype,
                 transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of ``x`` (``transpose``: of ``x.t()``); off a CUDA device, the torch
    reference."""
    g = _check(x, granularity, fp8_dtype, (transpose,), "custom_kernels::fp8_quantize")
    return _quantize_impl(x, g, fp8_dtype, transpose)


@fp8_quantize.register_fake
def _(x, granularity, fp8_dtype, transpose):
    g = _check(x, granularity, fp8_dtype, (transpose,), "custom_kernels::fp8_quantize")
    return _empty_outputs(x, g, fp8_dtype, transpose)


@torch.library.custom_op("custom_kernels::fp8_quantize_pair", mutates_args=())
def fp8_quantize_pair(x: torch.Tensor, granularity: str, fp8_dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, qt, scale_t) of ``x`` and ``x.t()``."""
    g = _check(x, granularity, fp8_dtype, (False, True), "custom_kernels::fp8_quantize_pair")
    (q, scale), (qt, scale_t) = _pair_impl(x, g, fp8_dtype)
    return q, scale, qt, scale_t


@fp8_quantize_pair.register_fake
def _(x, granularity, fp8_dtype):
    g = _check(x, granularity, fp8_dtype, (False, True), "custom_kernels::fp8_quantize_pair")
    return (*_empty_outputs(x, g, fp8_dtype, False), *_empty_outputs(x, g, fp8_dtype, True))


def _empty_outputs(x, g: Granularity, fp8_dtype, transpose: bool):
    rows, cols = x.shape[::-1] if transpose else x.shape
    return _empty_outputs_of(rows, cols, g, fp8_dtype, x.device)


def _empty_outputs_of(rows: int, cols: int, g: Granularity, fp8_dtype, device):
    return (torch.empty((rows, cols), dtype=fp8_dtype, device=device),
            empty_scale(g, rows, cols, device))


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------

def quantize(x: torch.Tensor, granularity, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
             transpose: bool = False, amax: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` (``transpose``: ``x.t()``) in ``fp8_dtype`` with the dequantization
    scales of ``granularity``; see the module docstring for the rule and the layouts. Tensors off
    a CUDA device run ``torch_quantize`` (logged once).

    ``amax`` (``"tensor"`` granularity only): x's amax as ``tensor_amax(x)`` returned it, from an
    earlier call on the same values (a weight's forward quantization, kept for its transpose in
    the backward): the kernels skip their amax pass over x. The result is what the call without
    it gives, as long as it is x's amax; under torch.compile it is not used (the op computes
    it)."""
    which = "qt" if transpose else "q"
    if amax is not None:
        which += "+amax"
        _check_amax(x, granularity, amax)
    plan = _known(x, granularity, fp8_dtype, which)
    if plan is not None and x.numel():
        q, scale = plan.outputs(x)[1 if transpose else 0]
        plan.execute(x, *((None, None, q, scale) if transpose else (q, scale, None, None)),
                     amax=amax)
        return q, scale
    g = _check(x, granularity, fp8_dtype, (transpose,), "quantize")
    if not x.is_cuda and fallback.off_cuda({"x": x}, "custom_kernels.fp8.fp8_quant.quantize",
                                           "torch_quantize"):
        return torch_quantize(x, g, fp8_dtype=fp8_dtype, transpose=transpose, amax=amax)
    if torch.compiler.is_compiling() or not plain_eager(x, amax):  # the op and its fake
        return torch.ops.custom_kernels.fp8_quantize(x, g.value, fp8_dtype, transpose)
    # eagerly: no custom-op dispatch (more host time than the launch), the signature's plan kept
    return _quantize_impl(x, g, fp8_dtype, transpose,
                          _signature(x, granularity, fp8_dtype, which), amax)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """x's amax (the largest |value|, NaN if any value is NaN) as a float32 scalar tensor on
    x's device, with no host sync: what ``quantize(x, "tensor")`` computes first, to hand to a
    later ``quantize(..., amax=)`` of the same values. x: as ``quantize`` takes it."""
    _check(x, Granularity.TENSOR, torch.float8_e4m3fn, (False,), "tensor_amax")
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if not x.is_cuda or torch.compiler.is_compiling() or not plain_eager(x):
        return x.detach().float().abs().amax()  # torch's amax propagates NaN
    vec = vector_ok(x.element_size(), x.shape[1], x.stride(0) if x.shape[0] > 1 else 0,
                    x.data_ptr())
    buffer, _ = _launch_amax(x, _amax_plan(x, AMAX_ALL, vec, DTYPE_CODES[x.dtype],
                                           elements.element("e4m3").code))
    return buffer.view(torch.float32)[0]  # |x|'s bits, largest first: the float itself


def _check_amax(x, granularity, amax) -> None:
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or amax.numel() != 1 \
            or not amax.is_contiguous():
        raise UnsupportedInputError("quantize: amax must be one float32 value as a tensor "
                                    "(tensor_amax(x)), got " + (
                                        f"{amax.dtype} {tuple(amax.shape)}" if isinstance(
                                            amax, torch.Tensor) else type(amax).__name__))
    if isinstance(x, torch.Tensor) and amax.device != x.device:
        raise UnsupportedInputError(f"quantize: amax is on {amax.device}, x on {x.device}")
    if _granularity(granularity, "quantize") is not Granularity.TENSOR:
        raise UnsupportedInputError(f"quantize: amax is the tensor's: it goes with granularity "
                                    f"'tensor', not {granularity!r}")


def quantize_pair(x: torch.Tensor, granularity, *,
                  fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                  amax: torch.Tensor | None = None):
    """``((q, scale), (qt, scale_t))`` = ``(quantize(x, g), quantize(x, g, transpose=True))``
    bit for bit, both orientations' extents checked (block_1x128 then needs R and C multiples
    of 128). On a GPU, one tile kernel writes both q and qt from one read of x: block_1x128 and
    block_128x128 reduce their amaxes inside each 128x128 tile (block_128x128's scale_t is then
    ``scale.t()``'s values); tensor and row granularity first run an amax kernel (one more read
    of x: the tensor's amax, or every row's and every column's at once), so two reads in all.
    ``amax``: as ``quantize`` takes it (tensor granularity): one read of x. Off a CUDA device,
    ``torch_quantize`` twice (logged once)."""
    which = "pair"
    if amax is not None:
        which += "+amax"
        _check_amax(x, granularity, amax)
    plan = _known(x, granularity, fp8_dtype, which)
    if plan is not None and x.numel():
        (q, scale), (qt, scale_t) = plan.outputs(x)
        plan.execute(x, q, scale, qt, scale_t, amax=amax)
        return (q, scale), (qt, scale_t)
    g = _check(x, granularity, fp8_dtype, (False, True), "quantize_pair")
    if not x.is_cuda and fallback.off_cuda({"x": x}, "custom_kernels.fp8.fp8_quant.quantize_pair",
                                           "torch_quantize"):
        return _pair_impl(x, g, fp8_dtype, amax=amax)
    if torch.compiler.is_compiling() or not plain_eager(x, amax):
        q, scale, qt, scale_t = torch.ops.custom_kernels.fp8_quantize_pair(x, g.value, fp8_dtype)
        return (q, scale), (qt, scale_t)
    return _pair_impl(x, g, fp8_dtype, _signature(x, granularity, fp8_dtype, which), amax)


def _check(x, granularity, fp8_dtype, orientations, entry: str) -> Granularity:
    """The input rules, on every device; the granularity as a ``Granularity``.
    ``orientations``: the ``transpose`` values whose extents must suit the granularity."""
    if not isinstance(x, torch.Tensor):
        raise UnsupportedInputError(f"{entry}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise UnsupportedInputError(f"{entry}: x must be 2-D (R, C), got {x.dim()} dimensions "
                                    f"{tuple(x.shape)}")
    if x.dtype not in DTYPE_CODES:
        raise UnsupportedInputError(f"{entry}: x must be float32, float16 or bfloat16, not "
                                    f"{x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise UnsupportedInputError(f"{entry}: x has a non-contiguous last dimension (stride "
                                    f"{x.stride(1)}); call .contiguous() first")
    if not _is_fp8(fp8_dtype):
        raise UnsupportedInputError(f"{entry}: fp8_dtype must be torch.float8_e4m3fn or "
                                    f"torch.float8_e5m2, not {fp8_dtype}")
    g = _granularity(granularity, entry)
    for transpose in orientations:
        _check_extents(x, g, transpose, entry)
    return g


def _is_fp8(fp8_dtype) -> bool:
    try:
        return isinstance(fp8_dtype, torch.dtype) and elements.element(fp8_dtype).is_fp8
    except ValueError:  # float8_e4m3fnuz and the like: not in the table
        return False


# A kernel that writes an FP8 copy of its own output (the fused RMSNorm's, the SwiGLU's) writes
# rows whose length is the K of the GEMM that reads them: a multiple of 16 (16-byte FP8 rows), of
# 128 for 1x128 blocks.
FUSED_ROW_MULTIPLE = 16


def check_fused_output(entry: str, g: Granularity, fp8_dtype, length: int, what: str) -> None:
    """The rules such a kernel's FP8 output shares: an FP8 type of the element table, and rows
    (``length`` elements: ``what``) a multiple of ``FUSED_ROW_MULTIPLE``, or of 128 for
    ``block_1x128``. UnsupportedInputError naming the rule otherwise."""
    if not _is_fp8(fp8_dtype):
        raise UnsupportedInputError(f"{entry}: fp8_dtype must be torch.float8_e4m3fn or "
                                    f"torch.float8_e5m2, not {fp8_dtype}")
    multiple = 128 if g is Granularity.BLOCK_1X128 else FUSED_ROW_MULTIPLE
    if length % multiple:
        why = "its 128-column blocks" if multiple == 128 else "an FP8 GEMM's K"
        raise UnsupportedInputError(f"{entry}: granularity {g.value!r} needs {what} a multiple "
                                    f"of {multiple} ({why}), got {length}")


def _granularity(granularity, entry: str) -> Granularity:
    try:
        return Granularity(granularity)
    except ValueError:
        known = ", ".join(repr(g.value) for g in Granularity)
        raise UnsupportedInputError(f"{entry}: unknown granularity {granularity!r}; known: "
                                    f"{known}") from None


def _check_extents(x, g: Granularity, transpose: bool, entry: str) -> None:
    rows, cols = x.shape[::-1] if transpose else x.shape
    what = "x.t()" if transpose else "x"
    need = {Granularity.BLOCK_1X128: (("columns", cols),),
            Granularity.BLOCK_128X128: (("rows", rows), ("columns", cols))}.get(g, ())
    for name, extent in need:
        if extent % BLOCK_K:
            raise UnsupportedInputError(
                f"{entry}: granularity {g.value!r} needs the {name} of the quantized matrix "
                f"({what}, {tuple((rows, cols))}) to be a multiple of {BLOCK_K}, got {extent}")


# ---------------------------------------------------------------------------------------------
# Torch reference (the CPU rule, and what the kernels are compared with bit for bit)
# ---------------------------------------------------------------------------------------------

def torch_quantize(x: torch.Tensor, granularity, *,
                   fp8_dtype: torch.dtype = torch.float8_e4m3fn, transpose: bool = False,
                   amax: torch.Tensor | None = None):
    """``quantize`` in torch, on any device, no host sync (inputs assumed checked; ``amax``:
    the tensor's, given, for granularity "tensor")."""
    g = Granularity(granularity)
    m = (x.detach().t() if transpose else x.detach()).float().contiguous()
    rows, cols = m.shape
    if m.numel() == 0:
        scale = empty_scale(g, rows, cols, m.device).fill_(1.0)
        return torch.empty((rows, cols), dtype=fp8_dtype, device=m.device), scale
    top = fp8_max(fp8_dtype)
    blocks = _blocks(m, g)  # m viewed so that each group's elements share the kept dims
    if amax is not None:
        amax = amax.to(m.device).reshape((1,) * blocks.dim())
    else:
        amax = blocks.abs().amax(dim=_group_dims(g), keepdim=True)
    inv = torch.full((), top, dtype=torch.float32, device=m.device) / amax
    inv = torch.where(amax == 0, torch.ones_like(inv), inv)
    biggest = torch.finfo(torch.float32).max
    inv = torch.where(inv > biggest, torch.full_like(inv, biggest), inv)  # NaN stays NaN
    q = (blocks * inv).clamp(-top, top).to(fp8_dtype).view(rows, cols)
    return q, _scale_layout(torch.reciprocal(inv), g, rows, cols)


def _blocks(m: torch.Tensor, g: Granularity) -> torch.Tensor:
    rows, cols = m.shape
    if g is Granularity.BLOCK_1X128:
        return m.view(rows, cols // BLOCK_K, BLOCK_K)
    if g is Granularity.BLOCK_128X128:
        return m.view(rows // BLOCK_K, BLOCK_K, cols // BLOCK_K, BLOCK_K)
    return m


def _group_dims(g: Granularity) -> tuple[int, ...]:
    return {Granularity.TENSOR: (0, 1), Granularity.ROW: (1,), Granularity.BLOCK_1X128: (2,),
            Granularity.BLOCK_128X128: (1, 3)}[g]


def _scale_layout(amax_shaped: torch.Tensor, g: Granularity, rows: int, cols: int):
    """The scales (kept dims of the grouping) in the granularity's shape and layout."""
    out = empty_scale(g, rows, cols, amax_shaped.device)
    out.copy_(amax_shaped.reshape(out.shape))
    return out


__all__ = ["Granularity", "fp8_max", "quantize", "quantize_pair", "tensor_amax",
           "torch_quantize"]
