"""The device rule of every public entry point, and the one warning a fallback to torch logs.

Entry points that choose their kernel (``cutlass_ops.matmul`` and ``explain``, the
``cutlass_ops.nn`` modules and the models ``cutlass_ops.convert`` changed,
``custom_kernels.norms.rms_norm`` / ``layer_norm`` and their modules,
``custom_kernels.segment_sum`` / ``segment_mean``, ``custom_kernels.clip_grad_norm_``) run
torch's own computation for tensors that are not on a CUDA device (the CPU, meta): the family's
torch equivalent, with the kernels' results and dtypes, and autograd where the op has it. Off a
GPU they do what they do on a GPU whose kernel cannot take the input: what they refuse on a GPU
(a wrong dtype or shape) they refuse there too. Each reason is logged once per process, at
warning level, on the ``cutlass_ops`` logger.

Entry points that name a kernel (``cutlass_ops.gemm`` and ``plan`` with their ``config``, the
norm functions given a ``config``, ``custom_kernels.launch_cooperative`` and
``launch_persistent``) raise ``UnsupportedInputError`` naming the device.

Compiled code in a cache that another user can write to is never loaded (``cache_trust``).
``cutlass_ops.matmul`` (and the GEMM ops and modules built on its dispatch) counts such a cache's
kernels as not built and runs torch.matmul, as it does before anything is built, with one warning
naming the path and the fix. Every other entry point raises ``UnsafeCacheError`` with the
same words: those that name a kernel, the NVRTC families (their kernels come only from the cache,
compiled on first use) and ``grouped_mm`` (its kernel is one a tune stored for this cache).

Tensors of one call on different devices (one on the CPU, one on a GPU) raise
``UnsupportedInputError`` at every entry point. The one exception: ``clip_grad_norm_`` with
gradients spread over several GPUs, which torch defines for model-parallel training, runs
torch's computation.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from custom_kernels.core.errors import UnsupportedInputError

log = logging.getLogger("cutlass_ops")
logged: set[tuple[str, str]] = set()


def log_once(what: str, reason: str) -> None:
    """Logs ``what: reason`` as a warning, once per process for each pair. Not while
    torch.compile traces (it cannot trace a logger call): the eager calls log."""
    from torch.compiler import is_compiling

    if not is_compiling() and (what, reason) not in logged:
        logged.add((what, reason))
        log.warning("%s: %s", what, reason)


def common_device(tensors: Mapping[str, Any], entry: str):
    """The device that the named tensors share (entries without a ``device``, None among them,
    are left out; None when no entry has one). Raises UnsupportedInputError naming each
    tensor's device when they are on several."""
    devices = {name: t.device for name, t in tensors.items() if hasattr(t, "device")}
    unique = set(devices.values())
    if len(unique) > 1:
        where = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise UnsupportedInputError(f"{entry}: tensors are on different devices ({where})")
    return next(iter(unique), None)


def off_cuda(tensors: Mapping[str, Any], entry: str, instead: str) -> bool:
    """The rule for an entry point that chooses its kernel: True when the tensors are not on a
    CUDA device (the caller runs ``instead``, torch's computation; this logs it once), False
    when they are on one. Raises UnsupportedInputError for tensors on several devices."""
    device = common_device(tensors, entry)
    if device is None or device.type == "cuda":
        return False
    log_once(f"{entry} uses {instead}", f"the tensors are on {device}, not a CUDA device")
    return True


def require_cuda(tensors: Mapping[str, Any], entry: str):
    """The rule for an entry point that names a kernel: the tensors' CUDA device. Raises
    UnsupportedInputError naming the device when they are elsewhere (or on several devices)."""
    device = common_device(tensors, entry)
    if device is not None and device.type != "cuda":
        raise UnsupportedInputError(f"{entry}: the tensors are on {device}; a CUDA kernel needs "
                                    "CUDA tensors (move them with .cuda())")
    return device


def require_cuda_arguments(args, entry: str) -> None:
    """``require_cuda`` for a kernel launcher's positional arguments (the tensors among them)."""
    if any(getattr(getattr(a, "device", None), "type", "cuda") != "cuda" for a in args):
        require_cuda({f"argument {i}": a for i, a in enumerate(args) if hasattr(a, "device")},
                     entry)

