"""The compiled host path: ``csrc/host/host_ops.cpp`` built against the installed torch, loaded as
torch ops (``torch.ops.cutlass_ops_host``), and the launch records Python hands it.

Why: an eager call through Python costs several times torch's own (a norm 44-50 us against
torch's 15-17 on the GPU machine's host; docs/measurements.md, "Host cost"). The C++ op's warm
call is torch's op dispatch, a record lookup, the outputs' allocation and one ``cuLaunchKernel``.

How it is used: a family calls its C++ op first; the op returns None for any call it does not take
(no record for that input signature yet, or inputs outside its narrow rule), and the family's
Python path runs, judges the inputs, and hands the plan it built to ``record_norm`` so that the next
call of that signature stays in C++. Records are facts Python decided, never new decisions.

The build: the C++ compiler (``$CXX``, else ``c++``) with torch's headers and libraries
(``torch.utils.cpp_extension``'s paths and ABI flag) and the CUDA toolkit's ``cuda.h``, about
half a minute, once per (source, torch, compiler), kept in the build cache like every other
artifact (locks, private files, corrupt entries rebuilt). It runs in a background thread on first
use so that no call waits for it: calls take the Python path until it is loaded.
``CUTLASS_OPS_HOST_PATH``: ``0`` turns the path off, ``wait`` builds it in the calling thread on
first use (tests, benchmarks, ``cutlass-tune doctor``). A build that fails or a toolchain that
is missing is logged once and leaves the Python path in place: the documented fallback.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from custom_kernels import jit
from custom_kernels.core import build_cache, cache_trust, fallback
from custom_kernels.core.errors import BuildError, ToolchainError

SOURCE = jit.CSRC / "host" / "host_ops.cpp"
LIBRARY = "host_ops.so"
ENV_VAR = "CUTLASS_OPS_HOST_PATH"
_NAMESPACE = "cutlass_ops_host"

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state = {"ops": None, "thread": None, "why_not": None}


# ---- the build -------------------------------------------------------------------------------

@functools.cache
def compiler() -> str:
    explicit = os.environ.get("CXX")
    found = shutil.which(explicit) if explicit else (shutil.which("c++") or shutil.which("g++"))
    if not found:
        raise ToolchainError("no C++ compiler for the compiled host path: install g++ or set CXX")
    return found


@functools.cache
def compiler_version() -> str:
    out = subprocess.run([compiler(), "--version"], capture_output=True, text=True)
    return (out.stdout.splitlines() or [""])[0]


def _torch_lib_dir() -> str:
    return str(Path(torch.__file__).resolve().parent / "lib")


def flags() -> list[str]:
    from torch.utils import cpp_extension

    cuda_include = jit.include_dirs()[0]  # cuda.h (the driver API's types; libcuda is dlopened)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-std=c++17", "-O2", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{d}" for d in cpp_extension.include_paths()), f"-I{cuda_include}"]


def link_flags() -> list[str]:
    """After the source: the linker resolves a library only for the objects before it."""
    return [f"-L{_torch_lib_dir()}", "-lc10", "-ltorch_cpu", "-ltorch",
            f"-Wl,-rpath,{_torch_lib_dir()}"]


def _entry() -> build_cache.Entry:
    key = build_cache.key({"source": build_cache.digest(SOURCE.read_bytes()),
                           "torch": torch.__version__, "compiler": compiler_version(),
                           "command": [*flags(), "<source>", *link_flags()]})
    directory = build_cache.entry_path("host", platform.machine() or "host", "host_ops", key)
    return build_cache.directory_entry(directory, "host_ops", LIBRARY, "built.json")


def _compile(library: Path) -> build_cache.Built:
    command = [compiler(), *flags(), "-o", str(library), str(SOURCE), *link_flags()]
    proc = subprocess.run(command, capture_output=True, text=True)
    log = " ".join(command) + "\n\n" + proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise build_cache.BuildFailed(log)
    return build_cache.Built({"torch": torch.__version__}, log)


def built_path() -> Path | None:
    """The library for this torch and compiler if the cache holds it whole, else None: a look,
    no build (``cutlass-tune doctor``). Raises ToolchainError without a C++ compiler."""
    entry = _entry()
    return entry.artifact if build_cache.is_complete(entry) else None


def build() -> Path:
    """The library, from the cache or compiled now. Raises BuildError or ToolchainError."""
    return build_cache.get_or_build(_entry(), _compile).path


# ---- loading ---------------------------------------------------------------------------------

def _load() -> None:
    """Builds (when needed) and loads the library; records why not when it cannot."""
    try:
        path = build()
        cache_trust.require_private(path)
        torch.ops.load_library(str(path))
        _state["ops"] = getattr(torch.ops, _NAMESPACE)
    except (BuildError, ToolchainError, OSError, RuntimeError) as exc:
        _state["why_not"] = str(exc)
        fallback.log_once("the compiled host path is off; eager calls take the Python path",
                          str(exc))


def ops(wait: bool | None = None):
    """``torch.ops.cutlass_ops_host`` once loaded, else None (the caller takes its Python path).
    The first call starts the build: in a background thread, or here when ``wait`` (default:
    ``CUTLASS_OPS_HOST_PATH=wait``)."""
    loaded = _state["ops"]
    if loaded is not None:
        return loaded
    mode = os.environ.get(ENV_VAR, "1")
    if mode == "0" or _state["why_not"] is not None:
        return None
    if wait is None:
        wait = mode == "wait"
    with _lock:
        thread = _state["thread"]
        if thread is None and _state["ops"] is None:
            thread = _state["thread"] = threading.Thread(target=_load, name="host_ops build",
                                                         daemon=True)
            thread.start()
    if wait and thread is not None:
        thread.join()
    return _state["ops"]


def status() -> str:
    """"compiled" (loaded in this process), "off: <why>", or "not loaded" (not asked for yet, or
    still building): what result files record. Starts nothing."""
    if _state["ops"] is not None:
        return "compiled"
    why = why_not()
    return f"off: {why}" if why else "not loaded"


def why_not() -> str | None:
    """Why the compiled path is off in this process, or None (on, or still building)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return f"{ENV_VAR}=0"
    return _state["why_not"]


