"""The fused per-chunk step of a chunked linear cross-entropy (``csrc/cross_entropy.cu``).

``chunk_loss_and_grad(logits, labels, *, ignore_index, smoothing, softcap, row_scale=None,
write_grad=True)`` takes a chunk of logits ``[R, V]`` as the LM-head GEMM leaves them (float32,
float16 or bfloat16, in the model's dtype, bias added; any row stride, the last dimension
contiguous) and ``labels [R]`` (int64), and returns the per-row losses (float32 ``[R]``) of
``torch.nn.functional.cross_entropy`` on the float32 logits: ``label_smoothing`` spread over all
V classes as torch does, Gemma-2's soft-cap (``x = cap * tanh(raw / cap)``) applied first, 0 for
a row whose label is ``ignore_index``. With ``write_grad`` it overwrites ``logits`` in place with
the gradient of each row's loss with respect to the raw (pre-cap) logits, times ``row_scale[r]``
when given (float32 ``[R]``), in the logits' dtype: ``softmax(x) - eps / V - (1 - eps) *
onehot(label)``, times ``1 - tanh^2`` under a soft-cap, 0 for ignored rows. One read and one
write of the chunk in one launch, fp32 math (see the .cu file for the passes and the L2).

A label outside ``[0, V)`` that is not ``ignore_index`` makes its row's loss and gradient NaN, in
the kernel and the torch path alike: nothing is read out of bounds, and nothing syncs with the
host to check the labels (``cutlass_ops.linear_cross_entropy`` refuses them off a GPU, where the
check costs no sync).

The step is the custom op ``custom_kernels::cross_entropy_chunk`` (it mutates ``logits``, returns
the losses, and has a fake), so a ``torch.compile(fullgraph=True)`` graph calls it opaquely.
Tensors off a CUDA device run ``torch_chunk_loss_and_grad`` (the CPU rule,
``custom_kernels.core.fallback``; logged once). No host sync, no allocation but the losses: the
launch can be captured in a CUDA graph.

Read top-down: the launcher, the compile function, the custom op and its fake, the public
function, then the torch step (the fallback, and ``cutlass_ops.fused_cross_entropy``'s step off CUDA).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from custom_kernels.core import elements
from custom_kernels import jit
from custom_kernels.core import fallback, int_limits
from custom_kernels.core.errors import UnsupportedInputError

SOURCE = "cross_entropy.cu"
KERNEL = "cross_entropy_chunk"
SCALE_KERNEL = "scale_by_device_scalar"
SCALE_THREADS = 256
# scale_ off the kernel: float32 copies of at most this many elements at a time (a bounded temp).
SCALE_TORCH_BLOCK = 1 << 24
DTYPE_CODES = elements.float_codes()
# Rows in flight (grid x row bytes) are kept under this share of L2, so that pass 2's re-read of
# a row hits L2 (see the .cu file); at least one block per SM whatever the row size.
L2_SHARE = 2 / 3
DEFAULT_L2_BYTES = 50 << 20  # H100 / H200, where torch does not report it
# The kernel takes the vocabulary as a long long but indexes a row with int, a thread's index
# running up to UNROLL x BLOCK (8 x 1024) past the row's last element: a larger one would wrap.
MAX_VOCAB = int_limits.c_range(ctypes.c_int)[1] - 8 * 1024


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def _defines(dtype_code: int, vec: bool, block: int, softcap: bool) -> dict:
    return {"DTYPE": dtype_code, "VEC": int(vec), "BLOCK": block, "SOFTCAP": int(softcap)}


def block_size(vocab: int, element_size: int, vec: bool = True) -> int:
    """Threads per row: enough that each thread has a few 16-byte packs (4 to 16 at V = 32000 to
    152K bf16) and no more; 1024 for rows of 64K packs and up."""
    packs = vocab * element_size // 16 if vec else vocab
    return 1024 if packs >= 8192 else 512 if packs >= 2048 else 256


@functools.cache
def _l2_bytes(device: int) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or \
        DEFAULT_L2_BYTES


def grid_size(rows: int, row_bytes: int, block_occupancy: int, sms: int, l2_bytes: int) -> int:
    """Blocks of the persistent grid: the occupancy, cut down so that the rows in flight fit in
    ``L2_SHARE`` of L2, but never under one block per SM (nor over one block per row)."""
    fit = int(l2_bytes * L2_SHARE) // max(1, row_bytes * sms)
    return max(1, min(rows, sms * max(1, min(block_occupancy, fit))))


def _launch(logits, labels, row_scale, losses, ignore_index: int, smoothing: float,
            softcap: Optional[float], write_grad: bool, vec: Optional[bool] = None) -> None:
    """One launch over the chunk. ``vec`` None: the vector path whenever the pointer is
    element-aligned (always, for a torch tensor); False forces the scalar path (tests)."""
    from custom_kernels.cooperative import max_cooperative_grid
    from custom_kernels.launch import launch, sm_count

    rows, vocab = logits.shape
    size = logits.element_size()
    if vec is None:
        vec = logits.data_ptr() % size == 0
    device = logits.device.index
    block = block_size(vocab, size, vec)
    kernel = jit.get_kernel(SOURCE, KERNEL, device=device,
                            defines=_defines(DTYPE_CODES[logits.dtype], vec, block,
                                             softcap is not None))
    sms = sm_count(device)
    grid = grid_size(rows, vocab * size, max_cooperative_grid(kernel, block, 0, device) // sms,
                     sms, _l2_bytes(device))
    launch(kernel, logits, labels, row_scale if row_scale is not None else 0, losses, rows,
           logits.stride(0), vocab, int(ignore_index), float(smoothing),
           float(softcap) if softcap is not None else 0.0, int(write_grad),
           grid=grid, block=block, device=device)


def _launch_scale(t, scale) -> None:
    from custom_kernels.launch import launch, sm_count

    device = t.device.index
    kernel = jit.get_kernel(SOURCE, SCALE_KERNEL, device=device,
                            defines=_defines(DTYPE_CODES[t.dtype], True, SCALE_THREADS, False))
    packs = -(-t.numel() * t.element_size() // 16)
    grid = max(1, min(sm_count(device) * 8, -(-packs // SCALE_THREADS)))
    launch(kernel, t, scale, t.numel(), grid=grid, block=SCALE_THREADS, device=device)


# ---------------------------------------------------------------------------------------------
# Compile (tensor-free, no GPU)
# ---------------------------------------------------------------------------------------------

def compile_cross_entropy(dtype: str = "bfloat16", vocab: int = 128256, vec: bool = True,
                          softcap: bool = False, arch: str = jit.DEFAULT_ARCH) -> Path:
    """The cubin ``_launch`` loads for logits of ``dtype`` and ``vocab`` columns (the vocabulary
    picks the block size) on ``arch``."""
    code = elements.element(dtype).code
    size = 4 if code == 0 else 2
    return jit.compile_cubin(SOURCE, defines=_defines(code, vec, block_size(vocab, size, vec),
                                                      softcap),
                             name_expressions=(KERNEL,), arch=arch)


def compile_scale(dtype: str = "bfloat16", arch: str = jit.DEFAULT_ARCH) -> Path:
    """The cubin of ``scale_``'s kernel for tensors of ``dtype`` (float16 or bfloat16)."""
    return jit.compile_cubin(SOURCE, defines=_defines(elements.element(dtype).code, True, SCALE_THREADS,
                                                      False),
                             name_expressions=(SCALE_KERNEL,), arch=arch)


