"""NVRTC compilation of the ``csrc/*.cu`` kernels, a cubin cache on disk, and kernel loading.

``compile_cubin`` takes only hashable scalars (a file name, ``-D`` values, name expressions, an
arch) and never touches a GPU, so it can run in a process pool or on a machine without one. Its
cubin lives at ``<cache>/<version>/nvrtc/<arch>/<stem>-<hash>.cubin`` beside a ``.json`` with the
mangled names of the name expressions (NVRTC gives them only at compile time). The hash covers
every file in ``csrc/`` (so any ``.cuh`` a kernel includes), the defines, the name expressions,
the arch, the NVRTC and cuda.core versions, the include directories and the options. The entry is
kept by ``custom_kernels.core.build_cache`` (one lock per key, corrupt entries rebuilt). A failed
compile keeps its log in ``<stem>-<hash>.log`` and a ``<stem>-<hash>.failed.json`` record and raises
``BuildError``; the next call compiles again rather than re-raising the record: NVRTC takes about a
second, and no caller has a retry switch to clear a failure that was not the source's fault.

``get_kernel`` compiles (or finds) the cubin and loads it, memoized per (source, name, defines,
device): after the first call it costs a dict lookup. A cubin is loaded only from a cache that no
other user can write to (``custom_kernels.core.cache_trust``: ``UnsafeCacheError`` otherwise).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Mapping, Sequence

from custom_kernels.core import build_cache, cache_trust
from custom_kernels.core.errors import ToolchainError

CSRC = Path(__file__).resolve().with_name("csrc")
DEFAULT_ARCH = "sm_90a"
# -O3 is NVRTC's default for device code; -lineinfo keeps compute-sanitizer and ncu readable.
_OPTIONS = {"std": "c++17", "lineinfo": True}

_kernels: dict = {}
_kernels_lock = threading.Lock()


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """The CUDA toolkit's ``include`` and ``include/cccl`` (the pip header packages lack CCCL),
    then ``custom_kernels/csrc``."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parent.parent))
    homes.append("/usr/local/cuda")
    for home in filter(None, homes):
        include = Path(home) / "include"
        if (include / "cuda_runtime.h").is_file() or (include / "cuda_bf16.h").is_file():
            dirs = [include]
            if (include / "cccl").is_dir():
                dirs.append(include / "cccl")
            return (*(str(d.resolve()) for d in dirs), str(CSRC))
    raise ToolchainError("CUDA toolkit headers not found: install the CUDA toolkit, put its nvcc "
                         "on PATH, or set CUDA_HOME to the toolkit directory")


@functools.cache
def nvrtc_version() -> str:
    """NVRTC's version as "major.minor", or "unavailable" when libnvrtc cannot be loaded."""
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception:  # libnvrtc missing: compile_cubin reports it when it needs NVRTC
        return "unavailable"


@functools.cache
def _cuda_core_version() -> str:
    import cuda.core

    return getattr(cuda.core, "__version__", "unknown")


