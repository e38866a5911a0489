"""nvcc builds of emitted kernels into a content-addressed artifact cache.

An artifact is ``<cache>/<version>/artifacts/<arch>/<readable name>-<hash>/`` holding the kernel
header, ``kernel.so``, and ``build.log``. The hash covers the emitted source, our launcher, the nvcc
version, the flags and the arch, so a change to any of them builds anew and nothing stale is
loaded. A failed build keeps its log and a ``failed.json`` marker: the same failure is reported
again without re-running nvcc (``retry_failed=True`` overrides). Builds run in parallel
processes (nvcc itself), each under a per-artifact file lock so concurrent callers build once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import filelock

from custom_kernels.core import cache_dir
from cutlass_ops.gemms.config import Arch
from custom_kernels.core.errors import BuildError, ToolchainError

LAUNCHER = Path(__file__).with_name("csrc") / "gemm_launcher.cu"
KERNEL_HEADER = "cutlass_ops_kernel.h"
LIBRARY = "kernel.so"
BUILD_TIMEOUT_S = 1800


@functools.cache
def nvcc_path() -> str:
    explicit = os.environ.get("CUTLASS_OPS_NVCC")
    candidates = [explicit] if explicit else []
    candidates.append(shutil.which("nvcc"))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise ToolchainError("nvcc not found: install the CUDA toolkit, put nvcc on PATH, or set "
                         "CUTLASS_OPS_NVCC or CUDA_HOME")


@functools.cache
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release [\d.]+, (V[\d.]+)", out)
    if not match:
        raise ToolchainError(f"cannot read the version of {nvcc_path()}:\n{out}")
    return match.group(1)


def nvcc_available() -> bool:
    try:
        nvcc_version()
        return True
    except ToolchainError:
        return False


@functools.cache
def cutlass_include_dirs() -> tuple[str, ...]:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError("nvidia-cutlass is not installed: pip install nvidia-cutlass")
    source = Path(list(spec.submodule_search_locations)[0]) / "source"
    dirs = (source / "include", source / "tools" / "util" / "include")
    if not all(d.is_dir() for d in dirs):
        raise ToolchainError(f"CUTLASS headers missing under {source}")
    return tuple(str(d) for d in dirs)


def nvcc_flags(arch: Arch) -> list[str]:
    return [
        "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-shared",
        "-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden",
        # Static CUDA runtime: the artifact works beside any torch build, CUDA 12 or 13.
        "-cudart=static",
        f"-gencode=arch=compute_{arch.cc}a,code=sm_{arch.cc}a",
    ]


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    name: str  # readable: operands and config build name
    kernel_source: str = dataclasses.field(repr=False)
    arch: Arch
    # Preprocessor macros this kernel needs on the nvcc command line (not in its source: the
    # launcher includes CUTLASS before the kernel).
    defines: tuple[str, ...] = ()

    @functools.cached_property
    def key(self) -> str:
        digest = hashlib.sha256()
        parts = [self.kernel_source.encode(), LAUNCHER.read_bytes(), nvcc_version().encode(),
                 " ".join(nvcc_flags(self.arch)).encode(), self.arch.value.encode()]
        if self.defines:  # absent from the keys of kernels without any, which stay as they were
            parts.append(" ".join(self.defines).encode())
        for part in parts:
            digest.update(len(part).to_bytes(8, "little") + part)
        return digest.hexdigest()[:20]

    @property
    def directory(self) -> Path:
        return cache_dir.versioned_dir("artifacts", self.arch.value) / f"{self.name}-{self.key}"


@dataclasses.dataclass(frozen=True)
class Artifact:
    spec: BuildSpec
    library: Path
    seconds: float  # build time; 0.0 when it came from the cache


def _failure(spec: BuildSpec) -> BuildError | None:
    marker = spec.directory / "failed.json"
    data = cache_dir.read_json_or_quarantine(marker)
    if data is None:
        return None
    return BuildError(spec.name, str(spec.directory / "build.log"), data.get("summary", ""))


def _summary(log: str) -> str:
    errors = [line.strip() for line in log.splitlines() if "error" in line]
    return errors[0][:300] if errors else log.strip()[-300:]


_compiles = 0  # nvcc runs in this process: dispatch promises none on a tuned shape


def compiles_in_process() -> int:
    return _compiles


@functools.cache
def _nvcc_slots() -> threading.BoundedSemaphore:
    """At most default_jobs() nvcc processes at once in this process, however many callers build
    in parallel: a CUTLASS compile takes a few GB of memory."""
    return threading.BoundedSemaphore(default_jobs())


def _compile(spec: BuildSpec) -> Artifact:
    directory = spec.directory
    header = directory / KERNEL_HEADER
    cache_dir.atomic_write_text(header, spec.kernel_source)
    tmp_library = directory / f".{LIBRARY}.{os.getpid()}.tmp"
    command = [nvcc_path(), *nvcc_flags(spec.arch), *(f"-D{d}" for d in spec.defines),
               f"-I{directory}",
               *(f"-I{d}" for d in cutlass_include_dirs()), "-o", str(tmp_library), str(LAUNCHER)]
    global _compiles
    with _nvcc_slots():
        _compiles += 1
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            log, ok = proc.stdout + proc.stderr, proc.returncode == 0
        except subprocess.TimeoutExpired as exc:
            log, ok = f"nvcc timed out after {BUILD_TIMEOUT_S} s\n{exc.stderr or ''}", False
        seconds = time.perf_counter() - start
    cache_dir.atomic_write_text(directory / "build.log", " ".join(command) + "\n\n" + log)
    if not ok:
        tmp_library.unlink(missing_ok=True)
        summary = _summary(log)
        cache_dir.atomic_write_json(directory / "failed.json",
                                    {"summary": summary, "seconds": seconds})
        raise BuildError(spec.name, str(directory / "build.log"), summary)
    os.replace(tmp_library, directory / LIBRARY)
    cache_dir.atomic_write_json(directory / "built.json", {"seconds": seconds, "name": spec.name})
    return Artifact(spec, directory / LIBRARY, seconds)


def is_built(spec: BuildSpec) -> bool:
    return (spec.directory / LIBRARY).exists()


def build(spec: BuildSpec, *, retry_failed: bool = False) -> Artifact:
    """The artifact for ``spec``: from the cache, or compiled now. Raises BuildError."""
    library = spec.directory / LIBRARY
    if library.exists():
        return Artifact(spec, library, 0.0)
    with filelock.FileLock(str(spec.directory) + ".lock"):
        if library.exists():  # another process built it while we waited
            return Artifact(spec, library, 0.0)
        failure = _failure(spec)
        if failure is not None and not retry_failed:
            raise failure
        (spec.directory / "failed.json").unlink(missing_ok=True)
        return _compile(spec)


def default_jobs() -> int:
    explicit = os.environ.get("CUTLASS_OPS_BUILD_JOBS")
    return max(1, int(explicit)) if explicit else max(1, os.cpu_count() or 1)


def build_many(specs: list[BuildSpec], *, jobs: int | None = None, retry_failed: bool = False,
               on_done=None) -> list[Artifact | BuildError]:
    """Builds in parallel; each result is an Artifact or the BuildError, in the order given.
    ``on_done(spec, result)`` is called as each finishes (for progress bars)."""
    results: list[Artifact | BuildError | None] = [None] * len(specs)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or default_jobs()) as pool:
        futures = {pool.submit(build, spec, retry_failed=retry_failed): i
                   for i, spec in enumerate(specs)}
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            try:
                results[i] = future.result()
            except BuildError as exc:
                results[i] = exc
            if on_done is not None:
                on_done(specs[i], results[i])
    return results  # type: ignore[return-value]