# ---------------------------------------------------------------------------------------------
# The custom op and its fake
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("custom_kernels::cross_entropy_chunk", mutates_args=("logits",))
def cross_entropy_chunk(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                        smoothing: float, softcap: Optional[float],
                        row_scale: Optional[torch.Tensor], write_grad: bool) -> torch.Tensor:
    """The per-row losses; with ``write_grad`` the logits are overwritten with the gradient.
    See ``chunk_loss_and_grad``, which checks the inputs first."""
    tensors = {"logits": logits, "labels": labels, "row_scale": row_scale}
    torch_step = fallback.off_cuda(tensors, "chunk_loss_and_grad", "torch_chunk_loss_and_grad")
    if not torch_step and (logits.dtype not in DTYPE_CODES or not _kernel_layout(logits)):
        # What the public function refuses, should a caller of the op pass it: float64 (which
        # linear_cross_entropy takes), a strided last dimension, rows that overlap.
        fallback.log_once("chunk_loss_and_grad uses torch_chunk_loss_and_grad",
                          f"logits of {logits.dtype} with strides {logits.stride()}")
        torch_step = True
    if torch_step:
        return torch_chunk_loss_and_grad(logits, labels, ignore_index, smoothing, softcap,
                                         row_scale, write_grad)
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        labels = labels.to(torch.int64).contiguous()
        if row_scale is not None:
            row_scale = row_scale.to(torch.float32).contiguous()
        _launch(logits, labels, row_scale, losses, ignore_index, smoothing, softcap, write_grad)
    return losses


