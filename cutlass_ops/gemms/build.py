"""nvcc builds of emitted kernels, kept in the build cache (``custom_kernels.core.build_cache``).

An artifact is ``<cache>/<version>/artifacts/<arch>/<readable name>-<hash>/`` holding the kernel
header, ``kernel.so``, its ``built.json`` and ``build.log``. The hash covers the emitted source, our
launcher, the nvcc version, the flags, the defines and the arch, so a change to any of them builds
anew and nothing stale is loaded. A failed build keeps its log and a ``failed.json`` record: the
same failure is reported again without re-running nvcc (``retry_failed=True`` overrides), since
one costs up to minutes. Builds run in parallel (threads, each waiting on its nvcc process),
each entry built once however many callers ask for it.
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

from custom_kernels.core import build_cache, cache_dir
from custom_kernels.core.errors import BuildError, ToolchainError
from cutlass_ops.gemms.config import Arch

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
        return build_cache.key({
            "source": build_cache.digest(self.kernel_source.encode()),
            "launcher": build_cache.digest(LAUNCHER.read_bytes()), "nvcc": nvcc_version(),
            "flags": nvcc_flags(self.arch), "arch": self.arch.value,
            "defines": list(self.defines)})

    @property
    def directory(self) -> Path:
        return build_cache.entry_path("artifacts", self.arch.value, self.name, self.key)

    def adopt_legacy(self) -> None:
        """An artifact built under the key of cutlass-ops before its one build cache (length-
        prefixed byte parts) moves to today's key instead of being compiled again."""
        if self.directory.exists():
            return
        parts = [self.kernel_source.encode(), LAUNCHER.read_bytes(), nvcc_version().encode(),
                 " ".join(nvcc_flags(self.arch)).encode(), self.arch.value.encode()]
        if self.defines:
            parts.append(" ".join(self.defines).encode())
        legacy = hashlib.sha256()
        for part in parts:
            legacy.update(len(part).to_bytes(8, "little") + part)
        name = f"{self.name}-{legacy.hexdigest()[:build_cache.KEY_CHARS]}"
        build_cache.adopt(self.directory, self.directory.with_name(name), LIBRARY)

    @property
    def entry(self) -> build_cache.Entry:
        return build_cache.directory_entry(self.directory, self.name, LIBRARY, "built.json")


@dataclasses.dataclass(frozen=True)
class Artifact:
    spec: BuildSpec
    library: Path
    seconds: float  # build time; 0.0 when it came from the cache


_compiles = 0  # nvcc runs in this process: dispatch promises none on a tuned shape


def compiles_in_process() -> int:
    return _compiles


@functools.cache
def _nvcc_slots() -> threading.BoundedSemaphore:
    """At most default_jobs() nvcc processes at once in this process, however many callers build
    in parallel: a CUTLASS compile takes a few GB of memory."""
    return threading.BoundedSemaphore(default_jobs())


def _compile(spec: BuildSpec, library: Path) -> build_cache.Built:
    """Runs nvcc on our launcher around the kernel header, writing ``library``."""
    directory = spec.directory
    cache_dir.atomic_write_text(directory / KERNEL_HEADER, spec.kernel_source)
    command = [nvcc_path(), *nvcc_flags(spec.arch), *(f"-D{d}" for d in spec.defines),
               f"-I{directory}",
               *(f"-I{d}" for d in cutlass_include_dirs()), "-o", str(library), str(LAUNCHER)]
    global _compiles
    with _nvcc_slots():
        _compiles += 1
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            output, ok = proc.stdout + proc.stderr, proc.returncode == 0
        except subprocess.TimeoutExpired as exc:
            output, ok = f"nvcc timed out after {BUILD_TIMEOUT_S} s\n{exc.stderr or ''}", False
        seconds = time.perf_counter() - start
    log = " ".join(command) + "\n\n" + output
    if not ok:
        raise build_cache.BuildFailed(log)
    return build_cache.Built({"seconds": seconds, "name": spec.name}, log)


def is_built(spec: BuildSpec) -> bool:
    """Whether the artifact is on disk (a cheap listing check: ``build`` also checks that it is
    whole, and rebuilds it if not)."""
    spec.adopt_legacy()
    return (spec.directory / LIBRARY).exists()


def build(spec: BuildSpec, *, retry_failed: bool = False) -> Artifact:
    """The artifact for ``spec``: from the cache, or compiled now. Raises BuildError."""
    spec.adopt_legacy()
    published = build_cache.get_or_build(spec.entry, lambda library: _compile(spec, library),
                                         retry=retry_failed)
    return Artifact(spec, published.path, published.seconds)


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