def direct_callable(overload):
    """The C++ callable behind a torch op overload: ``OpOverload.__call__`` only forwards to it,
    so a hot call skips one Python frame. The overload itself where a torch lacks the attribute."""
    return getattr(overload, "_op", overload)


class LazyOp:
    """One op of the compiled host path for a family's hot call: ``op`` once loaded (None before),
    ``off`` once the path is off for good (``CUTLASS_OPS_HOST_PATH=0`` or a failed build), so
    that a warm call costs an attribute read either way. ``on_load(ops)`` runs once, before the
    op is handed out (an op naming its helpers)."""

    __slots__ = ("name", "op", "off", "on_load")

    def __init__(self, name: str, on_load=None):
        self.name, self.op, self.off, self.on_load = name, None, False, on_load

    def load(self):
        """The op, loading (or starting the build of) the library; None while building or
        when the path is off."""
        if self.op is None and not self.off:
            host = ops()
            if host is None:
                self.off = why_not() is not None
                return None
            if self.on_load is not None:
                self.on_load(host)
            self.op = direct_callable(getattr(host, self.name).default)
        return self.op


# ---- records ---------------------------------------------------------------------------------

_recorded: set = set()


def record_norm(kind: str, hidden: int, x_dtype, out_dtype, w_dtype, aligned: bool,
                residual: bool, device: int, plan) -> None:
    """Hands a forward norm plan (``norms.norm_ops._NormPlan``, chosen with no config override) to
    the C++ op, once per signature and process."""
    host = _state["ops"]
    if host is None:
        return
    key = (kind, hidden, x_dtype, out_dtype, w_dtype, aligned, residual, device)
    if key in _recorded:
        return
    cfg = plan.config
    host.set_norm_record(0 if kind == "rms" else 1, hidden, x_dtype, out_dtype, w_dtype, aligned,
                         residual, device, int(plan.kernel.handle), cfg.threads, cfg.cluster,
                         plan.shared_mem, cfg.rows_per_launch_unit, plan.persistent,
                         plan.max_units)
    _recorded.add(key)


def record_gemm(a, b, run: int, last_error: int, args: bytes, offsets: dict, swap_ab: bool,
                workspace_bytes: int, out_dtype, eager_only: bool = False) -> None:
    """Hands a prepared GEMM route of a plain product to the C++ op (``gemm``): the signature of
    (a, b) as dispatch keys it, the kernel library's ``run`` and ``last_error`` entry points (their
    addresses: the library stays loaded for the process), its checked launch arguments and the
    byte offsets of the a, b, c, d pointers in them. ``eager_only``: the op declines the record
    while the current stream is capturing a CUDA graph."""
    host = _state["ops"]
    if host is None:
        return
    aligned = a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    host.set_gemm_record(list(a.shape), list(a.stride()), a.dtype, list(b.shape),
                         list(b.stride()), b.dtype, a.device.index, aligned, run, last_error,
                         torch.frombuffer(bytearray(args), dtype=torch.uint8), offsets["a"],
                         offsets["b"], offsets["c"], offsets["d"], swap_ab, workspace_bytes,
                         out_dtype, eager_only)


def record_torch_gemm(a, b) -> None:
    """Hands dispatch's torch route of a plain 2-D product to the C++ op: the signature of
    (a, b) as dispatch keys it; the op then runs ``torch.matmul``'s product itself (``at::matmul_out``)
    instead of returning to Python."""
    host = _state["ops"]
    if host is None:
        return
    aligned = a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    host.set_gemm_torch_record(list(a.shape), list(a.stride()), a.dtype, list(b.shape),
                               list(b.stride()), b.dtype, a.device.index, aligned)


def product_calls() -> tuple[int, int]:
    """How many plain products the C++ op has run in this process, (on CUTLASS records, on
    torch records): (0, 0) before the library loads."""
    host = _state["ops"]
    if host is None:
        return 0, 0
    cutlass, torch_records = host.product_calls()
    return int(cutlass), int(torch_records)


def clear_records() -> None:
    """Forgets every record (when Python forgets its decisions: ``dispatch.reset`` after a tune,
    a test switching tuned configs)."""
    _recorded.clear()
    if _state["ops"] is not None:
        _state["ops"].clear_records()