@cross_entropy_chunk.register_fake
def _(logits, labels, ignore_index, smoothing, softcap, row_scale, write_grad):
    torch._check(logits.dim() == 2 and labels.shape == logits.shape[:1],
                 lambda: "custom_kernels::cross_entropy_chunk: logits [R, V], labels [R]")
    return logits.new_empty(logits.shape[:1], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def _kernel_layout(logits) -> bool:
    """A contiguous last dimension, rows that do not overlap, V at most MAX_VOCAB."""
    rows, vocab = logits.shape
    return 0 < vocab <= MAX_VOCAB and (vocab == 1 or logits.stride(1) == 1) and \
        (rows <= 1 or logits.stride(0) >= vocab)


def _check(logits, labels, smoothing, softcap, row_scale) -> None:
    """The input rules, on any device (the device rule comes after them, in the op)."""
    if logits.dtype not in DTYPE_CODES:
        raise UnsupportedInputError(f"logits must be float32, float16 or bfloat16, not "
                                    f"{logits.dtype}")
    if logits.dim() != 2 or not 0 < logits.shape[1] <= MAX_VOCAB:
        raise UnsupportedInputError(f"logits must be [rows, vocab] with 0 < vocab <= {MAX_VOCAB} "
                                    f"(the kernel indexes a row with int), got shape "
                                    f"{tuple(logits.shape)}")
    rows, vocab = logits.shape
    if not _kernel_layout(logits):
        raise UnsupportedInputError(f"logits need a contiguous last dimension and rows that do "
                                    f"not overlap, got strides {logits.stride()}")
    if labels.dtype != torch.int64 or tuple(labels.shape) != (rows,):
        raise UnsupportedInputError(f"labels must be int64 of shape ({rows},), got "
                                    f"{labels.dtype} {tuple(labels.shape)}")
    if row_scale is not None and (row_scale.dtype != torch.float32 or
                                  tuple(row_scale.shape) != (rows,)):
        raise UnsupportedInputError(f"row_scale must be float32 of shape ({rows},), got "
                                    f"{row_scale.dtype} {tuple(row_scale.shape)}")
    if not 0.0 <= smoothing <= 1.0:
        raise UnsupportedInputError(f"smoothing must be in [0, 1], got {smoothing}")
    if softcap is not None and not softcap > 0:
        raise UnsupportedInputError(f"softcap must be positive, got {softcap}")


def chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                        smoothing: float = 0.0, softcap: Optional[float] = None,
                        row_scale: Optional[torch.Tensor] = None,
                        write_grad: bool = True) -> torch.Tensor:
    """Per-row cross-entropy losses of a chunk of logits (float32 ``[R]``); with ``write_grad``
    the logits become, in place, the gradient of each row's loss (times ``row_scale``) with
    respect to the raw logits. See the module docstring."""
    _check(logits, labels, float(smoothing), softcap, row_scale)
    return torch.ops.custom_kernels.cross_entropy_chunk(
        logits, labels, int(ignore_index), float(smoothing),
        float(softcap) if softcap is not None else None, row_scale, bool(write_grad))


