"""The GPU a tune is for: its identity (the tuning cache's scope) and the few figures the ranking
model needs (SM count, peak tensor throughput, memory bandwidth).

Known GPUs come from a table of datasheet figures, so that ``cutlass-tune compile --dry-run`` can
rank for an H100 or H200 on a machine without one; an unknown GPU gets per-SM scaled Hopper
figures, which only changes the order in which candidates are tried, never correctness.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import functools
import re
from pathlib import Path

from custom_kernels.core.tuned_store import CacheScope
from custom_kernels.core.version import __version__


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    compute_capability: int
    sm_count: int
    peak_tflops: float  # dense bf16/f16 tensor-core peak
    dram_gbs: float  # HBM bandwidth
    l2_bytes: int

    @property
    def arch(self) -> str:
        return {90: "sm90a", 100: "sm100a"}.get(self.compute_capability, "unsupported")


# Datasheet figures (dense bf16 TFLOP/s, HBM GB/s). Order matters: first substring match wins.
KNOWN = {
    "H100_PCIE": DeviceSpec("NVIDIA H100 PCIe", 90, 114, 756.0, 2000.0, 50 << 20),
    "H100_NVL": DeviceSpec("NVIDIA H100 NVL", 90, 132, 835.0, 3900.0, 50 << 20),
    "H200": DeviceSpec("NVIDIA H200", 90, 132, 989.0, 4800.0, 50 << 20),
    "H100": DeviceSpec("NVIDIA H100 80GB HBM3", 90, 132, 989.0, 3350.0, 50 << 20),
    "H20": DeviceSpec("NVIDIA H20", 90, 78, 148.0, 4000.0, 60 << 20),
    "B200": DeviceSpec("NVIDIA B200", 100, 148, 2250.0, 8000.0, 126 << 20),
}
_PATTERNS = [("H100_PCIE", r"H100.*PCIE"), ("H100_NVL", r"H100.*NVL"), ("H200", r"H200"),
             ("H100", r"H100"), ("H20", r"\bH20\b"), ("B200", r"B200")]


def spec_for(name: str, compute_capability: int, sm_count: int) -> DeviceSpec:
    """Figures for a GPU by name, scaled to its SM count; Hopper per-SM figures if unknown."""
    for key, pattern in _PATTERNS:
        if re.search(pattern, name, re.IGNORECASE):
            known = KNOWN[key]
            scale = sm_count / known.sm_count
            return dataclasses.replace(known, name=name, sm_count=sm_count,
                                       peak_tflops=known.peak_tflops * scale)
    per_sm = KNOWN["H100"]
    return DeviceSpec(name, compute_capability, sm_count,
                      per_sm.peak_tflops / per_sm.sm_count * sm_count, per_sm.dram_gbs,
                      per_sm.l2_bytes)


def named_spec(key: str) -> DeviceSpec:
    """A table entry by its key (H100, H200, ...) for dry runs without a GPU."""
    try:
        return KNOWN[key.upper().replace("-", "_")]
    except KeyError:
        raise ValueError(f"unknown GPU {key!r}; known: {', '.join(KNOWN)}") from None


@functools.cache
def device_facts(index: int) -> tuple[int, int, str]:
    """(SM count, compute capability as 90/100, name) of a CUDA device, queried once."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major * 10 + props.minor, props.name


@functools.cache
def current_spec(index: int | None = None) -> DeviceSpec:
    import torch

    index = torch.cuda.current_device() if index is None else index
    sm_count, cc, name = device_facts(index)
    spec = spec_for(name, cc, sm_count)
    return dataclasses.replace(spec, l2_bytes=torch.cuda.get_device_properties(index).L2_cache_size)


@functools.cache
def driver_version() -> str:
    """The kernel driver's version (580.159.04): from /proc on Linux, else the CUDA driver API
    version the driver reports."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        return f"cuda-{version // 1000}.{version % 1000 // 10}"
    except Exception:  # no driver at all: the scope still names the GPU and the versions
        return "unknown"


def cutlass_version() -> str:
    """The nvidia-cutlass wheel's version (part of every cache key); "absent" without it."""
    try:
        return importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.cache
def current_scope(index: int | None = None) -> CacheScope:
    """The tuning cache's scope for a CUDA device: everything besides the problem that changes
    which kernel wins."""
    import torch

    spec = current_spec(index)
    return CacheScope(gpu=spec.name, compute_capability=spec.compute_capability,
                      sm_count=spec.sm_count, driver=driver_version(),
                      cuda=str(torch.version.cuda), cutlass=cutlass_version(),
                      library=__version__)