def _csrc_digest() -> str:
    """Every file of csrc/: a change to any header a kernel includes makes a new key."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.is_file() and path.suffix in (".cu", ".cuh", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _normalize_defines(defines: Mapping) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(int(v) if isinstance(v, bool) else v))
                        for k, v in defines.items()))


def cache_key(source: str, defines: Mapping = {}, name_expressions: Sequence[str] = (),
              arch: str = DEFAULT_ARCH) -> str:
    """The hash of everything that changes the cubin; needs no GPU and no NVRTC."""
    payload = {
        "source": source, "csrc": _csrc_digest(), "defines": _normalize_defines(defines),
        "names": list(name_expressions), "arch": arch, "nvrtc": nvrtc_version(),
        "cuda.core": _cuda_core_version(), "include": include_dirs(), "options": _OPTIONS,
    }
    return build_cache.key(payload)


def cubin_path(source: str, defines: Mapping = {}, name_expressions: Sequence[str] = (),
               arch: str = DEFAULT_ARCH) -> Path:
    key = cache_key(source, defines, name_expressions, arch)
    return build_cache.entry_path("nvrtc", arch, Path(source).stem, key).with_suffix(".cubin")


def compile_cubin(source: str, *, defines: Mapping = {}, name_expressions: Sequence[str] = (),
                  arch: str = DEFAULT_ARCH) -> Path:
    """The cached cubin of ``csrc/<source>``, compiled with NVRTC if absent. No GPU needed."""
    src = CSRC / source
    if not src.is_file():
        raise FileNotFoundError(f"no kernel source {source!r} under {CSRC}")
    path = cubin_path(source, defines, name_expressions, arch)
    build_cache.get_or_build(_entry(path, name_expressions),
                             lambda out: _nvrtc(src, out, defines, name_expressions, arch))
    return path


def _entry(path: Path, name_expressions: Sequence[str]) -> build_cache.Entry:
    """The cubin's entry; its sidecar is the symbol table, complete when it maps every name
    expression asked for."""
    def has_every_name(mapping) -> bool:
        return isinstance(mapping, dict) and all(n in mapping for n in name_expressions)

    return build_cache.file_entry(path, sidecar_ok=has_every_name, keep_failures=False)


def _nvrtc(src: Path, out: Path, defines: Mapping, name_expressions: Sequence[str],
           arch: str) -> build_cache.Built:
    """Compiles ``src`` into ``out``; the sidecar maps each name expression to its mangled name."""
    try:
        from cuda.core import Program, ProgramOptions

        options = ProgramOptions(
            name=src.name, arch=arch, include_path=list(include_dirs()),
            # cuda.core refuses an empty list of macros: None when there are none.
            define_macro=list(_normalize_defines(defines)) or None, **_OPTIONS)
        program = Program(src.read_text(), "c++", options)
    except ToolchainError:
        raise
    except Exception as exc:
        raise ToolchainError(f"NVRTC is unavailable ({type(exc).__name__}: {exc}); install the "
                             "CUDA toolkit or the nvidia-cuda-nvrtc package") from exc
    log = io.StringIO()
    try:
        obj = program.compile("cubin", name_expressions=tuple(name_expressions), logs=log)
    except Exception as exc:
        raise build_cache.BuildFailed(f"{log.getvalue()}\n{type(exc).__name__}: {exc}\n") from exc
    finally:
        program.close()
    out.write_bytes(bytes(obj.code))
    return build_cache.Built({name: _as_str(obj.symbol_mapping[name])
                              for name in name_expressions})


def _as_str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def get_kernel(source: str, name: str, *, defines: Mapping = {}, device: int | None = None):
    """The ``cuda.core.Kernel`` ``name`` (a plain ``extern "C"`` name or a template name
    expression such as ``"rms_fwd<256>"``) of ``csrc/<source>`` compiled with ``defines``,
    loaded for ``device`` (torch's current device when None). Memoized."""
    if device is None:
        import torch

        device = torch.cuda.current_device()
    key = (source, name, _normalize_defines(defines), device)
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    with _kernels_lock:
        kernel = _kernels.get(key)
        if kernel is None:
            kernel = _kernels[key] = _load(source, name, defines, device)
    return kernel


def _load(source: str, name: str, defines: Mapping, device: int):
    import torch
    from cuda.core import Device, ObjectCode

    arch = device_arch(device)
    path = compile_cubin(source, defines=defines, name_expressions=(name,), arch=arch)
    cache_trust.require_private(path)  # the driver runs what it loads
    # cuda.core wants the lowered (mangled) names as bytes, as NVRTC returns them.
    mapping = {expr: lowered.encode() for expr, lowered in
               json.loads(path.with_suffix(".json").read_text()).items()}
    with torch.cuda.device(device):
        Device(device).set_current()
        obj = ObjectCode.from_cubin(path.read_bytes(), name=path.stem, symbol_mapping=mapping)
        return obj.get_kernel(name)


@functools.cache
def device_arch(device: int) -> str:
    """``sm_90a`` for Hopper: the ``a`` suffix enables the cluster and wgmma features; other
    GPUs get their plain ``sm_XY``."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    suffix = "a" if (major, minor) in ((9, 0), (10, 0), (10, 3)) else ""
    return f"sm_{major}{minor}{suffix}"


def clear_memo() -> None:
    """Forget loaded kernels (tests)."""
    with _kernels_lock:
        _kernels.clear()
