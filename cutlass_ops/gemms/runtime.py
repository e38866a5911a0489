"""Loading built kernels and launching them on torch tensors' memory.

The artifact exports a C ABI (see csrc/gemm_launcher.cu); ctypes calls it. Per-device facts (SM
count, compute capability) are queried once per device and cached, never on each call. A library
is loaded only from a cache no other user can write to (``custom_kernels.core.cache_trust``), and
its integer arguments were checked against their C types when the problem was
(``inputs.check_launcher_integers``).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from cutlass_ops.gemms.inputs import EXTENT_TYPE, STRIDE_TYPE
from custom_kernels.core import cache_trust
from custom_kernels.core.errors import KernelLaunchError

ABI_VERSION = 3

_STATUS = {1: "the kernel cannot implement this problem", 2: "workspace too small",
           3: "initialization failed", 4: "launch failed", 5: "CUDA error"}


class GemmArgs(ctypes.Structure):
    """Mirror of CutlassOpsGemmArgs. Strides in elements; B is seen as N x K. The extents' and
    strides' C types are the ones ``inputs`` checks values against (int32, int64)."""

    _fields_ = [
        ("m", EXTENT_TYPE), ("n", EXTENT_TYPE), ("k", EXTENT_TYPE), ("l", EXTENT_TYPE),
        ("a", ctypes.c_void_p),
        ("a_stride_m", STRIDE_TYPE), ("a_stride_k", STRIDE_TYPE), ("a_stride_l", STRIDE_TYPE),
        ("b", ctypes.c_void_p),
        ("b_stride_n", STRIDE_TYPE), ("b_stride_k", STRIDE_TYPE), ("b_stride_l", STRIDE_TYPE),
        ("c", ctypes.c_void_p),
        ("c_stride_m", STRIDE_TYPE), ("c_stride_n", STRIDE_TYPE), ("c_stride_l", STRIDE_TYPE),
        ("d", ctypes.c_void_p),
        ("d_stride_m", STRIDE_TYPE), ("d_stride_n", STRIDE_TYPE), ("d_stride_l", STRIDE_TYPE),
        ("alpha", ctypes.c_float), ("beta", ctypes.c_float),
        ("device_id", ctypes.c_int32), ("sm_count", ctypes.c_int32),
        ("raster_order", ctypes.c_int32), ("swizzle", ctypes.c_int32), ("splits", ctypes.c_int32),
        ("bias", ctypes.c_void_p),
        ("scale_a", ctypes.c_void_p), ("scale_b", ctypes.c_void_p),  # FP8 scales (ABI 3)
    ]


def pointer_offsets() -> dict[str, int]:
    """Byte offsets of the operand and output pointers in the launch arguments."""
    return {name: getattr(GemmArgs, name).offset for name in ("a", "b", "c", "d")}


class LoadedKernel:
    """One artifact's entry points."""

    def __init__(self, library: Path, name: str):
        self.name = name
        self.library = library
        cache_trust.require_private(library)  # UnsafeCacheError: loading it runs its code
        lib = ctypes.CDLL(str(library))
        lib.cutlass_ops_abi_version.restype = ctypes.c_int
        version = lib.cutlass_ops_abi_version()
        if version != ABI_VERSION:
            raise KernelLaunchError(f"{library} has launcher ABI {version}, expected "
                                    f"{ABI_VERSION}; clear the cache and rebuild")
        lib.cutlass_ops_last_error.restype = ctypes.c_char_p
        lib.cutlass_ops_shared_storage_bytes.restype = ctypes.c_int
        self._check = lib.cutlass_ops_gemm_check
        self._check.argtypes = [ctypes.POINTER(GemmArgs), ctypes.POINTER(ctypes.c_size_t)]
        self._check.restype = ctypes.c_int
        self._run = lib.cutlass_ops_gemm_run
        self._run.argtypes = [ctypes.POINTER(GemmArgs), ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.c_void_p]
        self._run.restype = ctypes.c_int
        # For dispatch's per-call path: no can_implement or workspace query (checked once).
        self.run_checked_raw = lib.cutlass_ops_gemm_run_checked
        self.run_checked_raw.argtypes = self._run.argtypes
        self.run_checked_raw.restype = ctypes.c_int
        self._lib = lib
        self.shared_storage_bytes = lib.cutlass_ops_shared_storage_bytes()
        scalars, biases = ctypes.c_int(0), ctypes.c_int(0)
        lib.cutlass_ops_epilogue_slots(ctypes.byref(scalars), ctypes.byref(biases))
        # (scalars, bias pointers) the launcher fills in the epilogue's arguments
        self.epilogue_slots = (scalars.value, biases.value)
        counts = [ctypes.c_int(0) for _ in range(3)]
        lib.cutlass_ops_scale_slots(*(ctypes.byref(c) for c in counts))
        # FP8 scales the kernel reads: (epilogue scalars, epilogue vectors, mainloop)
        self.scale_slots = tuple(c.value for c in counts)

    def _raise(self, status: int) -> None:
        detail = self._lib.cutlass_ops_last_error().decode(errors="replace")
        raise KernelLaunchError(f"{self.name}: {_STATUS.get(status, status)} ({detail})")

    def workspace_bytes(self, args: GemmArgs) -> int:
        """Checks the problem (can_implement) and returns the workspace size it needs."""
        size = ctypes.c_size_t(0)
        status = self._check(ctypes.byref(args), ctypes.byref(size))
        if status:
            self._raise(status)
        return size.value

    def run(self, args: GemmArgs, workspace_ptr: int, workspace_bytes: int, stream: int) -> None:
        status = self._run(ctypes.byref(args), workspace_ptr or None, workspace_bytes,
                           stream or None)
        if status:
            self._raise(status)

    def entry_points(self) -> tuple[int, int]:
        """The addresses of ``cutlass_ops_gemm_run_checked`` and ``cutlass_ops_last_error``: what
        the compiled host path (``custom_kernels.host_ops``) calls. The library is never unloaded
        (``load`` memoizes it), so they stay valid for the process."""
        return (ctypes.cast(self.run_checked_raw, ctypes.c_void_p).value,
                ctypes.cast(self._lib.cutlass_ops_last_error, ctypes.c_void_p).value)

    def run_checked(self, args: GemmArgs, workspace_ptr: int, workspace_bytes: int,
                    stream: int) -> None:
        """``run`` for arguments that differ from checked ones only in pointers (of the same
        alignment) and scalars: skips can_implement and the workspace query."""
        status = self.run_checked_raw(ctypes.byref(args), workspace_ptr or None, workspace_bytes,
                                      stream or None)
        if status:
            self._raise(status)


@functools.cache
def load(library: str, name: str) -> LoadedKernel:
    return LoadedKernel(Path(library), name)