def scale_(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t *= scale`` in place, in float32 math with one rounding to ``t``'s dtype; ``scale`` is a
    0-d float32 tensor on ``t``'s device (a device value: nothing syncs). A contiguous float16 /
    bfloat16 CUDA tensor takes one pass of the kernel (``scale_by_device_scalar``, which reads
    the scale first and leaves ``t`` unread when it is 1); float32 is
    torch's ``mul_``; anything else (off CUDA, strided, under torch.compile, where Inductor fuses
    the same expression) goes through float32 copies of bounded blocks."""
    if t.dtype == torch.float32:
        return t.mul_(scale)
    if (t.is_cuda and t.dtype in DTYPE_CODES and t.is_contiguous() and scale.is_cuda
            and scale.device == t.device and scale.dtype == torch.float32
            and scale.numel() == 1 and not torch.compiler.is_compiling()):
        if t.numel():
            _launch_scale(t, scale.reshape(()).contiguous())
        return t
    rows = max(1, SCALE_TORCH_BLOCK // max(1, t[0].numel())) if t.dim() else 1
    for block in (t.split(rows) if t.dim() else (t,)):
        block.copy_(block.float() * scale)
    return t


# ---------------------------------------------------------------------------------------------
# The torch step: the fallback off CUDA, and cutlass_ops.fused_cross_entropy's step there
# ---------------------------------------------------------------------------------------------

def torch_chunk_step(logits: torch.Tensor, capped: Optional[torch.Tensor], labels: torch.Tensor,
                     ignore_index: int, smoothing: float):
    """``F.cross_entropy`` on float32 logits, a row at a time: ``logits`` are the (capped)
    float32 logits, ``capped`` the soft-cap's tanh (None without a cap). Returns the per-row loss
    (0 where ignored) and the gradient of the summed loss with respect to the pre-cap logits
    (float32, a new tensor). A label outside [0, V) that is not ``ignore_index`` makes its row's
    loss and gradient NaN, as in the kernel."""
    valid = (labels != ignore_index) & (labels >= 0) & (labels < logits.shape[-1])
    out_of_range = ~valid & (labels != ignore_index)
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
    loss = torch.where(out_of_range, float("nan"), loss)
    grad.masked_fill_(out_of_range[:, None], float("nan"))
    return loss, grad


def torch_chunk_loss_and_grad(logits, labels, ignore_index, smoothing, softcap, row_scale,
                              write_grad) -> torch.Tensor:
    """``chunk_loss_and_grad`` in torch (float32 copies of the chunk), for tensors off CUDA."""
    x = logits.float()
    capped = None
    if softcap is not None:
        capped = torch.tanh(x / softcap)
        x = capped * softcap
    loss, grad = torch_chunk_step(x, capped, labels, ignore_index, smoothing)
    if write_grad:
        if row_scale is not None:
            grad *= row_scale[:, None]
        logits.copy_(grad)
    return loss


def chunk_reference(logits, labels, ignore_index=-100, smoothing=0.0, softcap=None,
                    row_scale=None):
    """The tests' ground truth, independent of the torch step: per-row losses of
    ``F.cross_entropy`` on the float32 (soft-capped) logits, and the gradient of
    ``sum(row_scale * loss)`` with respect to the raw logits, by autograd."""
    import torch.nn.functional as F

    raw = logits.detach().float().requires_grad_()
    with torch.enable_grad():
        x = softcap * torch.tanh(raw / softcap) if softcap is not None else raw
        loss = F.cross_entropy(x, labels, ignore_index=ignore_index, label_smoothing=smoothing,
                               reduction="none")
        weights = row_scale if row_scale is not None else torch.ones_like(loss)
        (grad,) = torch.autograd.grad((loss * weights).sum(), [raw])
    return loss.detach(), grad
