"""``cutlass-tune doctor``: what this machine has for building and running our kernels, and
what is missing, without failing on the first gap."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any, Callable


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check(what: str, probe: Callable[[], str], required: bool) -> dict[str, Any]:
    try:
        return {"what": what, "ok": True, "detail": probe(), "required": required}
    except Exception as exc:  # the point is to report every gap
        return {"what": what, "ok": False, "detail": str(exc)[:300], "required": required}


def _torch() -> str:
    import torch

    from custom_kernels.core.version import OLDEST_TORCH, release

    if release(torch.__version__) < OLDEST_TORCH:
        raise RuntimeError(f"torch {torch.__version__} is older than {OLDEST_TORCH[0]}."
                           f"{OLDEST_TORCH[1]}, the oldest release cutlass-ops is tested on")
    return f"torch {torch.__version__}"


def _transformers() -> str:
    from custom_kernels.core.version import OLDEST_TRANSFORMERS, release

    version = _version("transformers")
    if version is None:
        raise RuntimeError("not installed (optional: convert() of Hugging Face models)")
    if release(version) < OLDEST_TRANSFORMERS:
        raise RuntimeError(f"transformers {version} is older than {OLDEST_TRANSFORMERS[0]}."
                           f"{OLDEST_TRANSFORMERS[1]}, the oldest release convert() is tested on")
    return f"transformers {version}"


def _gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA GPU (tuning and running need "
                           "one; compiling does not)")
    from custom_kernels.core.device import current_spec, driver_version

    spec = current_spec()
    return (f"{spec.name}, cc {spec.compute_capability / 10:.1f}, {spec.sm_count} SMs, driver "
            f"{driver_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")


def _nvcc() -> str:
    from cutlass_ops.gemms.build import nvcc_path, nvcc_version

    return f"{nvcc_path()} ({nvcc_version()})"


def _nvrtc() -> str:
    """NVRTC and the CUDA headers the custom kernels compile against (nothing is compiled)."""
    from custom_kernels.jit import include_dirs, nvrtc_version

    version = nvrtc_version()
    if version == "unavailable":
        raise RuntimeError("libnvrtc cannot be loaded; the custom kernels (norms, segment_sum) "
                           "need it: install the CUDA toolkit or the nvidia-cuda-nvrtc wheel of "
                           "your CUDA version")
    return f"NVRTC {version}, headers in {include_dirs()[0]}"


def _cutlass() -> str:
    from cutlass_ops.gemms.build import cutlass_include_dirs

    version = _version("nvidia-cutlass")
    if version is None:
        raise RuntimeError("nvidia-cutlass is not installed")
    return f"nvidia-cutlass {version}, headers in {cutlass_include_dirs()[0]}"


def _package(name: str, purpose: str) -> Callable[[], str]:
    def probe() -> str:
        version = _version(name)
        if version is None:
            raise RuntimeError(f"not installed ({purpose})")
        return f"{name} {version}"
    return probe


def _host_path() -> str:
    """The compiled host path (``custom_kernels.host_ops``): off, built, or to be built on the
    first eager CUDA call (nothing is built here)."""
    import os

    from custom_kernels import host_ops

    if os.environ.get(host_ops.ENV_VAR) == "0":
        return f"off ({host_ops.ENV_VAR}=0): eager calls take the Python path"
    compiler = f"{host_ops.compiler()} ({host_ops.compiler_version()})"
    path = host_ops.built_path()
    if path is None:
        return (f"not built yet for this torch: builds on the first eager CUDA call in the "
                f"background (about 20 s) with {compiler}")
    return f"built at {path} with {compiler}"


def _cache() -> str:
    from custom_kernels.core import cache_dir
    from tuning import tuned_families

    root = cache_dir.cache_root()
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0
    caches = tuned_families.caches()
    counts: dict[str, int] = {}
    for cache in caches:
        counts[cache.family] = counts.get(cache.family, 0) + len(cache.entries())
    tuned = ", ".join(f"{family} {n}" for family, n in sorted(counts.items())) or "none"
    rejected = sum(len(cache.rejections()) for cache in caches)
    artifacts = len(list(root.rglob("kernel.so"))) if root.exists() else 0
    return (f"{root} ({size / 2**20:.1f} MiB: tuned entries {tuned}; {rejected} rejected "
            f"entries; {artifacts} built kernels; set CUTLASS_OPS_CACHE_DIR to move it)")


def diagnose() -> dict[str, Any]:
    checks = [
        _check("python", lambda: platform.python_version(), True),
        _check("torch", _torch, True),
        _check("transformers", _transformers, False),
        _check("gpu", _gpu, False),
        _check("nvcc", _nvcc, True),
        _check("cutlass", _cutlass, True),
        _check("cuda-python", _package("cuda-python", "custom kernels"), False),
        _check("nvrtc", _nvrtc, False),
        _check("host path", _host_path, False),
        _check("nvidia-matmul-heuristics",
               _package("nvidia-matmul-heuristics", "optional: better ranking"), False),
        _check("matplotlib", _package("matplotlib", "optional: cutlass-tune report"), False),
        _check("cache", _cache, True),
    ]
    missing = [c["what"] for c in checks if not c["ok"]]
    return {"checks": checks, "missing": missing,
            "missing_required": [c["what"] for c in checks if not c["ok"] and c["required"]]}
